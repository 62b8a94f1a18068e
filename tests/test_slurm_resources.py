"""docs/slurm.md's resource mapping, through the real SLURM executor plugin and the lab's profile
(workflow/profiles/slurm), without a cluster: `snakemake --profile workflow/profiles/slurm` in a temporary copy,
with stand-ins for SLURM's commands on PATH. The stand-in `sbatch` records its arguments and refuses the job
(nothing runs); the others answer nothing. Checked on the sbatch command lines:

    threads (the study's threads x processes_per_run) -> --cpus-per-task     mem_mb -> --mem (MB)
    runtime (minutes) -> --time (-t)      gpu (processes_per_run, when device: cuda) -> --gpus=N

for a training job (the profile's set-resources for train) and for another rule, figures (default-resources).
`make test-slurm` (workflow/tests/slurm_e2e.sh) runs a study through a real one-node cluster.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_study

BIN = Path(sys.executable).parent
SLURM_TOOLS = ("sinfo", "squeue", "sacct", "sacctmgr", "sshare", "scontrol", "scancel")
SBATCH = """#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_SBATCH_LOG"
echo "sbatch: error: a stand-in sbatch: nothing submitted" >&2
exit 1
"""


def fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(SBATCH)
    for tool in SLURM_TOOLS:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)


def option(call: list[str], *names) -> str | None:
    """The value of an sbatch option given as `--name=value` or `name value` (the first of `names` found)."""
    for i, arg in enumerate(call):
        for name in names:
            if arg == name and i + 1 < len(call):
                return call[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


@pytest.mark.parametrize("device, threads, processes", [("cuda", 3, 2), ("cpu", 2, 1)])
def test_resources_become_sbatch_options(repo_copy, tmp_path, device, threads, processes):
    # the profile as docs/slurm.md tells a user to edit it (and as slurm_e2e.sh does): a partition, no account
    profile_path = repo_copy / "workflow" / "profiles" / "slurm" / "config.yaml"
    profile = yaml.safe_load(profile_path.read_text())
    profile["default-resources"]["slurm_partition"] = "lab-test"
    profile["default-resources"].pop("slurm_account", None)
    profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
    defaults, train_res = profile["default-resources"], profile["set-resources"]["train"]

    study = tiny_study(device=device, threads=threads, processes_per_run=processes)
    (repo_copy / "configs" / "tiny.yaml").write_text(yaml.safe_dump(study))
    results = repo_copy / study["results_dir"]
    # every run but one finished (outputs in place): that run's training job and the figures of the other
    # model (whose runs are all there) are the two jobs to submit
    missing = ("resnet50", "fp32")
    for model in study["models"]:
        for mode in study["modes"]:
            if (model, mode) != missing:
                run = results / "runs" / model / mode / "seed0"
                run.mkdir(parents=True)
                for name in ("metrics.json", "steps.csv", "config.yaml", "provenance.json", "census.csv",
                             "grad_hist.csv"):
                    (run / name).write_text("")
                (run.parent / "seeds0.json").write_text("")  # the record of the job that trained it

    fake_slurm(tmp_path / "slurm-bin")
    log = tmp_path / "sbatch.log"
    env = dict(os.environ, PATH=f"{tmp_path / 'slurm-bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               FAKE_SBATCH_LOG=str(log))
    res = subprocess.run(
        [str(BIN / "snakemake"), "--profile", "workflow/profiles/slurm", "--retries", "0",
         "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
         f"{study['results_dir']}/runs/{missing[0]}/{missing[1]}/seeds0.json",
         f"{study['results_dir']}/figures/vit/scale.png", "--configfile", "configs/tiny.yaml"],
        cwd=repo_copy, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "stand-in sbatch" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    calls = {}
    for line in log.read_text().splitlines():
        args = shlex.split(line.split(" --wrap=", 1)[0])
        rule = re.fullmatch(r"rule_(\w+?)(_wildcards_.*)?", option(args, "--comment")).group(1)
        calls[rule] = args
    assert set(calls) == {"train", "figures"}, calls

    train = calls["train"]
    assert option(train, "--cpus-per-task") == str(threads * processes)
    assert option(train, "--mem") == str(train_res["mem_mb"])
    assert option(train, "--time", "-t") == str(train_res["runtime"])
    assert option(train, "--gpus") == (str(processes) if device == "cuda" else None)
    assert option(train, "-p", "--partition") == "lab-test"

    other = calls["figures"]   # one thread, the profile's defaults, no GPU
    assert option(other, "--cpus-per-task") == "1"
    assert option(other, "--mem") == str(defaults["mem_mb"])
    assert option(other, "--time", "-t") == str(defaults["runtime"])
    assert option(other, "--gpus") is None
