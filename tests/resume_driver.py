"""Runs one training run and kills it at a chosen place (for tests/test_resume.py).

    python tests/resume_driver.py '{"study": {...}, "model": ..., "mode": ..., "seed": 0, "out": ...,
                                    "kill": "micro:7"}'

kill: "micro:K"     SIGKILL before the K-th call of forward_backward (from 0; replays count too);
      "evaluate:N"  SIGKILL before the N-th validation pass (1-based: 2 = after the last step of epoch 2);
      "save:N"      SIGKILL halfway through writing the N-th checkpoint file;
      "sigterm:K"   SIGTERM to itself before micro-batch K, the run started by the real command line
                    (lab.cli.main, the study written to a config file): it checkpoints at the step's end and
                    stops with the CLI's own exit status;
      "sigusr1:K"   the same with SIGUSR1 (what SLURM's --signal sends).
"""
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import yaml  # noqa: E402

from lab import cli  # noqa: E402

import lab.run.checkpoint as ckpt  # noqa: E402
import lab.run.loop as L  # noqa: E402
import lab.run.train as T  # noqa: E402
from lab.core.config import resolve_run  # noqa: E402


def main() -> int:
    spec = json.loads(sys.argv[1])
    point, n = spec["kill"].split(":")
    n = int(n)
    calls = {"micro": 0, "evaluate": 0, "save": 0}

    forward_backward, evaluate, save = L.forward_backward, L.evaluate, torch.save

    sig = {"micro": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1}.get(point)

    def counted_forward_backward(*a, **k):
        if sig is not None and calls["micro"] == n:
            os.kill(os.getpid(), sig)
        calls["micro"] += 1
        return forward_backward(*a, **k)

    def counted_evaluate(*a, **k):
        calls["evaluate"] += 1
        if point == "evaluate" and calls["evaluate"] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return evaluate(*a, **k)

    def half_save(obj, f, *a, **k):
        calls["save"] += 1
        if point == "save" and calls["save"] == n:
            f.write(b"\0" * 4096)  # a torn file, as a kill mid-write leaves it
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *a, **k)

    L.forward_backward, L.evaluate, ckpt.torch.save = counted_forward_backward, counted_evaluate, half_save
    if point in ("sigterm", "sigusr1"):  # the command a user (or the workflow) runs, its own exit path
        config = Path(spec["out"]).parent / "study.yaml"
        config.write_text(yaml.safe_dump(spec["study"]))
        return cli.main(["train", "--model", spec["model"], "--mode", spec["mode"], "--seed", str(spec["seed"]),
                         "--out", spec["out"], "--config", str(config)])
    cfg = resolve_run(spec["study"], spec["model"], spec["mode"], spec["seed"])
    try:
        T.train(cfg, Path(spec["out"]))
    except ckpt.Interrupted as e:
        print(e, file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
