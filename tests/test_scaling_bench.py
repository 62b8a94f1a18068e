"""Smoke test of benchmarks/speed/bench_scaler.py: a tiny run writes a complete JSON report."""

import json

import torch

from conftest import load_benchmark

torch.set_num_threads(1)


def test_bench_scaler_tiny_run_writes_report(tmp_path):
    bench = load_benchmark("speed/bench_scaler")
    out = tmp_path / "nested" / "scaler.json"
    report = bench.main(["--out", str(out), "--reps", "2", "--block", "2", "--warmup", "1",
                         "--batch", "4", "--image", "8", "--device", "cpu"])
    assert torch.get_num_threads() == 1
    data = json.loads(out.read_text())
    assert data["ratio_lab_over_pytorch"] == report["ratio_lab_over_pytorch"] > 0
    for key in ("train_step", "scaler_only"):
        res = data["results"][key]
        assert len(res["per_block_s_per_step"]["lab"]) == 2 == len(res["per_block_s_per_step"]["pytorch"])
        assert res["median_s_per_step"]["lab"] > 0 and res["median_s_per_step"]["pytorch"] > 0
    assert data["hardware"]["cpu_model"] and data["hardware"]["torch_threads"] == 1
    assert data["software"]["torch"] == torch.__version__
    assert isinstance(data["meets_target"], bool)
    assert [p.name for p in out.parent.iterdir()] == ["scaler.json"]  # temp file replaced, none left


class FakeRunner:
    """A runner whose blocks take a known time: `cost` per step times a drift that grows with every block timed
    on the machine (other load), shared by both runners."""

    def __init__(self, cost, clock):
        self.cost, self.clock = cost, clock

    def step(self):
        pass

    def time_block(self, fn, args, n):
        self.clock[0] += 1
        return self.cost * (1 + 0.05 * self.clock[0])


def test_measure_pairs_blocks_so_drift_cancels():
    """The headline ratio is the median of back-to-back block ratios, taken in alternating order: a machine that
    slows down during the run moves both sides of a pair alike, so a lab side 10% slower reads close to 1.10,
    where the ratio of the two medians would be pulled by the order."""
    bench = load_benchmark("speed/bench_scaler")
    clock = [0]
    res = bench.measure({"lab": FakeRunner(1.1, clock), "pytorch": FakeRunner(1.0, clock)}, "step", (),
                        reps=40, block=3, warmup=1)
    assert len(res["per_block_s_per_step"]["lab"]) == 40
    assert abs(res["ratio_lab_over_pytorch"] - 1.1) < 0.01
