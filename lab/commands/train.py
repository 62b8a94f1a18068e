"""`python -m lab train`: one (model, mode, seed) run into a run directory, or several seeds (lab/run/train.py)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from lab.commands import refuse
from lab.core.config import ConfigError, apply_overrides, load_study, resolve_run


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train one (model, mode, seed) run into a run directory, or several seeds")
    t.add_argument("--model", required=True, help="model family defined in the config (e.g. resnet50)")
    t.add_argument("--mode", required=True, help="mode defined in the config (e.g. fp16-dynamic)")
    t.add_argument("--seed", type=int, action="append", default=None,
                   help="seed (default 0); repeat to train several seeds one after another, each in a process "
                        "forked from this one (lab/run/jobs.py); --out then names {seed}")
    t.add_argument("--out", required=True, help="run directory to write; with several seeds a path holding "
                   "{seed}, e.g. runs/vit/fp32/seed{seed}")
    t.add_argument("--config", action="append", default=None, metavar="FILE",
                   help="study config; repeat to merge several (default: configs/default.yaml)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a resolved run setting, e.g. train.epochs=2 or mode.scaler.init_scale=1024")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's threads)")
    t.add_argument("--expect-hash", action="append", default=None, help=argparse.SUPPRESS)
    t.add_argument("--recover-finished", action="store_true",
                   help="keep a copy of the finished run in OUT/.finished/ and restore such a copy of this config "
                        "instead of training (the workflow passes it; lab/run/finished.py)")
    t.add_argument("--run-log", action="store_true",
                   help="also append the run's output to OUT/train.log (the workflow passes it)")
    t.add_argument("--done", default=None, metavar="FILE",
                   help="when every seed has trained, write FILE: each seed's run folder, status and config hash "
                        "(the workflow's record of the job)")
    t.set_defaults(handler=main)


def main(args) -> int:
    study = load_study(args.config)
    seeds, hashes = args.seed or [0], args.expect_hash or []
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seed: expected each seed once; found {seeds}")
    if len(seeds) > 1 and "{seed}" not in args.out:
        raise ConfigError(f"--out {args.out}: with several seeds, expected a path holding {{seed}} (one folder per "
                          "seed, e.g. runs/vit/fp32/seed{seed})")
    if hashes and len(hashes) != len(seeds):
        raise ConfigError(f"--expect-hash: expected one per seed ({len(seeds)}); found {len(hashes)}")
    runs = []  # every seed's config resolved and checked before any trains: bad input leaves nothing behind
    for i, seed in enumerate(seeds):
        run = apply_overrides(resolve_run(study, args.model, args.mode, seed), args.set)
        if args.threads:  # before the hash: the run trains with this RunConfig, whose hash is computed once
            run = dataclasses.replace(run, threads=args.threads)
        if hashes and hashes[i] != run.hash():
            raise ConfigError(f"resolved run config hash {run.hash()} differs from the workflow's {hashes[i]}: "
                              "the config the workflow validated is not the one this command loaded")
        runs.append((run, Path(args.out.replace("{seed}", str(seed)))))
    from lab.run import jobs
    if len(runs) == 1:
        code = _train_one(args, *runs[0])
    else:  # forked from this process, or (runs that may use CUDA) each in a fresh interpreter
        code = jobs.run_each(runs, functools.partial(_train_each, args),
                             jobs.start_method(run.device for run, _ in runs))
    from lab.run.distributed import is_main_process
    if code == 0 and args.done and is_main_process():  # torchrun: rank 0 writes the record
        from lab.core.runfiles import read_json
        jobs.write_record(args.done, args.model, args.mode, [
            (run.seed, out, read_json(out / "metrics.json")) for run, out in runs])
    return code


def _train_each(args, item) -> int:
    """One (run, out) of a job's seeds (a module-level function: a spawned child unpickles it)."""
    return _train_one(args, *item)


def _train_one(args, run, out: Path) -> int:
    from contextlib import nullcontext
    from lab.run.distributed import is_main_process
    from lab.run.jobs import run_log
    # under torchrun every rank runs this command: rank 0's output goes to the run folder's log
    with run_log(out) if args.run_log and is_main_process() else nullcontext():
        return _train_run(args, run, out)


def _train_run(args, run, out: Path) -> int:
    from lab.data.datasets import DataError
    from lab.core.lock import StudyLocked
    from lab.run.checkpoint import CheckpointError, Interrupted
    from lab.run.distributed import is_main_process
    from lab.run.train import RunDirError, train
    from lab.models.lora import BaseModelError
    from lab.models.multimodal import EncoderError
    name = f"{args.model}/{args.mode}/seed{run.seed}"
    try:
        metrics = train(run, out, recover_finished=args.recover_finished)
    # ConfigError too: with several seeds each trains in a child, whose refusal is one line as the first's would be
    except (ConfigError, DataError, CheckpointError, RunDirError, StudyLocked, BaseModelError, EncoderError) as e:
        return refuse(e)
    except Interrupted as e:  # a scheduler's signal: the checkpoint is written, the next attempt resumes
        if is_main_process():  # torchrun: rank 0 wrote it
            print(f"{name}: {e}", file=sys.stderr)
        return 128 + e.signum
    if not is_main_process():  # torchrun: rank 0 reports (and wrote the run directory)
        return 0
    print(f"{name}: status {metrics['status']}, "
          f"top-1 {metrics['final_top1']:.4f}, skipped {metrics['skipped_steps']}/{metrics['steps']} steps, "
          f"final scale {metrics['final_scale']:g}, {metrics['wall_s']:.1f} s -> {out}")
    return 0
