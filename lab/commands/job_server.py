"""`python -m lab job-server`: a study's training jobs served from one warm process (lab/run/warm.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    j = sub.add_parser("job-server", help="serve a study's training jobs from one warm process (the workflow starts "
                                          "it: lab/run/warm.py)")
    j.add_argument("--socket", required=True, help="Unix socket to listen on (the jobs find it in $LAB_JOB_SERVER)")
    j.add_argument("--parent", type=int, default=None, metavar="PID",
                   help="stop once this process has exited and no job is left (the workflow's pid)")
    j.set_defaults(handler=main)


def main(args) -> int:
    from lab.cli import main as run_command  # what each job runs, in a child forked from the server
    from lab.run.warm import serve
    return serve(args.socket, args.parent, run_command)
