"""Checks for workflow/tests/slurm_e2e.sh (run there; not a pytest module).

    python workflow/tests/slurm_e2e_check.py --log SNAKEMAKE_LOG --study DIR --slurm RESULTS --local RESULTS

1. Every job Snakemake ran went through sbatch: the jobs it submitted (its "submitted with SLURM jobid" lines)
   are as many as its job table lists, less the local `all` rule, and `sacct -c` (the cluster's job-completion
   log) lists exactly those SLURM job ids under this run's job name, each COMPLETED.
2. Each of them left its sbatch log under the profile's slurm-logdir (DIR/results/logs/slurm/).
3. The SLURM study's tables equal the local study's: summary.csv column by column except the timing and memory
   columns, and every run's steps.csv byte for byte.
Prints what it checked; exits 1 with the reasons when something does not hold.
"""
import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

# summary.csv columns that measure the machine and the moment (time, speed, process memory), not the training
TIMING_COLUMNS = {"throughput", "speedup_vs_fp32", "peak_memory_mb", "memory_saving_vs_fp32_pct"}
LOCAL_RULES = {"all"}  # rules with nothing to run: Snakemake finishes them itself, no sbatch


def job_counts(log: str) -> dict[str, int]:
    """The 'Job stats' table Snakemake prints before it starts: {rule: count} and 'total'."""
    table = log.split("Job stats:", 1)[1]
    counts = {}
    for line in table.splitlines()[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts


def sacct_jobs() -> list[dict]:
    """Finished jobs from the job-completion log (JobCompType=jobcomp/filetxt): `sacct -c`."""
    out = subprocess.run(["sacct", "-c", "--parsable2", "--noheader", "-o", "JobID,JobName,State,ExitCode"],
                         capture_output=True, text=True, check=True).stdout
    return [dict(zip(("id", "name", "state", "exit"), line.split("|"))) for line in out.splitlines() if line]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, required=True, help="the SLURM study's snakemake output")
    ap.add_argument("--study", type=Path, required=True, help="the directory snakemake ran in")
    ap.add_argument("--slurm", type=Path, required=True, help="the SLURM study's results_dir")
    ap.add_argument("--local", type=Path, required=True, help="the local study's results_dir")
    args = ap.parse_args(argv)
    problems = []
    log = args.log.read_text()

    # 1. sbatch for every job, as sacct sees it
    counts = job_counts(log)
    expected = counts["total"] - sum(counts.get(r, 0) for r in LOCAL_RULES)
    uuid = re.search(r"SLURM run ID: (\S+)", log).group(1)
    submitted = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+)", log)
    print(f"snakemake: {counts['total']} jobs ({expected} for SLURM, {counts['total'] - expected} local), "
          f"{len(submitted)} submitted with sbatch, SLURM run ID {uuid}")
    if len(submitted) != expected or len(set(submitted)) != len(submitted):
        problems.append(f"{len(submitted)} sbatch submissions for {expected} jobs: {submitted}")
    finished = {j["id"]: j for j in sacct_jobs() if j["name"] == uuid}
    print(f"sacct -c: {len(finished)} jobs named {uuid}: "
          + ", ".join(f"{i} {j['state']} {j['exit']}" for i, j in sorted(finished.items(), key=lambda x: int(x[0]))))
    if set(finished) != set(submitted):
        problems.append(f"sacct lists {sorted(finished, key=int)}, snakemake submitted {sorted(submitted, key=int)}")
    not_completed = [f"{i}: {j['state']} {j['exit']}" for i, j in finished.items() if j["state"] != "COMPLETED"]
    if not_completed:
        problems.append(f"jobs not COMPLETED: {not_completed}")

    # 2. the profile's sbatch logs
    logdir = args.study / "results" / "logs" / "slurm"
    logs = {p.stem: p for p in logdir.rglob("*.log")}
    missing = [i for i in submitted if i not in logs]
    print(f"sbatch logs: {len(logs)} under {logdir}")
    if missing:
        problems.append(f"no sbatch log under {logdir} for jobs {missing}")

    # 3. same tables as the local run
    ours, theirs = read_csv(args.slurm / "tables" / "summary.csv"), read_csv(args.local / "tables" / "summary.csv")
    columns = [c for c in ours[0] if c not in TIMING_COLUMNS] if ours else []
    if [r.keys() for r in ours] != [r.keys() for r in theirs] or len(ours) != len(theirs) or not ours:
        problems.append(f"summary.csv shapes differ: {len(ours)} vs {len(theirs)} rows")
    else:
        for a, b in zip(ours, theirs):
            diff = {c: (a[c], b[c]) for c in columns if a[c] != b[c]}
            if diff:
                problems.append(f"summary.csv {a['model']}/{a['mode']}: SLURM vs local {diff}")
    print(f"summary.csv: {len(ours)} rows x {len(columns)} columns compared "
          f"(left out: {', '.join(sorted(TIMING_COLUMNS))})")
    steps = sorted((args.slurm / "runs").rglob("steps.csv"))
    for path in steps:
        other = args.local / path.relative_to(args.slurm)
        if not other.exists() or path.read_bytes() != other.read_bytes():
            problems.append(f"{path.relative_to(args.slurm)} differs from the local run's")
    print(f"steps.csv: {len(steps)} runs compared byte for byte")
    if len(steps) != counts.get("train", -1):
        problems.append(f"{len(steps)} runs with steps.csv, {counts.get('train')} train jobs")

    for p in problems:
        print(f"  problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
