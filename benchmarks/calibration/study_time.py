"""Where a study's time went, from its own logs: inside the runs, and everything outside them.

Reads the Snakemake log of one `snakemake --cores N` invocation (.snakemake/log/*.snakemake.log: each job's start
and finish, second resolution) and every run's metrics.json (`wall_s`: train() from its first line to metrics.json,
in the job's process). The study's core-seconds are cores x wall time, from Snakemake's start (the log's `Date:`)
to its last finished job. Inside the runs: the runs' wall_s times their threads. Outside, split into:
  - training jobs outside their runs: each train job's duration minus its runs' wall_s (the process's start-up
    and imports, forking, writing the job record, exit);
  - every other rule's jobs (aggregate, figures, replay, notebooks, ...), by rule;
  - idle cores: the rest (Snakemake's start-up and its work between jobs, a core left idle while the other
    finishes the last jobs).

    python benchmarks/calibration/study_time.py [STUDY_FOLDER] [--log LOG] [--cores 2] [--results results]
                                    [--out results/benchmarks/study_time.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\S+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
THREADS = re.compile(r"^\s+threads: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+)")
OUTPUT = re.compile(r"^\s+output: (\S+)")


def parse_log(path: Path) -> tuple[datetime, dict]:
    """(when Snakemake started, {jobid: {rule, start, end, threads, output}}) from one Snakemake log."""
    lines = path.read_text().splitlines()
    started = next(datetime.strptime(line.split("Date:")[1].strip(), "%Y-%m-%d %H:%M:%S")
                   for line in lines if line.strip().startswith("Date:"))
    jobs, stamp, current = {}, None, None
    for line in lines:
        if m := STAMP.match(line):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif m := RULE.match(line):
            current = {"rule": m.group(1), "start": stamp, "threads": 1, "output": None}
        elif current is not None and (m := JOBID.match(line)):
            jobs[int(m.group(1))] = current
        elif current is not None and (m := THREADS.match(line)):
            current["threads"] = int(m.group(1))
        elif current is not None and current["output"] is None and (m := OUTPUT.match(line)):
            current["output"] = m.group(1).rstrip(",")
        elif m := FINISHED.match(line):
            jobs[int(m.group(1))]["end"] = stamp
    return started, {k: v for k, v in jobs.items() if "end" in v}


def run_walls(record: Path, base: Path) -> list[float]:
    """The wall_s of each run a train job's record names."""
    runs = json.loads(record.read_text())["runs"]
    return [json.loads((base / r["run_dir"] / "metrics.json").read_text())["wall_s"] for r in runs]


def measure(folder: Path, log: Path, cores: int) -> dict:
    started, jobs = parse_log(log)
    end = max(j["end"] for j in jobs.values())
    wall = (end - started).total_seconds()
    inside, train_outside, by_rule, busy = 0.0, 0.0, {}, 0.0
    for job in jobs.values():
        duration = (job["end"] - job["start"]).total_seconds()
        threads = min(job["threads"], cores)
        busy += duration * threads
        if job["rule"] == "train":
            walls = run_walls(folder / job["output"], folder)
            inside += sum(walls)
            train_outside += duration - sum(walls)
        elif job["rule"] != "all":
            by_rule[job["rule"]] = by_rule.get(job["rule"], 0.0) + duration * threads
    available = cores * wall
    out = {"wall_s": wall, "cores": cores, "core_s": available, "inside_runs_core_s": inside,
           "outside_core_s": available - inside, "outside_share": 1 - inside / available,
           "train_jobs_outside_runs_core_s": train_outside, "other_rules_core_s": by_rule,
           "idle_core_s": available - busy, "jobs": len(jobs),
           "train_jobs": sum(j["rule"] == "train" for j in jobs.values())}
    return out


def markdown(m: dict) -> str:
    pct = lambda s: f"{s:.0f} core-s ({100 * s / m['core_s']:.1f}%)"  # noqa: E731
    rows = [("study wall time", f"{m['wall_s']:.0f} s x {m['cores']} cores = {m['core_s']:.0f} core-s"),
            ("inside the runs (their wall_s)", pct(m["inside_runs_core_s"])),
            ("**outside the runs**", f"**{pct(m['outside_core_s'])}**"),
            (f"  training jobs outside their runs ({m['train_jobs']} jobs: start-up, imports, exit)",
             pct(m["train_jobs_outside_runs_core_s"]))]
    rows += [(f"  {rule}", pct(s)) for rule, s in sorted(m["other_rules_core_s"].items(), key=lambda kv: -kv[1])]
    rows.append(("  idle cores (Snakemake's start-up and scheduling, the tail)", pct(m["idle_core_s"])))
    return "| where | time |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", default=".", help="the study's working directory (default: .)")
    p.add_argument("--log", help="its Snakemake log (default: the newest in FOLDER/.snakemake/log/)")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON to write (default: print only)")
    args = p.parse_args()
    folder = Path(args.folder)
    log = Path(args.log) if args.log else max((folder / ".snakemake" / "log").glob("*.snakemake.log"))
    m = measure(folder, log, args.cores)
    print(markdown(m))
    if args.out:
        m.update(log=str(log), cpu=files.cpu_info(), git=files.git_commit(), time=files.now_iso())
        files.atomic_write_json(args.out, m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
