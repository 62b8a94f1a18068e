"""A warm process that starts a study's training jobs: each job forked from it with torch, timm and the training code
already imported, instead of a fresh interpreter importing them.

Every training job of a study is a `python -m lab train ...` process, and on a 2-core CPU such a process spends ~5 s
importing torch, torch._dynamo and timm before its first step: ~130 core-seconds over the default study's 26 jobs,
~10% of the study. On a local run the workflow starts one server per study (Snakefile `onstart`) and sets
LAB_JOB_SERVER to its socket; `python -m lab train ...` then hands its command line, working directory, environment
and standard output and error to the server, which forks a child to run it exactly as the command would have run
(`lab.cli.main`), and the command waits for the child's exit status and exits with it. Signals the command receives
(SIGTERM, SIGUSR1, SIGINT) go on to the child, which checkpoints as a job would. Processes keep the workflow's
process group: a kill -9 of the study's group ends the server and every job, as it ends plain jobs; a command killed
alone leaves its job running, as a plain job's forked runs do (lab/run/jobs.py).

Without a server (a cluster's node, torchrun's ranks, the variable unset, a socket nobody answers) the command runs
in its own process as before. What torch read from the environment at import (thread and ISA variables) comes from
the server's, which is the workflow's environment, as every job's is.

    python -m lab job-server --socket PATH [--parent PID]      # the workflow starts it; it stops when PID does
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

ENV = "LAB_JOB_SERVER"
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_MAX_MESSAGE = 1 << 20
_DISTRIBUTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # torchrun's ranks run as their own processes


# --- the command's side -------------------------------------------------------------------------------------------
def run_on_server(argv: list[str]) -> int | None:
    """Run `lab ARGV` in a child of the study's job server and return its exit status; None when there is no server
    to run it (the caller then runs it in its own process). Only training commands go to the server."""
    path = os.environ.get(ENV)
    if not path or not argv or argv[0] != "train" or any(k in os.environ for k in _DISTRIBUTED):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [request], [1, 2])
    reply = conn.recv(64)  # b"pid N" once the server has forked the job (after its imports, at the study's start)
    if not reply.startswith(b"pid "):
        print(f"lab: the job server at {path} did not start the job ({reply!r})", file=sys.stderr)
        return 1
    pid = int(reply.split()[1])
    for s in FORWARDED:
        signal.signal(s, lambda signum, frame: os.kill(pid, signum))
    reply = conn.recv(64)  # b"exit CODE" when the child has exited (a forwarded signal interrupts and resumes it)
    conn.close()
    if not reply.startswith(b"exit "):
        print(f"lab: the job server at {path} went away while job {pid} ran", file=sys.stderr)
        return 1
    return int(reply.split()[1])


# --- the server's side --------------------------------------------------------------------------------------------
def serve(path: str, parent: int | None, main) -> int:
    """Listen on ``path`` (bound before the imports: commands that arrive meanwhile wait in its backlog), import what
    every run imports, then fork a child per command (``main(argv)``: lab.cli's) until ``parent`` has exited and no
    child is left."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # the workflow's stop: clean up the socket
    from lab.run.jobs import warm_imports
    warm_imports()
    print(f"job server {os.getpid()}: ready on {path}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> the command's connection
    try:
        while running or parent is None or _alive(parent):
            for key, _ in sel.select(timeout=0.2):
                conn, _ = listener.accept()
                pid = _start(conn, listener, running, main)
                if pid is not None:
                    running[pid] = conn
            _reap(running)
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)
        if os.path.basename(os.path.dirname(path)).startswith("lab-jobs-"):  # start_server's folder
            os.rmdir(os.path.dirname(path))
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True


def _start(conn: socket.socket, listener: socket.socket, running: dict, main) -> int | None:
    """Fork the child that runs one command; tell the command its pid."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
        request = json.loads(data)
    except (OSError, ValueError) as e:
        print(f"job server: a bad request ({e})", file=sys.stderr, flush=True)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in running.values():
            other.close()
        conn.close()
        _child(request, fds, main)
    for fd in fds:
        os.close(fd)
    print(f"job server: job {pid}: lab {' '.join(request['argv'])}", flush=True)
    try:
        conn.send(f"pid {pid}".encode())
    except OSError:  # the command is gone already: its job runs on, as a plain job's runs do
        pass
    return pid


def _child(request: dict, fds: list[int], main) -> None:
    """The forked child: the command's streams, folder and environment, then the command itself."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, target in zip(fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
        sys.argv = ["lab"] + request["argv"]
        code = main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  (reported as an uncaught exception of the command would be)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(running: dict) -> None:
    """Send each finished child's exit status to its command (128 + N for a child killed by signal N)."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.send(f"exit {128 - code if code < 0 else code}".encode())
        except OSError:
            pass
        conn.close()


def start_server(folder: str, log_path: str) -> tuple[object, str]:
    """Start a server for this process's jobs (the workflow's onstart): (its Popen, its socket's path). The socket
    lives in a new temporary folder (a Unix socket's path has at most 107 bytes)."""
    import subprocess
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="lab-jobs-"), "socket")
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "lab", "job-server", "--socket", path, "--parent",
                             str(os.getpid())], cwd=folder, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # bound before its imports: jobs connecting from now on wait for it
    return proc, path
