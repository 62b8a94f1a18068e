"""benchmarks/speed/bench_step.py on a tiny study: the variants interleaved within each census cycle, each ratio the median
of per-cycle ratios with their range, and the verdict against the 1.1x limit (nothing here is timed against a bound)."""

import torch

from conftest import load_benchmark, tiny_study
from lab.core.config import validate_study
from lab.run.loop import EpochLoop


def test_every_variant_gets_one_census_step_per_cycle_and_paired_ratios(tmp_path, monkeypatch):
    bench = load_benchmark("speed/bench_step")
    torch.set_num_threads(1)
    study = tiny_study()
    study["models"] = {"resnet50": {"preset": "resnet50-digits"}}
    study["train"].update(census_every=4, batch_size=8)
    study = validate_study(study)
    fed = []  # the variants in the order the benchmark fed them a batch, with the lab loops' step counters
    real_bare, real_lab = bench.BareStep.feed, EpochLoop.feed

    def bare_feed(self, x, y, epoch):
        fed.append(("bare", None))
        return real_bare(self, x, y, epoch)

    def lab_feed(self, x, y, epoch):
        fed.append((self.cfg.mode.name, self.state.step))
        return real_lab(self, x, y, epoch)
    monkeypatch.setattr(bench.BareStep, "feed", bare_feed)
    monkeypatch.setattr(EpochLoop, "feed", lab_feed)
    rows = bench.bench_family(study, "resnet50", ["fp32", "fp16-static128"], rounds=2, tmp=tmp_path, sub=2)
    got = {r["variant"]: r for r in rows}
    assert set(got) == {"bare", "fp32", "fp16-static128"}
    # 3 cycles (a warm-up, 2 timed) of 4 steps per variant, the variants taking turns every 2 steps
    names = [name for name, _ in fed]
    assert names == (["bare"] * 2 + ["fp32"] * 2 + ["fp16-static128"] * 2) * 2 * 3
    for mode in ("fp32", "fp16-static128"):  # a lab loop's steps run on: one census step (step % 4 == 0) per cycle
        assert [step for name, step in fed if name == mode] == list(range(12))
    for r in rows:
        assert len(r["cycle_ms"]) == 2 and all(ms > 0 for ms in r["cycle_ms"])
        lo, hi = r["over_bare_range"]
        assert lo <= r["over_bare"] <= hi
        lo, hi = r["over_lab_fp32_range"]
        assert lo <= r["over_lab_fp32"] <= hi
    assert got["fp32"]["over_lab_fp32"] == got["fp32"]["over_lab_fp32_range"][0] == 1.0
    assert got["bare"]["over_bare"] == 1.0
    md = bench.markdown(rows, {"model": "cpu", "cores": 2, "torch_cpu_capability": "x"}, 1, 2)
    assert "| resnet50 |" in md and "x bare [" in md


def test_verdict_names_what_is_over_the_limit():
    bench = load_benchmark("speed/bench_step")
    rows = [{"family": "lm", "variant": "bare", "over_bare": 1.0, "over_lab_fp32": None},
            {"family": "lm", "variant": "fp32", "over_bare": 1.05, "over_lab_fp32": 1.0},
            {"family": "lm", "variant": "fp16-dynamic", "over_bare": 1.3, "over_lab_fp32": 1.2},
            {"family": "vit", "variant": "fp32", "over_bare": 1.15, "over_lab_fp32": 1.0}]
    assert bench.verdict(rows) == ["lm fp16-dynamic 1.20x the lab fp32 step", "vit lab fp32 1.15x the bare step"]
