import os
import sys

from lab.cli import main

code = main()
# Every command has written its files (atomically) and closed them by now. Tearing down an interpreter that holds
# torch (and, for training, torch._dynamo and timm) takes 1-2 s on a 2-core CPU, paid by every job of a study.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
