"""Command line: `python -m lab train|aggregate|validate|diagnose|inspect|replay|replay-table|compare|figures|
tensorboard|summary-html|notebooks|claims|recipes-tables|prepare-text|job-server`.

The workflow's rules call these.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from pathlib import Path

from lab.core.config import ConfigError, apply_overrides, load_study, resolve_run
from lab.core.runfiles import RunFileError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab", description="Loss-Scale Lab")
    sub = p.add_subparsers(dest="command", required=True)

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

    a = sub.add_parser("aggregate", help="summarise run directories into tables")
    a.add_argument("runs", nargs="+", help="run directories (each holding metrics.json)")
    a.add_argument("--csv", required=True)
    a.add_argument("--md", required=True)
    a.add_argument("--confidence", type=float, default=None,
                   help="level of the intervals; the table's false discovery rate and TOST's alpha are 1 - "
                        "confidence (default 0.95)")
    a.add_argument("--margin", action="append", default=[], metavar="METRIC=VALUE",
                   help="equivalence margin for families the claims file does not declare, repeatable: top1=0.01 "
                        "(fraction) and/or val_loss=0.05 (nats)")
    a.add_argument("--declared", default=None, metavar="CLAIMS_YAML",
                   help="the claims file whose `declared:` block gives each family's margins and effects of "
                        "interest (configs/claims.yaml)")
    a.add_argument("--runs-csv", default=None, metavar="CSV",
                   help="also write the per-run table here (one row per run: model, mode, seed, val_loss and the "
                        "other numbers of its metrics.json; what a claims file's per-run claims read)")

    v = sub.add_parser("validate", help="check a study config and list its runs")
    v.add_argument("--config", action="append", default=None, metavar="FILE")

    g = sub.add_parser("diagnose", help="explain a run: overflow, skips, scale collapse/runaway, underflow")
    g.add_argument("run_dir", help="run directory (holding metrics.json and steps.csv)")
    g.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")

    r = sub.add_parser("replay", help="replay loss-scaling policies over a recorded run: scales, skips, underflow")
    r.add_argument("run_dir", help="run directory (holding steps.csv with grad_amax, config.yaml, grad_hist.csv)")
    r.add_argument("--policy", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="a policy and its parameters, e.g. dynamic:growth_interval=100 (repeatable; "
                        "default: every registered policy at its defaults)")
    r.add_argument("--recipe", action="append", default=None, metavar="NAME",
                   help="an FP8 run (fp8_operands.pt): replay this recipe on its tensors (repeatable; default: "
                        "every registered recipe)")
    r.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    r.add_argument("--trajectory", metavar="CSV", default=None,
                   help="also write every replayed policy's per-step scale, overflow and skip to this CSV")

    rt = sub.add_parser("replay-table", help="replay the study's FP16 policies on every run, and check replay "
                                             "against the real runs (the agreement table)")
    rt.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    rt.add_argument("--csv", required=True, help="replay.csv to write (one row per run and replayed mode)")
    rt.add_argument("--agreement-csv", required=True, help="the agreement table (CSV) to write")
    rt.add_argument("--agreement-md", required=True, help="the agreement table (Markdown) to write")

    ins = sub.add_parser("inspect", help="where a run stands (a lab run or a recording), from its files so far")
    ins.add_argument("run_dir")
    ins.add_argument("--follow", action="store_true", help="print a line as new steps arrive, until it finishes")
    ins.add_argument("--interval", type=float, default=2.0, help="seconds between looks with --follow (default 2)")
    ins.add_argument("--json", action="store_true", help="print the state as JSON")

    cp = sub.add_parser("compare", help="two modes side by side, paired by seed: skipped and overflow steps, "
                                        "flushed shares, validation loss (left - right, with intervals)")
    cp.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    cp.add_argument("--left", required=True, help="mode, e.g. fp16-amax")
    cp.add_argument("--right", required=True, help="mode, e.g. fp16-dynamic")
    cp.add_argument("--md", default=None, help="Markdown table to write")
    cp.add_argument("--csv", default=None, help="CSV to write")
    cp.add_argument("--confidence", type=float, default=0.95)
    cp.add_argument("--readme", default=None, help="also replace the README's section between "
                    "<!-- compare:start --> and <!-- compare:end --> with the table")

    f = sub.add_parser("figures", help="write the study's figures (PNG, per model) from a results folder")
    f.add_argument("--results", default="results", help="results folder (holding runs/); default: results")
    f.add_argument("--runs", nargs="+", default=None, metavar="RUN_DIR",
                   help="use exactly these run directories instead of every run under --results")
    f.add_argument("--model", action="append", default=None, help="only this model (repeatable)")
    f.add_argument("--out", default="results/figures", help="figures folder; default: results/figures")
    f.add_argument("--study-modes", nargs="*", default=(), metavar="MODE",
                   help="the study's modes: one a model has no runs of gets a figure saying so")

    fs = sub.add_parser("first-steps", help="a vision-language run's first steps measured again with hooks: the "
                        "encoder's feature spread and each branch's gradient range (lab/report/first_steps.py)")
    fs.add_argument("--config", action="append", required=True, metavar="FILE")
    fs.add_argument("--model", required=True)
    fs.add_argument("--modes", nargs="+", required=True)
    fs.add_argument("--seed", type=int, default=0)
    fs.add_argument("--steps", type=int, default=300)
    fs.add_argument("--csv", required=True)
    fs.add_argument("--png", required=True)
    fs.add_argument("--threads", type=int, default=1, help="torch threads: the study's, for the same trajectory")

    b = sub.add_parser("tensorboard", help="convert runs' steps.csv + metrics.json into TensorBoard event files")
    b.add_argument("runs", nargs="+", help="run directories, or results folders holding runs/")
    b.add_argument("--out", default="results/tensorboard", help="event folder root; default: results/tensorboard")

    h = sub.add_parser("summary-html", help="render the summary table (summary.csv) as a standalone HTML page")
    h.add_argument("csv", help="results/tables/summary.csv")
    h.add_argument("--out", required=True, help="HTML file to write")

    n = sub.add_parser("notebooks", help="execute the notebooks against a results folder and write each one with "
                                         "its outputs (.ipynb) and as HTML")
    n.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                   help="notebooks to execute (default: every notebooks/*.ipynb of this repository)")
    n.add_argument("--results", default="results", help="the results folder they read ($LAB_RESULTS); "
                   "default: results")
    n.add_argument("--out", default=None, help="folder to write NAME.ipynb and NAME.html to; default: "
                   "RESULTS/notebooks")
    n.add_argument("--timeout", type=int, default=None, metavar="S",
                   help="seconds one cell may run (default: lab.report.notebooks.CELL_TIMEOUT_S, 600)")

    c = sub.add_parser("claims", help="check the source study's claims (configs/claims.yaml) against summary.csv")
    c.add_argument("--summary", default="results/tables/summary.csv", help="default: results/tables/summary.csv")
    c.add_argument("--claims", default="configs/claims.yaml", help="default: configs/claims.yaml")
    c.add_argument("--md", default="results/tables/claims.md", help="markdown table to write; "
                   "default: results/tables/claims.md")
    c.add_argument("--readme", default=None, help="also replace the README's section between "
                   "<!-- claims:start --> and <!-- claims:end --> with the source's claims across every study "
                   "(lab/report/source_claims.py): this file's as decided, the others' from their claims.md")
    c.add_argument("--json", action="store_true", help="print the records as JSON instead of text")
    c.add_argument("--runs", default=None, metavar="CSV", help="a per-run table (one row per run: model, mode, seed "
                   "and its measurements; `lab aggregate --runs-csv` writes one) for claims that read it: a file's "
                   "(reads: runs, as configs/claims_fp8.yaml) or a claim's (configs/claims.yaml); default: the "
                   "runs.csv beside --summary, when there is one")
    c.add_argument("--max-seeds", type=int, default=None, metavar="N",
                   help="a claim that would need more seeds (paired, or per row) than N is out of reach "
                        "(default: lab.study.claims.REACH, 20)")
    c.add_argument("--power", type=float, default=None, metavar="P",
                   help="the power at which the seeds needed are sized (default: lab.study.claims.REACH, 0.8)")
    c.add_argument("--horizon-intervals", type=float, default=None, metavar="K",
                   help="overflow claims need runs of at least K growth intervals of the policy "
                        "(default: lab.study.claims.REACH, 3)")
    j = sub.add_parser("job-server", help="serve a study's training jobs from one warm process (the workflow starts "
                                          "it: lab/run/warm.py)")
    j.add_argument("--socket", required=True, help="Unix socket to listen on (the jobs find it in $LAB_JOB_SERVER)")
    j.add_argument("--parent", type=int, default=None, metavar="PID",
                   help="stop once this process has exited and no job is left (the workflow's pid)")
    from lab.data import tokens
    from lab.scaling.learning import commands as controller_commands
    tokens.add_parser(sub)  # prepare-text: its arguments live with its code (lab/data/tokens.py)
    controller_commands.add_parser(sub)  # fit-controller, judge-controllers: lab/scaling/learning/commands.py
    r = sub.add_parser("recipes-tables", help="the FP8/FP4 recipe study's tables: runs.csv, recipes.csv, recipes.md "
                                              "(lab/report/recipes_table.py)")
    r.add_argument("runs", nargs="+", help="results folder(s), runs/ folders or run directories (runs.csv written "
                   "too), or the study's runs.csv (`lab aggregate --runs-csv`; the workflow's)")
    r.add_argument("--out", required=True, help="folder for runs.csv, recipes.csv and recipes.md")
    r.add_argument("--figure", default=None, help="also draw the study's figure (PNG) there")
    from lab.rl import grpo_commands
    grpo_commands.add_parser(sub)  # rl-base, rl-train, rl-aggregate, ...: lab/rl/grpo_commands.py
    from lab.rl import dpo_commands
    dpo_commands.add_parser(sub)  # rl-dpo-base, rl-dpo-train, rl-dpo-aggregate: lab/rl/dpo_commands.py
    return p


def _runs_on(study: dict) -> str:
    """Where a study's runs train and whose numerics its results hold (make study prints it first)."""
    import torch
    device = study["device"]
    on = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    what = ("CUDA's own FP16/BF16 kernels (a GPU study)" if on == "cuda"
            else "the CPU's FP32 kernels, FP16/BF16 under the tensor-core contract (a CPU study)")
    why = " (device: auto, on this machine)" if device == "auto" else ""
    return f"runs on: {on}{why}: {what}; results in {study['results_dir']}/"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "aggregate":
            from lab.study.aggregate import aggregate
            from lab.study.claims.file import load_declared, load_trajectory
            declared = load_declared(args.declared) if args.declared else None
            aggregate(args.runs, args.csv, args.md, _stats_args(args), declared,
                      load_trajectory(args.declared) if args.declared else None, args.runs_csv)
            return 0
        if args.command == "validate":
            from lab.rl.grpo_study import rl_runs
            from lab.rl.study import is_rl_file, load_rl_study
            if args.config and len(args.config) == 1 and is_rl_file(args.config[0]):  # configs/rl.yaml
                rl = load_rl_study(args.config[0])
                dpo = (f"; DPO: {len(rl['dpo']['modes'])} modes x {len(rl['dpo']['seeds'])} seeds from its own base"
                       if rl["dpo"] else "")
                print(f"config OK: RL study, {len(rl['modes'])} modes, {len(rl_runs(rl))} GRPO runs "
                      f"(seeds and steps per mode) from one base{dpo}")
                print(f"runs on: cpu (the sampler's and learner's FP16/BF16 under the tensor-core contract); results in "
                      f"{rl['results_dir']}/")
                return 0
            from lab.core.study import family_modes, family_seeds, study_runs
            study = load_study(args.config)
            runs = study_runs(study)
            seeds = sorted({len(family_seeds(study, m)) for m in study["models"]})
            modes = sorted({len(family_modes(study, m)) for m in study["models"]})
            print(f"config OK: {len(study['models'])} models x {'/'.join(map(str, modes))} modes x "
                  f"{'/'.join(map(str, seeds))} seeds = {len(runs)} runs")
            print(_runs_on(study))
            return 0
        if args.command == "diagnose":
            return _diagnose(args)
        if args.command in ("replay", "replay-table"):
            return _replay(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command in ("figures", "tensorboard", "summary-html"):
            return _outputs(args)
        if args.command == "first-steps":
            return _first_steps(args)
        if args.command == "notebooks":
            return _notebooks(args)
        if args.command == "claims":
            return _claims(args)
        if args.command == "recipes-tables":
            from lab.report import recipes_table
            return recipes_table.main(args)
        if args.command == "job-server":
            from lab.run.warm import serve
            return serve(args.socket, args.parent, main)
        from lab.rl.grpo_commands import COMMANDS as RL_COMMANDS  # torch-free
        if args.command in RL_COMMANDS:
            from lab.rl.grpo_commands import main as rl_main
            return rl_main(args)
        if args.command in ("rl-dpo-base", "rl-dpo-train", "rl-dpo-aggregate"):
            from lab.rl.dpo_commands import main as dpo_main
            return dpo_main(args)
        if args.command in ("fit-controller", "judge-controllers"):
            from lab.scaling.learning.commands import main as controllers_main
            return controllers_main(args)
        if args.command == "prepare-text":
            from lab.data.tokens import main as prepare_text
            return prepare_text(args)
    except ConfigError as e:
        return _refuse(e)
    except FileNotFoundError as e:
        return _refuse(e)
    except RunFileError as e:  # a damaged file in a run directory (lab/core/runfiles.py): its path and line
        return _refuse(e)
    return 1


def _refuse(e: BaseException) -> int:
    """Bad input: one line on stderr (the key or path, what was expected, what was found), exit status 2."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines) or type(e).__name__}", file=sys.stderr)
    return 2


def _train(args) -> int:
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
        import json
        jobs.write_record(args.done, args.model, args.mode, [
            (run.seed, out, json.loads((out / "metrics.json").read_text())) for run, out in runs])
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
    except (DataError, CheckpointError, RunDirError, StudyLocked, BaseModelError, EncoderError) as e:
        return _refuse(e)
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


def _stats_args(args) -> dict:
    """The study's `stats:` block from --confidence / --margin (what workflow/rules/aggregate.smk passes)."""
    from lab.study.aggregate import STAT_METRICS
    cfg: dict = {"margins": {}}
    if args.confidence is not None:
        if not 0.5 < args.confidence < 1:
            raise ConfigError(f"--confidence {args.confidence}: must lie between 0.5 and 1")
        cfg["confidence"] = args.confidence
    for item in args.margin:
        name, _, value = item.partition("=")
        if name not in STAT_METRICS:
            raise ConfigError(f"--margin {item}: unknown metric {name!r}; allowed: {', '.join(STAT_METRICS)}")
        try:
            cfg["margins"][name] = float(value)
        except ValueError:
            raise ConfigError(f"--margin {item}: {value!r} is not a number") from None
        if not cfg["margins"][name] > 0:
            raise ConfigError(f"--margin {item}: the margin must be positive")
    return cfg


def _diagnose(args) -> int:
    from lab.diagnose import DiagnoseError, diagnose, format_json, format_text
    try:
        d = diagnose(args.run_dir)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_json(d) if args.json else format_text(d))
    return 0


def _replay(args) -> int:
    """`replay RUN_DIR`: a table (or JSON) of the policies replayed on one run; `replay-table`: the study's tables."""
    import json
    from lab.diagnose.replay import REPLAY_COLUMNS, ReplayError, default_policies, parse_policy, read_run, replay
    if args.command == "replay" and (args.recipe or (not args.policy and (Path(args.run_dir) / "fp8_operands.pt")
                                                     .is_file())):
        return _replay_recipes(args)
    try:
        if args.command == "replay-table":
            from lab.report.replay_table import agreement_markdown, write_replay_tables
            agree = write_replay_tables(args.runs, args.csv, args.agreement_csv, args.agreement_md, sys.stderr)
            sys.stdout.write(agreement_markdown(agree))
            return 0
        specs = [parse_policy(p) for p in args.policy] if args.policy else default_policies()
        record = read_run(args.run_dir)
        rows = [replay(record, name, params, trajectory=bool(args.trajectory)) for name, params in specs]
    except ReplayError as e:
        return _refuse(e)
    if args.trajectory:
        from lab.core import files
        traj = [{"policy": r["policy"], "params": r["params"], "step": st, "scale": sc, "overflow": int(o),
                 "skipped": int(k)} for r in rows for st, sc, o, k in r.pop("trajectory")]
        files.atomic_write_csv(args.trajectory, traj, ["policy", "params", "step", "scale", "overflow", "skipped"])
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    print(f"{args.run_dir}: {len(record.steps)} steps, backward = step gradient / {record.divisor}, activation "
          f"headroom {record.headroom} binade(s), {len(record.hist)} census steps")
    width = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in REPLAY_COLUMNS[:-1]}
    print("  ".join(c.ljust(width[c]) for c in width))
    for r in rows:
        print("  ".join(_cell(r[c]).ljust(width[c]) for c in width) + (f"  ({r['ended_reason']})"
                                                                         if r["ended_reason"] else ""))
    _replay_predictors(args.run_dir)
    return 0


def _replay_predictors(run_dir) -> None:
    """An FP8 run's recorded amax histories (fp8_amax.csv): every registered predictor as delayed scaling's rule at
    history lengths 16, 128 and 1024, its clipped steps and unused binades per role (lab/scaling/learning/judge.py)."""
    from lab.scaling.learning import artefact, histories
    from lab.scaling.learning.judge import judge
    from lab.scaling.predictors import available_predictors
    hs = histories.read([run_dir], "fp8")
    if not hs:
        return
    print(f"\nFP8 delayed scaling's predictors over this run's amax histories ({len(hs)} tensors, "
          f"{len(hs[0].amax)} steps): clipped steps (%) / unused binades, per role")
    names = [p for p in available_predictors() if p != "learned" or artefact.exists("auto", "learned-fp8")]
    for name in names:
        for n in (16, 128, 1024):
            rows = {r["role"]: r for r in judge(hs, name, n)}
            print(f"  {name:<12} {n:>5}  " + "  ".join(
                f"{role} {rows[role]['clipped_pct']:.3g}% / {rows[role]['unused_binades']:.3g}"
                for role in ("input", "weight", "grad_output") if role in rows))


def _replay_recipes(args) -> int:
    """`replay RUN_DIR` on an FP8 run: every recipe (or each --recipe) quantizing the run's own tensors."""
    import json
    from lab.fp8.replay import Fp8ReplayError, format_table, replay_run
    try:
        rows = replay_run(args.run_dir, args.recipe)
    except Fp8ReplayError as e:
        return _refuse(e)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    print(f"{args.run_dir}: every recipe on this run's own tensors (its latest census step); shares in percent of "
          "each tensor kind, err: the mean relative quantization error")
    print(format_table(rows))
    return 0


def _inspect(args) -> int:
    import json
    from lab.diagnose.inspect import InspectError, follow, format_inspect, inspect_run
    try:
        if args.follow:
            follow(args.run_dir, args.interval)
            return 0
        state = inspect_run(args.run_dir)
    except InspectError as e:
        return _refuse(e)
    print(json.dumps(state, indent=2) if args.json else format_inspect(state))
    return 0


def _compare(args) -> int:
    from lab.core import files
    from lab.report.load import load_metrics
    from lab.study.compare import COMPARE_MARKERS, compare_modes, comparison_markdown
    runs = load_metrics(args.runs)
    missing = [m for m in (args.left, args.right) if runs.empty or m not in set(runs["mode"])]
    if missing:
        raise ConfigError(f"--left/--right: no finished runs of mode {', '.join(map(repr, missing))} under "
                          f"{' '.join(args.runs)}")
    from lab.study.verdicts import read_outcomes
    runs = runs.reset_index(drop=True)
    table = compare_modes(runs, args.left, args.right, args.confidence, read_outcomes(runs["run_dir"]))
    markdown = comparison_markdown(table)
    if args.md:
        files.atomic_write_text(args.md, markdown)
    if args.csv:
        files.atomic_write_text(args.csv, table.to_csv(index=False))
    if args.readme:
        from lab.study.claims import ClaimsError, write_readme_section
        try:
            write_readme_section(args.readme, markdown, COMPARE_MARKERS)
        except ClaimsError as e:
            return _refuse(e)
    sys.stdout.write(markdown)
    return 0


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _claims(args) -> int:
    """Evaluate every claim, print it, write the markdown (and the README section); 2 on bad input.

    A file that reads the per-run table (reads: runs) is decided on it alone; a summary file's claims that read it
    (a claim's `reads: runs`) get it too: --runs, else the runs.csv beside the summary when there is one.
    Contradicted claims are findings, not failures: the exit status is 0 whatever the verdicts.
    """
    import json
    from lab.core import files
    from lab.core.runfiles import read_csv_frame
    from lab.study import claims
    try:
        if args.runs is None and (Path(args.summary).parent / "runs.csv").is_file():
            args.runs = str(Path(args.summary).parent / "runs.csv")
        if args.runs and _reads_runs(args.claims):
            return _claims_on_runs(args)
        reach = {"max_seeds": args.max_seeds, "power": args.power, "horizon_intervals": args.horizon_intervals}
        reach = {k: v for k, v in reach.items() if v is not None}
        declared, summary = claims.load_claims(args.claims), claims.load_summary(args.summary)
        tables = {"summary": summary}
        if args.runs and Path(args.runs).is_file():
            tables["runs"] = read_csv_frame(Path(args.runs), ("model", "mode", "seed"))
        plans = claims.load_sequential(args.claims)
        records = claims.evaluate(declared, tables, reach, plans)
        plan = claims.sequential_alpha(plans, summary, 0.05)[1]   # the plan in words (the records hold its level)
        on_runs = any(c.get("reads") == "runs" for c in declared)
        markdown = claims.to_markdown(records, reach, plan, runs=on_runs)
        if args.readme:
            from lab.study.aggregate import FINDINGS_MARKERS, findings_markdown
            why = claims.table_disagreements(declared, records, summary)
            # the README's one table of the source's claims, every study that decides some (lab/report/source_claims.py):
            # this file's verdicts as just decided, the other studies' from their committed claims.md
            from lab.report.source_claims import readme_table
            extra = ("Table and claims: " + " ".join(why)) if why else ""
            claims.write_readme_section(args.readme, readme_table(Path("."), {args.claims: markdown}, extra))
            if FINDINGS_MARKERS[0] in Path(args.readme).read_text():  # the compact findings table, if it has one
                claims.write_readme_section(args.readme, findings_markdown(summary), FINDINGS_MARKERS)
    except claims.ClaimsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files.atomic_write_text(args.md, markdown)
    sys.stdout.write(json.dumps(records, indent=2) + "\n" if args.json else claims.to_text(records))
    return 0


def _reads_runs(path) -> bool:
    """The claims file says `reads: runs` at its top (configs/claims_fp8.yaml): its claims read the per-run table."""
    import yaml
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and raw.get("reads") == "runs"


def _claims_on_runs(args) -> int:
    """A claims file that reads the per-run table (reads: runs), decided by the same engine; 2 on bad input."""
    import json
    from lab.core import files
    from lab.core.runfiles import read_csv_frame
    from lab.study import claims
    try:
        cfg = claims.load_file(args.claims, reads="runs")
        tables = {"runs": read_csv_frame(Path(args.runs), ("model", "mode", "seed"))}
        if Path(args.summary).is_file():
            tables["summary"] = claims.load_summary(args.summary)
        reach = {k: v for k, v in {"max_seeds": args.max_seeds, "power": args.power}.items() if v is not None}
        records = claims.evaluate(cfg, tables, reach or None)
    except claims.ClaimsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    alpha = records[0]["alpha"] if records else cfg.get("alpha", 0.05)
    intro = (f"Declared before the runs ({args.claims}), decided on {args.runs}. Every test's p-value is adjusted "
             f"with Holm's method over all {sum(len(r['tests']) for r in records)} tests of the file (family-wise "
             f"error rate {alpha:g}); the unit is the run's seed, paired across modes. Generated by `python -m lab "
             f"claims --runs`.")
    files.atomic_write_text(args.md, claims.markdown_by_test(records, "The claims, decided", intro))
    sys.stdout.write(json.dumps(records, indent=2, default=str) + "\n" if args.json else claims.to_text(records))
    return 0


def _notebooks(args) -> int:
    """Every notebook executed and rendered, or exit status 1 naming each notebook and cell that raised."""
    from lab.report import notebooks
    paths = args.notebooks or notebooks.notebook_paths()
    out = args.out or str(Path(args.results) / "notebooks")
    try:
        written = notebooks.execute(paths, args.results, out, args.timeout or notebooks.CELL_TIMEOUT_S)
    except ValueError as e:
        return _refuse(e)
    except notebooks.NotebookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _outputs(args) -> int:
    """figures | tensorboard | summary-html: what the report rules call (workflow/rules/report.smk)."""
    if args.command == "figures":
        import matplotlib
        matplotlib.use("Agg")
        from lab.report.figures import write_all
        written = write_all(args.runs or args.results, args.out, models=args.model, study_modes=args.study_modes)
    elif args.command == "tensorboard":
        from lab.report.tensorboard import export
        written = export(args.runs, args.out)
    else:
        import pandas as pd
        from lab.core import files
        from lab.report.summary_html import summary_html
        files.atomic_write_text(args.out, summary_html(pd.read_csv(args.csv)))
        written = [Path(args.out)]
    if not written:
        print(f"error: no runs found under {args.runs or args.results}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _first_steps(args) -> int:
    from lab.report.first_steps import FirstStepsError, write
    if args.steps < 1:
        raise ConfigError(f"--steps: expected at least 1; found {args.steps}")
    try:
        write(load_study(args.config), args.model, args.modes, args.seed, args.steps, args.threads, args.csv, args.png)
    except FirstStepsError as e:
        return _refuse(e)
    return 0
