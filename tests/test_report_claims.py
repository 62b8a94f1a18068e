"""What docs/report.md says the report's figures and TensorBoard files hold, read from the objects themselves:

* TensorBoard: the `lr` scalar per step and the text summary of metrics.json, read back with TensorBoard's own
  EventAccumulator;
* loss.png: every non-finite loss marked (a ▼ at its step), and no mark where every loss is finite;
* top1.png: bars with error bars of one (sample) standard deviation over seeds, and a dot per seed.
Expectations are computed here from the rows the test wrote, not by lab.report.
"""
import json

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer

from lab.report import figures as F
from lab.report import load as R
from lab.report import tensorboard as tb

from results_fixture import make_results, make_run

matplotlib.use("Agg")


# --- TensorBoard: lr and the text summary ---------------------------------------------------------------------
def test_tensorboard_has_the_lr_per_step_and_a_text_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    run = make_run(tmp_path / "runs" / "resnet50" / "fp16-dynamic" / "seed0", "resnet50", "fp16-dynamic", 0)
    steps = pd.read_csv(run / "steps.csv")
    steps["lr"] = [1e-3 * (1 + i) / len(steps) for i in range(len(steps))]     # a schedule: lr differs per step
    steps.to_csv(run / "steps.csv", index=False)
    metrics = json.loads((run / "metrics.json").read_text())

    event_dir = tb.export_run(run, tmp_path / "tb")
    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    lr = acc.Scalars("lr")
    assert [e.step for e in lr] == steps["step"].tolist()
    assert [e.value for e in lr] == pytest.approx(steps["lr"].tolist(), rel=1e-6)   # float32 in the event file

    text_tags = [t for t in acc.Tags()["tensors"] if acc.SummaryMetadata(t).plugin_data.plugin_name == "text"]
    assert len(text_tags) == 1
    (event,) = acc.Tensors(text_tags[0])
    assert event.step == steps["step"].max()
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    assert text.splitlines()[:2] == ["| metric | value |", "|---|---|"]    # a markdown table, which TensorBoard renders
    rows = dict(tuple(cell.strip() for cell in line.strip("|").split("|")) for line in text.splitlines()[2:])
    scalar_metrics = {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}
    assert rows == {k: str(v) for k, v in scalar_metrics.items()}
    assert rows["mode"] == "fp16-dynamic" and float(rows["final_top1"]) == metrics["final_top1"]


# --- loss.png: non-finite losses marked -----------------------------------------------------------------------
def nonfinite_marks(fig) -> list:
    """The steps the ▼ markers stand at (legend proxies hold no data)."""
    (ax,) = fig.axes
    return sorted(x for ln in ax.lines if ln.get_marker() == "v" for x in ln.get_xdata())


def test_loss_figure_marks_every_nonfinite_loss(tmp_path):
    steps = R.load_steps(make_results(tmp_path / "res", seeds=(0, 1), census=False))
    assert np.isfinite(steps["loss"]).all()
    clean = F.loss_figure(steps, "resnet50")
    assert nonfinite_marks(clean) == []
    assert "non-finite loss" not in [t.get_text() for t in clean.axes[0].get_legend().get_texts()]

    bad = {("fp16-dynamic", 0, 7): np.nan, ("fp16-dynamic", 1, 30): np.inf, ("fp16-static128", 0, 12): np.nan,
           ("fp16-static128", 1, 12): -np.inf}
    for (mode, seed, step), value in bad.items():
        steps.loc[(steps["mode"] == mode) & (steps["seed"] == seed) & (steps["step"] == step), "loss"] = value
    fig = F.loss_figure(steps, "resnet50")
    # one mark per (mode, step) with a non-finite loss on any seed: static128's step 12 holds two seeds
    assert nonfinite_marks(fig) == [7, 12, 12, 30]
    assert "non-finite loss" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # and the mean curves use the finite losses only
    for line in fig.axes[0].lines:
        if line.get_marker() != "v" and len(line.get_ydata()):
            assert np.isfinite(np.asarray(line.get_ydata(), float)).all()


# --- top1.png: error bars of one std, a dot per seed -----------------------------------------------------------
def test_top1_figure_error_bars_and_seed_dots(tmp_path):
    root = make_results(tmp_path / "res", seeds=(0, 1, 2), census=False)
    # spread the seeds unevenly, and give fp32 a fourth seed
    for seed, top1 in ((0, 0.90), (1, 0.97), (2, 0.93)):
        path = root / "runs" / "resnet50" / "fp16-dynamic" / f"seed{seed}" / "metrics.json"
        m = json.loads(path.read_text())
        m["final_top1"] = top1
        path.write_text(json.dumps(m))
    make_run(root / "runs" / "resnet50" / "fp32" / "seed3", "resnet50", "fp32", 3, census=False)
    values = {}
    for path in sorted((root / "runs" / "resnet50").glob("*/seed*/metrics.json")):
        values.setdefault(path.parent.parent.name, []).append(100 * json.loads(path.read_text())["final_top1"])

    fig = F.top1_figure(R.load_metrics(root), "resnet50")
    (ax,) = fig.axes
    modes = [t.get_text() for t in ax.get_xticklabels()]
    assert sorted(modes) == sorted(values)

    (errorbars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    (segments,) = [lc.get_segments() for lc in errorbars.lines[2]]
    assert len(segments) == len(modes)
    for i, mode in enumerate(modes):
        (x0, lo), (x1, hi) = sorted(segments[i], key=lambda p: p[1])
        assert x0 == x1 == pytest.approx(i)
        assert (lo + hi) / 2 == pytest.approx(np.mean(values[mode]))               # centred on the mean
        assert (hi - lo) / 2 == pytest.approx(np.std(values[mode], ddof=1))        # one sample std each way

    dots = [ln for ln in ax.lines if ln.get_marker() == "o"]
    assert len(dots) == len(modes)
    for i, mode in enumerate(modes):
        (line,) = [ln for ln in dots if abs(np.mean(ln.get_xdata()) - i) < 0.3]
        assert sorted(line.get_ydata()) == pytest.approx(sorted(values[mode]))    # one dot per seed
        assert len(line.get_xdata()) == len(values[mode])
