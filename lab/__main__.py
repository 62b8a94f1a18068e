import os
import sys

from lab.run.warm import run_on_server

# A study's training job hands itself to the study's warm job server when there is one (lab/run/warm.py)
code = run_on_server(sys.argv[1:])
if code is None:
    from lab.cli import main
    code = main()
# Every command has written its files (atomically) and closed them by now. Tearing down an interpreter that holds
# torch (and, for training, torch._dynamo and timm) takes 1-2 s on a 2-core CPU, paid by every job of a study.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
