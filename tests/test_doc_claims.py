"""Claims of the README and docs/ that no other test backs, each checked against what the code does:

* `python -m lab validate` counts a config's runs (docs/study.md), as many as the workflow's train jobs;
* editing a `policy_modules` file re-runs exactly its runs (docs/policies.md): a Snakemake dry run;
* FP32 means FP32: a run records `tf32: false` with TF32 off while it trains, and torch uses exactly the
  config's `threads` (docs/study.md), in process and through `python -m lab train --threads`;
* provenance.json records the CPU model and its FP16/BF16 arithmetic (docs/study.md), checked against lscpu
  (or /proc/cpuinfo) read here, and against crafted /proc/cpuinfo files of CPUs that have them;
* training jobs never import TensorBoard (docs/report.md, lab/report/tensorboard.py);
* the README's claims and findings sections are what `python -m lab claims` writes from the committed
  results/tables/summary.csv (`make claims`), and docs/policies.md's compare section is the committed compare table.
"""
import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from lab import cli
from lab.core import files
from lab.core.config import resolve_run, validate_study
from lab.run import train as train_module

from conftest import REPO, tiny_study
from test_workflow import snakemake


def cpu_study(**overrides) -> dict:
    study = copy.deepcopy(tiny_study(**overrides))
    study["device"] = "cpu"      # these runs are about the CPU: never moved to a GPU
    return study


def dry_run_counts(stdout: str) -> dict:
    """The job table of `snakemake -n`: {rule: count}."""
    return {line.split()[0]: int(line.split()[1]) for line in stdout.splitlines()
            if len(line.split()) == 2 and line.split()[1].isdigit()}


# --- python -m lab validate ---------------------------------------------------------------------------------
def merge(base: dict, over: dict) -> dict:
    """`over` merged into `base`, mappings key by key (how several config files combine)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def expected_runs(*paths) -> tuple[int, int, int]:
    """(models, modes, runs) from the YAML files themselves: every family under every mode, for each of its
    seeds (its own `seeds:`, else the study's)."""
    study = {}
    for p in paths:
        study = merge(study, yaml.safe_load(Path(p).read_text()))
    def modes(family):  # a family trains its own `modes` when it lists them
        return [m for m in study["modes"] if m in family.get("modes", study["modes"])]
    runs = sum(len(modes(family)) * len(family.get("seeds", study["seeds"])) for family in study["models"].values())
    counts = "/".join(map(str, sorted({len(modes(f)) for f in study["models"].values()})))
    return len(study["models"]), counts, runs


def run_lab(*argv) -> tuple[int, str, str]:
    """`python -m lab ARGV` in this process (lab.cli.main, what lab/__main__.py calls: a subprocess per call cost
    ~4 s of importing torch): exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def run_validate(*configs) -> tuple[int, str, str]:
    return run_lab("validate", *[a for c in configs for a in ("--config", str(c))])


def validate(*configs):
    rc, stdout, stderr = run_validate(*configs)
    assert rc == 0, stderr
    m = re.fullmatch(r"config OK: (\d+) models x ([\d/]+) modes x ([\d/]+) seeds = (\d+) runs\nruns on: [^\n]+\n", stdout)
    assert m, stdout
    return int(m.group(1)), m.group(2), int(m.group(4))


def test_validate_counts_the_default_studys_runs():
    default = REPO / "configs" / "default.yaml"
    assert validate(default) == expected_runs(default)
    extra = REPO / "configs" / "extra_modes.yaml"
    assert validate(extra) == expected_runs(extra)
    # a second file merges over the first, mapping by mapping: the union of both files' modes
    assert validate(default, extra) == expected_runs(default, extra)


def test_validate_counts_per_family_seeds_as_the_workflow_does(repo_copy):
    study = cpu_study()
    study["seeds"] = [0, 1]
    study["models"]["vit"]["seeds"] = [0, 1, 2]          # a family with seeds of its own
    study["modes"]["fp16-dynamic"] = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    path = repo_copy / "configs" / "tiny.yaml"
    path.write_text(yaml.safe_dump(study))
    count = validate(path)
    assert count == expected_runs(path) == (2, "3", 3 * 2 + 3 * 3)
    dry = snakemake(repo_copy, "-n", "--configfile", "configs/tiny.yaml")
    assert dry.returncode == 0, dry.stderr[-2000:]
    # seeds_per_job (2, the default study's): a job trains 2 seeds of a (model, mode): one job for resnet50's
    # 2 seeds, two (2 + 1) for vit's 3, for each of the 3 modes
    assert study["seeds_per_job"] == 2 and dry_run_counts(dry.stdout)["train"] == 3 * (1 + 2)
    study["seeds_per_job"] = 1  # a job per run
    path.write_text(yaml.safe_dump(study))
    dry = snakemake(repo_copy, "-n", "--configfile", "configs/tiny.yaml")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert dry_run_counts(dry.stdout)["train"] == count[2]
    # a family that trains some of the study's modes only (how a study trades modes for seeds)
    study["models"]["vit"]["modes"] = ["fp32", "fp16-dynamic"]
    path.write_text(yaml.safe_dump(study))
    assert validate(path) == expected_runs(path) == (2, "2/3", 3 * 2 + 2 * 3)  # train_jobs: tests/test_jobs.py
    study["models"]["vit"]["modes"] = ["fp32", "fp16-dynamc"]
    path.write_text(yaml.safe_dump(study))
    rc, _, stderr = run_validate(path)
    assert rc == 2 and "models.vit.modes: expected the study's modes; found 'fp16-dynamc'" in stderr


# --- a policy_modules file is an input of its runs ------------------------------------------------------------
USER_POLICY = '''from lab.scaling import ScalingPolicy, register


@register("doc-claims-halving")
class Halving(ScalingPolicy):
    def __init__(self, init_scale=1024.0):
        self.init_scale = self.check_positive("init_scale", init_scale)

    def update(self, scale, found_inf, step, grad_norm=None):
        return scale * 0.5 if found_inf else scale
'''
RUN_FILES = ("metrics.json", "steps.csv", "config.yaml", "provenance.json", "census.csv", "grad_hist.csv")


def test_editing_a_policy_modules_file_reruns_exactly_its_runs(repo_copy):
    policy = repo_copy / "my_policies.py"
    policy.write_text(USER_POLICY)
    study = cpu_study(policy_modules=["my_policies.py"])
    study["modes"]["fp16-mine"] = {"precision": "fp16", "scaler": {"policy": "doc-claims-halving"}}
    (repo_copy / "configs" / "tiny.yaml").write_text(yaml.safe_dump(study))
    # every run finished (its outputs in place, newer than the policy file): nothing to train
    hour_ago = time.time() - 3600
    os.utime(policy, (hour_ago, hour_ago))
    targets = []
    for model in study["models"]:
        for mode in study["modes"]:
            run = repo_copy / "results" / "runs" / model / mode / "seed0"
            run.mkdir(parents=True)
            for name in RUN_FILES:
                (run / name).write_text("")
            (run.parent / "seeds0.json").write_text("")  # the record of the job that trained it
            targets.append(str((run.parent / "seeds0.json").relative_to(repo_copy)))
    before = snakemake(repo_copy, "-n", *targets, "--configfile", "configs/tiny.yaml")
    assert before.returncode == 0, before.stderr[-2000:]
    assert "Nothing to be done" in before.stdout, before.stdout[-2000:]

    policy.write_text(USER_POLICY.replace("scale * 0.5", "scale * 0.25"))   # the user edits the policy
    after = snakemake(repo_copy, "-n", *targets, "--configfile", "configs/tiny.yaml")
    assert after.returncode == 0, after.stderr[-2000:]
    assert dry_run_counts(after.stdout).get("train") == len(study["models"]), after.stdout[-3000:]
    planned = set(re.findall(r"wildcards: model=(\w+), mode=([\w-]+), seeds=0", after.stdout))
    assert planned == {(m, "fp16-mine") for m in study["models"]}
    assert "Updated input files" in after.stdout and "my_policies.py" in after.stdout


# --- FP32 means FP32; torch uses exactly `threads` ------------------------------------------------------------
@pytest.fixture
def torch_state():
    """Put back the global torch settings a run changes."""
    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    yield
    torch.set_num_threads(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]
    torch.set_float32_matmul_precision(saved[3])


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_run_has_tf32_off_and_exactly_threads(tmp_path, monkeypatch, torch_state, threads):
    study = cpu_study(threads=threads)
    cfg = resolve_run(validate_study(study), "resnet50", "fp32", 0)
    seen = {}
    real_loop = train_module._train_loop

    def spy(*args, **kwargs):  # what torch is set to while the run trains
        seen.update(threads=torch.get_num_threads(), matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                    cudnn_tf32=torch.backends.cudnn.allow_tf32, precision=torch.get_float32_matmul_precision())
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(train_module, "_train_loop", spy)
    # the process starts with the other thread count and with TF32 allowed: the run must change both
    torch.set_num_threads(3 - threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    run = tmp_path / "run"
    metrics = train_module.train(cfg, run, progress=io.StringIO())
    assert seen == {"threads": threads, "matmul_tf32": False, "cudnn_tf32": False, "precision": "highest"}
    assert metrics["status"] == "ok" and metrics["device"] == "cpu"
    assert metrics["tf32"] is False and metrics["threads"] == threads
    on_disk = json.loads((run / "metrics.json").read_text())
    assert on_disk["tf32"] is False and on_disk["threads"] == threads
    assert json.loads((run / "provenance.json").read_text())["threads"] == threads


# --- provenance: the CPU model and its FP16/BF16 arithmetic ---------------------------------------------------
# FP16 / BF16 arithmetic instructions by their /proc/cpuinfo (and lscpu) names: x86 AVX512-FP16 and AMX-FP16,
# ARM FP16 scalar/vector (fphp, asimdhp); x86 AVX512-BF16 and AMX-BF16, ARM BF16. f16c and avx2 only convert.
FP16_ARITHMETIC = {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}
BF16_ARITHMETIC = {"avx512_bf16", "amx_bf16", "bf16"}


def this_cpu() -> tuple[str | None, set]:
    """The CPU model and flags as lscpu reports them, else as /proc/cpuinfo holds them (read here, not by lab)."""
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C")).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "Model name" in fields and "Flags" in fields:
            return fields["Model name"], set(fields["Flags"].split())
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    return (model.group(1).strip() if model else None), set(flags.group(1).split() if flags else ())


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="Linux only: /proc/cpuinfo")
def test_provenance_records_this_cpu(tmp_path, torch_state):
    model, flags = this_cpu()
    study = cpu_study()
    run = tmp_path / "run"
    train_module.train(resolve_run(validate_study(study), "resnet50", "fp32", 0), run, progress=io.StringIO())
    cpu = json.loads((run / "provenance.json").read_text())["cpu"]
    if model is not None:
        assert cpu["model"] == model
    assert cpu["fp16_arithmetic"] == sorted(FP16_ARITHMETIC & flags)
    assert cpu["bf16_arithmetic"] == sorted(BF16_ARITHMETIC & flags)
    assert cpu["cores"] == os.cpu_count() and cpu["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse sse2 avx f16c avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve bf16 i8mm
CPU implementer\t: 0x41
"""
ZEN2 = """processor\t: 0
model name\t: AMD EPYC 7742 64-Core Processor
flags\t\t: fpu sse sse2 avx f16c avx2 fma
"""


@pytest.mark.parametrize("text, model, fp16, bf16", [
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+", ["avx512_fp16"], ["amx_bf16", "avx512_bf16"]),
    (GRAVITON3, None, ["asimdhp", "fphp"], ["bf16"]),
    (ZEN2, "AMD EPYC 7742 64-Core Processor", [], []),   # f16c/avx2 convert, they do not compute
])
def test_cpu_info_reads_fp16_and_bf16_arithmetic_from_cpuinfo(tmp_path, monkeypatch, text, model, fp16, bf16):
    fake = tmp_path / "cpuinfo"
    fake.write_text(text)
    real_path = files.Path
    monkeypatch.setattr(files, "Path", lambda p, *a: real_path(fake) if str(p) == "/proc/cpuinfo"
                        else real_path(p, *a))
    info = files.cpu_info()
    assert info["fp16_arithmetic"] == fp16 and info["bf16_arithmetic"] == bf16
    if model is not None:
        assert info["model"] == model
    else:  # ARM's cpuinfo names no model: platform's answer instead
        import platform
        assert info["model"] == (platform.processor() or platform.machine())


# --- training never imports TensorBoard; --threads through the CLI ------------------------------------------
PROBE = """
import atexit, json, os, runpy, sys
out = sys.argv.pop()                      # the probe's own argument: where to write what it saw
def report():                             # at exit, after the command's own code ran
    torch = sys.modules.get("torch")
    with open(out, "w") as f:
        json.dump({"tensorboard": sorted(m for m in sys.modules if m.split(".")[0] == "tensorboard"
                                         or m.startswith("torch.utils.tensorboard")),
                   "threads": torch.get_num_threads() if torch else None}, f)
atexit.register(report)
_exit = os._exit
def report_then_exit(code):               # `lab train` ends with os._exit, which runs no atexit handler
    report()
    _exit(code)
os._exit = report_then_exit
sys.argv = ["lab"] + sys.argv[1:]
runpy.run_module("lab", run_name="__main__", alter_sys=True)
"""


def test_a_training_job_never_imports_tensorboard_and_uses_the_threads_it_is_given(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cpu_study(threads=1)))
    probe = tmp_path / "probe.json"
    run = tmp_path / "run"
    # the train rule's own command line (workflow/rules/train.smk), --threads as the rule passes it
    res = subprocess.run([sys.executable, "-c", PROBE, "train", "--model", "resnet50", "--mode", "fp16-static128",
                          "--seed", "0", "--out", str(run), "--config", str(config), "--threads", "2", str(probe)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(probe.read_text())
    assert seen == {"tensorboard": [], "threads": 2}
    assert json.loads((run / "metrics.json").read_text())["threads"] == 2
    # the probe sees an import when there is one
    res = subprocess.run([sys.executable, "-c", PROBE, "tensorboard", str(run), "--out", str(tmp_path / "tb"),
                          str(probe)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(probe.read_text())["tensorboard"]


# --- the README's generated sections -------------------------------------------------------------------------
def section(text: str, markers) -> str:
    start, end = markers
    assert text.count(start) == 1 and text.count(end) == 1
    return text.split(start, 1)[1].split(end, 1)[0]


def test_readme_claims_and_findings_are_lab_claims_on_the_committed_table(tmp_path, monkeypatch):
    from lab.study.aggregate import FINDINGS_MARKERS
    from lab.study.claims import MARKERS
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    md = tmp_path / "claims.md"
    # `make claims`, on the committed results/tables/summary.csv and configs/claims.yaml
    monkeypatch.chdir(REPO)  # as `make claims` runs it: its default inputs are relative to the repository
    rc, _, stderr = run_lab("claims", "--readme", readme, "--md", md)
    assert rc == 0, stderr
    committed, regenerated = (REPO / "README.md").read_text(), readme.read_text()
    for markers in (MARKERS, FINDINGS_MARKERS):
        assert section(regenerated, markers) == section(committed, markers), f"README {markers[0]} is stale"
    assert md.read_text() == (REPO / "results" / "tables" / "claims.md").read_text()

    # the README's rows decided in the default study carry the verdicts lab claims has just written
    from lab.report.source_claims import read_verdicts
    decided_here = {line.split("(`")[1].split("`)")[0]: line.split(" | ")[2].strip("*")
                    for line in section(committed, MARKERS).splitlines()
                    if line.startswith("| ") and "(`" in line and " | default study" in line}
    assert decided_here and all(read_verdicts(md.read_text())[k] == v for k, v in decided_here.items())


def test_readme_source_claims_table_matches_the_committed_claims_files():
    """The README's one table of the source's claims is what lab/report/source_claims.py makes from the
    committed claims files (configs/claims*.yaml: which claims are the source's, in which studies) and each study's
    committed claims.md (the verdicts): every such claim once, each study that declares it named."""
    import yaml
    from lab.report.source_claims import is_source, readme_table, source_claims, studies
    from lab.study.claims import MARKERS
    assert section((REPO / "README.md").read_text(), MARKERS) == "\n" + readme_table(REPO)
    records = source_claims(REPO)
    declared = {c["id"] for st in studies(REPO)
                for c in yaml.safe_load((REPO / st["claims"]).read_text())["claims"] if is_source(c["source"])}
    assert {r["id"] for r in records} == declared and len(records) >= 20
    names = {st["name"] for st in studies(REPO)}
    assert {"default", "growth_horizon", "finetune", "multimodal", "rl"} <= names
    by_id = {r["id"]: r for r in records}
    # a claim declared in two studies: one row, the deciding study's verdict, the other named beside it
    lm = by_id["lm-overflows-more-than-mobilenetv2"]
    assert [w[0]["name"] for w in lm["where"]][:2] == ["default", "growth_horizon"]
    assert dict((w[0]["name"], w[1]) for w in lm["where"])["default"] == "out of reach"  # runs under 3 intervals
    assert lm["study"]["name"] != "default"


def test_which_claims_are_the_sources():
    from lab.report.source_claims import is_source, read_verdicts
    assert is_source("source study, table: overflow") and is_source("source, multimodal case: NaN")
    assert is_source("the source study's RLHF advice") and is_source("implied by the source's case 2")
    assert not is_source("Qi et al. 2025; the source study's closing idea") and not is_source("the lab")
    assert not is_source("the lab's hypothesis")
    summary = "| A claim (`a-1`) | **contradicted** | 0.01 | x |\n| B (`b`) | **out of reach** | — | y |"
    runs = "| **c**: C \\| d | **supported** | t (supported) | e | 0.01 |  |\n|  |  | t2 (not resolved) | | 1 | |"
    assert read_verdicts(summary) == {"a-1": "contradicted", "b": "out of reach"}
    assert read_verdicts(runs) == {"c": "supported"}


def test_the_docs_compare_section_is_the_committed_compare_table():
    """docs/policies.md's paired table (amax-history against GradScaler; `make claims` writes it there)."""
    from lab.study.compare import COMPARE_MARKERS
    table = (REPO / "results" / "tables" / "compare_fp16-amax_vs_fp16-dynamic.md").read_text()
    assert section((REPO / "docs" / "policies.md").read_text(), COMPARE_MARKERS).strip() == table.strip()


def test_readme_replay_agreement_figures_are_the_committed_table():
    """The README's "replay predicted the real run's overflow steps exactly in A of N (family, mode, seed) pairs and
    its final scale in B" is results/tables/replay_agreement.csv summed over its rows."""
    text = " ".join((REPO / "README.md").read_text().split())
    m = re.search(r"overflow steps exactly in (\d+) of (\d+) \(family, mode, seed\) pairs and its final scale in (\d+)",
                  text)
    assert m, "the README's replay sentence moved"
    table = pd.read_csv(REPO / "results" / "tables" / "replay_agreement.csv")
    assert tuple(map(int, m.groups())) == (table["overflow_steps_exact"].sum(), table["n_seeds"].sum(),
                                            table["final_scale_exact"].sum())

