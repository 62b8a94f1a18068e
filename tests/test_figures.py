"""Figures, TensorBoard export and the Snakemake report, on synthetic run directories and on real tiny runs."""
import contextlib
import io
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab import cli
from lab.core.config import resolve_run, validate_study
from lab.report import derived as D
from lab.report import figures as F
from lab.report import load as R
from lab.report import tensorboard as tb
from lab.run.train import train

from conftest import tiny_study
from results_fixture import MODES, make_results, make_run
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TB_TAGS = {"loss", "loss_scale", "grad_norm", "skip_count", "update_ratio"}


def snakemake(cwd, *args, timeout=600):
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([str(bin_dir / "snakemake"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_png(path, min_bytes=5000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) >= min_bytes, f"{path}: {len(data)} bytes"


def expected_figures(out, model, modes):
    return ([R.figure_path(out, model, name) for name in R.MODEL_FIGURES]
            + [R.mode_figure_path(out, model, mode) for mode in modes])


def lab_here(*args) -> types.SimpleNamespace:
    """`python -m lab ARGS` in this process (lab.cli.main, what lab/__main__.py calls; a subprocess per call cost
    ~5 s of importing torch and matplotlib): its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return make_results(tmp_path_factory.mktemp("synthetic"))


def test_cli_writes_every_figure(synthetic, tmp_path):
    out = tmp_path / "figures"
    res = lab_here("figures", "--results", synthetic, "--out", out)
    assert res.returncode == 0, res.stderr
    expected = expected_figures(out, "resnet50", MODES)
    assert sorted(res.stdout.split()) == sorted(map(str, expected))  # it prints what it wrote
    for path in expected:
        assert_png(path)
    assert not list(out.rglob(".*.png"))  # no temporary files left behind


def test_loaders_and_counters(synthetic):
    metrics = R.load_metrics(synthetic)
    assert list(metrics.columns[:3]) == ["model", "mode", "seed"] and len(metrics) == 6
    assert list(metrics["mode"].unique()) == ["fp32", "fp16-static128", "fp16-dynamic"]  # fp32 first
    steps = R.load_steps(synthetic, mode="fp16-dynamic")
    assert set(steps["seed"]) == {0, 1} and set(steps["mode"]) == {"fp16-dynamic"}
    run = steps[steps["seed"] == 0]
    assert run["skip_count"].iloc[-1] == run["skipped"].sum() == 4
    assert run["update_ratio"].iloc[-1] == pytest.approx(36 / 40)
    one = R.load_steps(synthetic / "runs" / "resnet50" / "fp32" / "seed1")  # a single run directory
    assert set(one["seed"]) == {1} and len(one) == 40
    summary = R.load_summary(synthetic)  # no tables/ yet: computed from the runs
    assert set(summary["mode"]) == set(MODES) and summary["top1_delta_vs_fp32"].notna().all()
    hist = R.load_hist(synthetic)
    assert set(hist["kind"]) == {"value", "zero", "nonfinite"}
    assert R.load_census(synthetic / "nothing-here").empty and R.load_hist([]).empty


def test_a_runs_finished_copy_is_not_a_run_of_its_own(tmp_path):
    """Between a run's end and the workflow's end a run keeps its files in .finished/ (lab/run/finished.py): the
    loaders, figures and TensorBoard export must not count it twice."""
    from lab.run import finished
    results = make_results(tmp_path / "res")
    run = results / "runs" / "resnet50" / "fp32" / "seed0"
    shutil.copytree(run, tmp_path / "copy")
    shutil.copytree(tmp_path / "copy", run / finished.FOLDER)
    assert len(R.run_dirs(results)) == 6 and len(R.load_metrics(results)) == 6
    assert len(R.run_dirs(results / "runs" / "resnet50" / "fp32")) == 2


def test_the_figures_job_imports_neither_torch_nor_scipy(synthetic, tmp_path):
    """A study's figures job draws from the run files alone: without torch (~4 s to import here, FP16's lines come
    from lab.core.fp16_range) and scipy; each of a study's figure jobs paid both before."""
    code = ("import sys; from lab import cli; "
            f"rc = cli.main(['figures', '--results', {str(synthetic)!r}, '--out', {str(tmp_path)!r}]); "
            "print(rc, sorted(m for m in ('torch', 'scipy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.stdout.splitlines()[-1] == "0 []", res.stdout[-2000:] + res.stderr[-2000:]


def test_grad_hist_marks_fp16_limits_from_finfo(synthetic):
    census, hist = R.load_census(synthetic), R.load_hist(synthetic)
    fig = F.grad_hist_figure(hist, census, "resnet50")
    fi = torch.finfo(torch.float16)
    want = {"fp16_smallest_subnormal": math.log2(fi.smallest_normal * fi.eps),  # 2^-24
            "fp16_smallest_normal": math.log2(fi.smallest_normal), "fp16_max": math.log2(fi.max)}
    assert want["fp16_smallest_subnormal"] == -24 and want["fp16_smallest_normal"] == -14
    assert len(fig.axes) == 2  # activation and weight gradients
    for ax in fig.axes:
        marks = {ln.get_gid(): ln.get_xdata()[0] for ln in ax.lines if (ln.get_gid() or "").startswith("fp16_")}
        assert marks == pytest.approx(want)
        texts = [t.get_text() for t in ax.texts if t.get_gid() == "lost_text"]
        assert len(texts) == 1 and "lost in FP16" in texts[0]
        for scale in (1, 128, 1024, 65536):
            assert f"scale {scale:>6}:" in texts[0]
    # the fractions written on it: from the census; the histogram gives the same for bin-aligned data
    exact = D.lost_fractions("resnet50", census, hist)
    estimate = D.lost_fractions("resnet50", census.iloc[0:0], hist)
    assert set(exact["method"]) == {"census"} and set(estimate["method"]) == {"histogram"}
    assert exact["lost"].to_numpy() == pytest.approx(estimate["lost"].to_numpy())
    act = exact[exact["source"] == "activation_grad"].set_index("at_scale")["lost"]
    assert act[1.0] > act[128.0] > act[1024.0] >= act[65536.0]  # scaling up rescues small gradients
    # the percentages written on the figure, computed here from the census rows themselves: the FP32 run's
    # counterfactual __total__ rows at each scale (first seed), lost = (underflow + overflow) / non-zero values
    rows = census[(census["model"] == "resnet50") & (census["mode"] == "fp32") & (census["layer"] == "__total__")
                  & (census["source"] == "activation_grad")]
    rows = rows[rows["seed"] == rows["seed"].min()]
    text = next(t.get_text() for t in fig.axes[0].texts if t.get_gid() == "lost_text")
    for scale in (1, 128, 1024, 65536):
        sel = rows[rows["at_scale"] == scale]
        lost = (sel["underflow"].sum() + sel["overflow"].sum()) / (sel["total"] - sel["zero"]).sum()
        assert f"scale {scale:>6g}: {100 * lost:6.2f}%" in text


def test_underflow_table_orders_layers_and_counterfactual_columns(synthetic):
    census = R.load_census(synthetic)
    table = D.underflow_by_layer(census, "resnet50", "activation_grad")
    assert list(table.columns) == ["fp32 ×1", "fp32 ×128", "fp32 ×1024", "fp32 ×65536", "fp16-static128",
                                   "fp16-dynamic"]
    assert table.index[-1] == D.TOTAL_LAYER and table.index[0] == "conv_stem"
    col = table["fp32 ×1"]
    assert ((col >= table["fp32 ×128"]) & (table["fp32 ×128"] >= table["fp32 ×65536"])).all()
    steps = D.underflow_over_steps(census, "resnet50", "fp16-static128", "activation_grad")
    assert list(steps.columns) == [0, 10, 20, 30]


def test_overflow_origins_by_phase_and_figure(synthetic):
    steps = R.load_steps(synthetic)
    # the synthetic fp16-dynamic runs (seeds 0, 1) overflow at steps 0-2, before their first clean step, and at
    # step 25; their steps.csv records no layer
    o = D.overflow_origins(steps, "resnet50")
    assert o.groupby("phase")["steps"].sum().to_dict() == {"initial descent": 6, "in training": 2}
    assert set(o["origin"]) == {D.NOT_RECORDED} and set(o["mode"]) == {"fp16-dynamic"}
    s = steps.copy()
    s["first_nonfinite_layer"], s["first_nonfinite_source"] = "", ""
    seed0 = (s["seed"] == 0) & (s["found_inf"] == 1)
    s.loc[seed0 & (s["step"] < 3), ["first_nonfinite_layer", "first_nonfinite_source"]] = ["fc", "activation_grad"]
    s.loc[seed0 & (s["step"] == 25), ["first_nonfinite_layer", "first_nonfinite_source"]] = ["conv1", "param_grad"]
    o = D.overflow_origins(s, "resnet50")
    got = {(p, origin): n for p, origin, n in zip(o["phase"], o["origin"], o["steps"])}
    assert got == {("initial descent", "fc (activation_grad)"): 3, ("initial descent", D.NOT_RECORDED): 3,
                   ("in training", "conv1 (param_grad)"): 1, ("in training", D.NOT_RECORDED): 1}
    assert list(o["phase"]) == ["initial descent", "initial descent", "in training", "in training"]
    fig = F.overflow_figure(s, "resnet50")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["initial descent", "in training"]
    bars = {}  # (panel, bar label) -> summed bar width
    for ax in fig.axes:
        labels = {round(y): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
        for patch in ax.patches:
            key = (ax.get_title().split(":")[0], labels[round(patch.get_y() + patch.get_height() / 2)])
            bars[key] = bars.get(key, 0) + patch.get_width()
    assert bars == got
    assert "no overflow step" in " ".join(
        t.get_text() for ax in F.overflow_figure(s[s["mode"] == "fp32"], "resnet50").axes for t in ax.texts)


def test_figures_without_census_or_fp32_are_notes(tmp_path):
    # runs from before the gradient census: the figure files still exist and say what is missing
    root = make_results(tmp_path / "old", modes=("fp16-static128",), seeds=(0,), census=False)
    written = F.write_all(root, tmp_path / "figures")
    assert set(written) == set(expected_figures(tmp_path / "figures", "resnet50", ["fp16-static128"]))
    for path in written:
        assert_png(path, min_bytes=2000)
    census, hist = R.load_census(root), R.load_hist(root)
    assert census.empty and hist.empty
    note = F.grad_hist_figure(hist, census, "resnet50")
    assert "no grad_hist.csv" in " ".join(t.get_text() for ax in note.axes for t in ax.texts)
    assert "no census.csv" in " ".join(t.get_text() for ax in F.underflow_figure(census, "resnet50").axes
                                       for t in ax.texts)


def test_real_run_figures_and_tensorboard(tmp_path):
    # one real tiny training run (dynamic scaling: 2^16 overflows at first, so steps are skipped)
    study = tiny_study()
    study["modes"]["fp16-dynamic"] = {"precision": "fp16", "scaler": {"policy": "dynamic"}}
    run_dir = tmp_path / "results" / "runs" / "resnet50" / "fp16-dynamic" / "seed0"
    metrics = train(resolve_run(validate_study(study), "resnet50", "fp16-dynamic", 0), run_dir)
    make_run(tmp_path / "results" / "runs" / "resnet50" / "fp32" / "seed0", "resnet50", "fp32", 0)  # a reference
    assert metrics["skipped_steps"] >= 1

    written = F.write_all(tmp_path / "results", tmp_path / "figures")
    assert set(written) == set(expected_figures(tmp_path / "figures", "resnet50", ["fp32", "fp16-dynamic"]))
    for path in written:
        assert_png(path)
    scale_fig = F.scale_figure(R.load_steps(run_dir), "resnet50")
    skipped_marks = [ln for ln in scale_fig.axes[0].lines if ln.get_marker() == "x" and len(ln.get_xdata())]
    assert sum(len(ln.get_xdata()) for ln in skipped_marks) == metrics["skipped_steps"]

    out = tmp_path / "tensorboard"
    res = lab_here("tensorboard", run_dir, "--out", out)
    assert res.returncode == 0, res.stderr
    event_dir = R.tensorboard_dir(out, "resnet50", "fp16-dynamic", 0)
    assert res.stdout.split() == [str(event_dir)]
    assert len(list(event_dir.glob("events.out.tfevents.*"))) == 1
    scalars = tb.read_scalars(event_dir)
    assert TB_TAGS <= set(scalars)
    steps = pd.read_csv(run_dir / "steps.csv")
    assert [v for _, v in scalars["loss_scale"]] == steps["scale"].tolist()
    assert [s for s, _ in scalars["loss"]] == steps["step"].tolist()
    assert scalars["skip_count"][-1][1] == metrics["skipped_steps"]
    assert scalars["update_ratio"][-1][1] == pytest.approx(metrics["update_ratio"], rel=1e-6)
    assert scalars["val/final_top1"][-1][1] == pytest.approx(metrics["final_top1"], rel=1e-6)
    # exporting again replaces the event file instead of adding a second one
    tb.export([run_dir], out)
    assert len(list(event_dir.glob("events.out.tfevents.*"))) == 1


def check_figures_and_report(repo_copy, study):
    """After a finished study in repo_copy, its config in configs/default.yaml (tests/test_workflow.py runs one):
    every figure, TensorBoard run and log the study writes, then `snakemake --report`, self-contained, with every
    figure and caption."""
    results = repo_copy / "results"
    figures = [p for model in study["models"] for p in expected_figures(results / "figures", model, study["modes"])]
    for path in figures:
        assert_png(path)
    for model in study["models"]:
        for mode in study["modes"]:
            assert list(R.tensorboard_dir(results / "tensorboard", model, mode, 0).glob("events.out.tfevents.*"))
        assert (results / "logs" / "figures" / f"{model}.log").is_file()
    assert "<table" in (results / "tables" / "summary.html").read_text()

    res = snakemake(repo_copy, "--report", "results/report.html")  # the study in configs/default.yaml
    assert res.returncode == 0, res.stderr[-3000:]
    html = (results / "report.html").read_text()
    assert len(html) > 100_000
    for caption in ("Loss scale per optimizer step", "Gradient magnitudes of an FP32 run", "Per-layer underflow",
                    "Final validation top-1", "Training loss", "seed by seed", "Study summary",
                    "Loss-Scale Lab"):
        assert caption in html, caption
    # self-contained: every figure and the table are embedded, nothing is fetched
    assert html.count("data:image/png") == len(figures)
    assert "filename=summary.html;base64" in html
    assert "<script src=" not in html and 'rel="stylesheet" href="http' not in html


def test_run_whose_every_step_overflowed_still_gets_its_figure(tmp_path):
    """Megatron's hysteresis from 2^32 can skip every step of a short run: no finite gradient norm at all
    (a log axis with no positive value used to crash the figures rule)."""
    steps = pd.DataFrame({"model": "lm", "mode": "fp16-hysteresis", "seed": 0, "step": range(6),
                          "epoch": 0, "loss": 6.9, "scale": [2.0 ** (32 - i // 2) for i in range(6)],
                          "found_inf": 1, "skipped": 1, "grad_norm": float("nan"), "lr": 1e-3,
                          "precision": "fp16"})
    out = tmp_path / "hysteresis.png"
    F.run_dynamics_figure(steps, "lm", "fp16-hysteresis", out)
    assert out.stat().st_size > 0


def test_a_narrow_underflow_figure_keeps_its_title_on_the_page(synthetic):
    """One mode's heatmap makes the narrowest figure: its two-line title once ran off both edges."""
    census = R.load_census(synthetic, mode="fp16-dynamic")
    fig = F.underflow_figure(census, "resnet50")
    renderer = fig.canvas.get_renderer()
    title, = [t.get_window_extent(renderer) for t in fig.texts if t.get_text() == fig.get_suptitle()]
    assert 0 <= title.x0 and title.x1 <= fig.bbox.width


def test_a_mode_without_loss_scaling_is_named_by_its_mode_not_its_precision():
    steps = pd.DataFrame({"model": "lm", "mode": "fp8-delayed", "seed": 0, "step": range(4), "epoch": 0,
                          "loss": 6.9, "scale": 1.0, "found_inf": 0, "skipped": 0, "grad_norm": 1.0, "lr": 1e-3,
                          "precision": "bf16"})  # an FP8 recipe's runs: bf16 around the FP8 matmuls
    fig = F.run_dynamics_figure(steps, "lm", "fp8-delayed")
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert notes == ["fp8-delayed: no loss scaling (precision bf16)"]


def test_the_recipes_figure_measures_against_fp32_without_bf16_and_keeps_its_legend_off_the_data():
    from lab.report.recipe_figures import KINDS, draw
    nan = float("nan")

    def row(model, mode, bf16=nan, fp32=nan, share=nan):
        shares = {f"{w}_{k}_pct": share for w in ("flushed", "saturated") for k in KINDS}
        return dict(model=model, mode=mode, delta_vs_bf16=bf16, delta_vs_bf16_ci=0.01, delta_vs_fp32=fp32,
                    delta_vs_fp32_ci=0.01, **shares)
    table = pd.DataFrame([row("lm", "bf16", fp32=0.02), row("lm", "fp32", bf16=-0.02),
                          row("lm", "fp8-current", bf16=0.01, fp32=0.03, share=4e-4),
                          row("vit", "fp32"), row("vit", "fp8-current", fp32=0.05, share=3e-3)])  # no BF16 runs
    fig = draw(table)
    (lm_loss, lm_shares), (vit_loss, vit_shares) = fig.axes[0:2], fig.axes[2:4]
    assert "BF16" in lm_loss.get_title() and [t.get_text() for t in lm_loss.get_yticklabels()] == ["fp8-current",
                                                                                                   "fp32"]
    # the ViT has no BF16 runs: its loss is drawn against FP32's (not an empty panel), FP32's own row dropped
    assert "FP32" in vit_loss.get_title() and [t.get_text() for t in vit_loss.get_yticklabels()] == ["fp8-current"]
    assert list(vit_loss.lines[0].get_xdata()) == [0.05]
    # one legend, the figure's, above the panels: none on an axes, over the marks
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    # a share axis spans whole decades around its values, the shares inside it
    lo, hi = vit_shares.get_xlim()
    assert lo < 3e-3 < hi and hi / lo >= 10


def test_a_deep_models_underflow_rows_are_labelled_readably(synthetic):
    """A MobileNet-v2-deep census (90 layers): every layer's label at least 6.5 points, none overlapping the next."""
    census = R.load_census(synthetic, mode="fp16-dynamic")
    census = census[census["model"] == "resnet50"]
    one = census[census["layer"] == census["layer"].iloc[0]]
    deep = pd.concat([one.assign(layer=f"features.{i}.conv.{i % 3}.weight") for i in range(90)], ignore_index=True)
    fig = F.underflow_figure(deep, "resnet50")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [t for t in ax.get_yticklabels() if t.get_text().startswith("features.")]
        if not labels:
            continue
        assert len(labels) == 90
        assert min(t.get_fontsize() for t in labels) >= 6.5
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.y0)
        assert all(a.y1 <= b.y0 + 0.5 for a, b in zip(boxes, boxes[1:]))
