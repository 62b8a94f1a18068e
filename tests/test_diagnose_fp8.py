"""`lab diagnose` on FP8 runs (lab/diagnose/fp8.py), a catalogue of failures each planted in a real loop recorded by
lab.record: the cause named, the advice consistent with the evidence, and healthy runs of each
recipe called healthy. Runs are short (a GPT of the lab's, a learnable token chain, a census every other step)."""
import pytest
import torch
import torch.nn as nn

import lab
from conftest import assert_valid_diagnosis
from lab.diagnose import diagnose, format_text
from lab.fp8 import create_recipe
from lab.fp8.linear import convert
from lab.models.presets import create_model

V, T = 128, 32


def batches(steps, seed=0, batch=8):
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, V, (V, 4), generator=g)  # each token has 4 possible successors: learnable
    for _ in range(steps):
        x = torch.zeros(batch, T + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, V, (batch,), generator=g)
        for t in range(T):
            x[:, t + 1] = nxt[x[:, t], torch.randint(0, 4, (batch,), generator=g)]
        yield x[:, :-1], x[:, 1:]


def record(tmp_path, recipe, steps=8, hooks=None, weights=None, zero=None, torchao=None):
    """Train the GPT under `recipe` (or torchao's recipe `torchao`) in BF16, recorded; `hooks`: {step: [(module
    name, forward pre-hook)]} planted for one step; `weights`: the loss's per-sample weights; `zero`: a linear whose
    weight starts all zero (a LoRA B)."""
    torch.manual_seed(0)
    model = create_model("gpt-tiny", num_classes=V, in_chans=1, input_size=T)
    if zero:
        with torch.no_grad():
            model.get_submodule(zero).weight.zero_()
    if torchao:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        config = Float8LinearConfig.from_recipe_name(torchao)
        convert_to_float8_training(model, config=type(config)(**{**config.__dict__, "emulate": True}),
                                   module_filter_fn=lambda mod, name: "head" not in name)
    else:
        convert(model, create_recipe(recipe))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = tmp_path / "run"
    with lab.record(model, None, out=out, optimizer=opt, precision="bf16", census_every=2, log_every=4) as rec:
        for step, (x, y) in enumerate(batches(steps)):
            planted = [model.get_submodule(name).register_forward_pre_hook(fn)
                       for name, fn in (hooks or {}).get(step, [])]
            with lab.autocast("cpu", torch.bfloat16):
                per_token = nn.functional.cross_entropy(model(x).float().reshape(-1, V), y.reshape(-1),
                                                        reduction="none").reshape(y.shape)
            w = torch.ones(y.shape[0], 1) if weights is None else weights[:, None]
            loss = (per_token * w).sum() / y.numel()
            loss.backward()
            opt.step()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
            for h in planted:
                h.remove()
    d = diagnose(out)
    assert_valid_diagnosis(d)  # every FP8 case's --json holds to the documented schema
    return d


def codes(d):
    return [f.code for f in d.findings], [r.code for r in d.recommendations]


def times(factor):
    return lambda module, args: (args[0] * factor,)


def test_an_all_zero_weight_without_an_amax_floor(tmp_path):
    """pytorch/ao#3356: a LoRA B starts all zero; rowwise scales without a lower bound on the amax make it NaN."""
    d = record(tmp_path, {"name": "fp8-rowwise", "amax_floor": 0.0}, steps=4, zero="blocks.0.attn.proj")
    found, recs = codes(d)
    text = format_text(d)
    assert "fp8_infinite_scale" in found and recs[0] == "amax_floor", text
    assert d.verdict != "healthy"
    cause = next(f for f in d.findings if f.code == "fp8_infinite_scale")
    assert cause.evidence["layer"] == "blocks.0.attn.proj" and cause.evidence["role"] == "weight", text
    for wrong in ("lower_lr", "bf16", "keep_fp32"):
        assert wrong not in recs, text


def test_an_activation_jump_beyond_the_delayed_history(tmp_path):
    """An input 64x its history's amax for one step: delayed scaling clips it (Transformer Engine's margin exists for
    this); current scaling in the same loop clips nothing."""
    hooks = {6: [("blocks.0.mlp.fc", times(64.0))]}
    d = record(tmp_path, "fp8-delayed", hooks=hooks)
    found, recs = codes(d)
    text = format_text(d)
    assert "fp8_delayed_clipping" in found and recs[0] == "current_scaling", text
    f = next(f for f in d.findings if f.code == "fp8_delayed_clipping")
    assert f.severity == "warning" and f.evidence["step"] == 6 and f.evidence["lag"] > 16, text
    assert d.verdict == "issues"
    same = record(tmp_path / "current", "fp8-current", hooks=hooks)
    assert "fp8_delayed_clipping" not in codes(same)[0]


def test_e4m3_gradients_flush_under_a_per_tensor_scale(tmp_path):
    """Gradients 2^20 apart within one backward (one sample weighted 1, the rest 2^-20): E4M3's 2^18 of range under
    one scale flushes the small ones; advice E5M2 (2^32 of range), which the same loop with E5M2 gradients shows
    keeps them."""
    w = torch.full((8,), 2.0 ** -20)
    w[0] = 1.0
    d = record(tmp_path, {"name": "fp8-current", "grad_element": "e4m3"}, weights=w)
    found, recs = codes(d)
    text = format_text(d)
    flush = next(f for f in d.findings if f.code == "fp8_flushed" and f.evidence["kind"] == "gradient")
    assert flush.severity == "warning" and recs[0] == "e5m2_gradients", text
    e5m2 = record(tmp_path / "e5m2", "fp8-current", weights=w)
    assert e5m2.fp8["shares"]["gradient"]["flushed"] < 0.1 * d.fp8["shares"]["gradient"]["flushed"]
    assert "e5m2_gradients" not in codes(e5m2)[1]  # never advise what the run already uses


def test_a_saturating_activation_under_mx_floor_rounding(tmp_path):
    """Values near 7.5 (a saturating activation 7.5 tanh(4x)): a block's amax mantissa 1.875 rounds the floor scale
    down and its largest elements clip (the OCP spec's rule, Mishra et al. 2025); RCEIL in the same loop does not."""
    hooks = {s: [("blocks.0.mlp.fc", lambda m, a: (7.5 * torch.tanh(4 * a[0]),))] for s in range(8)}
    d = record(tmp_path, {"name": "mxfp8", "rounding": "floor"}, hooks=hooks)
    found, recs = codes(d)
    text = format_text(d)
    f = next(f for f in d.findings if f.code == "fp8_block_clipping")
    assert f.severity == "warning" and recs[0] == "rceil", text
    rceil = record(tmp_path / "rceil", {"name": "mxfp8", "rounding": "rceil"}, hooks=hooks)
    assert "fp8_block_clipping" not in codes(rceil)[0] and rceil.fp8["shares"]["activation"]["saturated"] == 0


def test_a_layer_better_kept_in_bf16(tmp_path):
    """The head quantized too (keep_high empty) with an outlier channel in its input, 10^6 the others: per-tensor E4M3
    flushes the rest of that one layer's input; the advice names the head, not the recipe."""
    def outlier(module, args):
        x = args[0].clone()
        x[..., 0] = x[..., 0] * 1e6
        return (x,)
    hooks = {s: [("head", outlier)] for s in range(8)}
    d = record(tmp_path, {"name": "fp8-current", "keep_high": []}, hooks=hooks)
    text = format_text(d)
    f = next(f for f in d.findings if f.code == "fp8_flushed" and f.evidence["kind"] == "activation")
    assert f.evidence["layers"] == ["head"], text
    rec = next(r for r in d.recommendations if r.code == "keep_high")
    assert rec.change["keep_high"] == ["head"], text


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise",
                                    {"name": "mxfp8", "rounding": "rceil"}, "nvfp4"],
                         ids=lambda r: r if isinstance(r, str) else "mxfp8-rceil")
def test_healthy_runs_of_each_recipe_are_called_healthy(tmp_path, recipe):
    d = record(tmp_path, recipe)
    text = format_text(d)
    assert d.verdict == "healthy", text
    assert not [f for f in d.findings if f.code.startswith("fp8_") and f.severity != "info"], text
    first = d.recommendations[0]
    assert first.code == "healthy" or first.action.startswith("Optional"), text


def test_a_torchao_float8_loop_is_censused_and_diagnosed(tmp_path):
    pytest.importorskip("torchao")
    d = record(tmp_path, None, torchao="tensorwise")
    from lab.diagnose.inspect import format_inspect, inspect_run
    assert "FP8 census step 6: activation" in format_inspect(inspect_run(tmp_path / "run"))
    assert d.fp8 is not None and d.fp8["census_steps"] == 4 and d.verdict == "healthy", format_text(d)


def test_replay_gives_every_recipe_on_the_run_s_own_tensors(tmp_path):
    """`lab replay` over a recorded FP8 run. The run's own recipe replayed on its kept tensors
    reproduces the run's census of that step exactly (the same quantizers on the same tensors); the other recipes
    are quantized on the same tensors; a recipe whose blocks the shapes do not hold is said, not dropped."""
    import subprocess
    import sys

    import pandas as pd

    from lab.fp8.replay import replay_run
    d = record(tmp_path, "fp8-current")
    run = tmp_path / "run"
    rows = {r["recipe"]: r for r in replay_run(run)}
    census = pd.read_csv(run / "fp8_census.csv")
    last = census[census["step"] == census["step"].max()]
    for role, kind in (("input", "activation"), ("weight", "weight"), ("grad_output", "gradient")):
        sel = last[last["role"] == role]
        assert rows["fp8-current"][f"flushed_{kind}"] == pytest.approx(100 * sel.flushed.sum() / sel.nonzero.sum())
        assert rows["fp8-current"][f"saturated_{kind}"] == pytest.approx(100 * sel.saturated.sum() / sel.numel.sum())
    assert rows["fp8-noscale"]["flushed_gradient"] > rows["fp8-current"]["flushed_gradient"]
    assert {"fp8-delayed", "nvfp4", "fp8-blockwise"} <= set(rows) and any(r.startswith("mxfp8") for r in rows)
    out = subprocess.run([sys.executable, "-m", "lab", "replay", str(run), "--recipe", "fp8-rowwise"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "fp8-rowwise" in out.stdout and "flush%" in out.stdout, out.stderr
    assert d.verdict == "healthy"


@pytest.mark.parametrize("flushed, subnormal, severity", [(0.0, 0.85, "warning"), (0.0, 0.75, "info"),
                                                          (0.25, 0.0, "warning"), (0.05, 0.0, "info")])
def test_fp8_subnormals_count_as_precision_lost(tmp_path, flushed, subnormal, severity):
    """For FP8 too: values kept only as E4M3 subnormals (1-3 significant bits) count with the
    flushed ones against COARSE_MATERIAL (80%), flushed ones alone against FLUSH_MATERIAL (20%)."""
    import csv

    from lab.diagnose.fp8 import fp8_findings
    from lab.diagnose.record import Diagnosis, _Builder
    from lab.fp8.census import COLUMNS
    n = 10_000
    row = {c: 0 for c in COLUMNS}
    row.update(step=0, gemm="grad_input", role="grad_output", element="e4m3", granularity="tensor",
               scale_rule="current", numel=n, nonzero=n, amax=1.0, history_amax="", scale_min=1.0, scale_max=1.0,
               flushed=round(flushed * n), subnormal=round(subnormal * n), rel_error=0.1, blocks=1,
               worst_block_error=0.1)
    with open(tmp_path / "fp8_census.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for layer in ("a", "b", "c"):
            w.writerow(dict(row, layer=layer))
    b = _Builder()
    fp8_findings(b, Diagnosis(run_dir=str(tmp_path), verdict="", headline=""), tmp_path)
    found = next(f for f in b.findings if f.code == "fp8_flushed")
    assert found.severity == severity


def test_a_delayed_runs_first_step_flush_is_named_with_its_remedy(tmp_path):
    """Delayed scaling's first step has nothing in its history: TE's scale 1 flushes small gradients there. The
    diagnosis says when (not where) and recommends `initial: current`; the same run with it does not flush there."""
    w = torch.full((8,), 1e-3)  # the loss (and every gradient) x 1e-3: under E5M2's 2^-16 at scale 1
    d = record(tmp_path / "te", "fp8-delayed", weights=w)
    finding = next(f for f in d.findings if f.code == "fp8_flushed" and f.evidence.get("kind") == "gradient")
    assert finding.evidence["first_step"] >= 0.5 and "history was still empty" in finding.message
    assert "delayed_initial_current" in codes(d)[1] and "finer_granularity" not in codes(d)[1]
    fixed = record(tmp_path / "current", {"name": "fp8-delayed", "initial": "current"}, weights=w)
    assert "delayed_initial_current" not in codes(fixed)[1]


def _mlp_under(recipe, out, scale=1.0, steps=4, block_max=None):
    """A user's MLP at PyTorch's default nn.Linear initialisation (fan_in 64: bound 1/8), every linear converted;
    `block_max`: every 32-value block of the FP32 input holds this value (the rest under 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    convert(model, create_recipe({**recipe, "keep_high": []}))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with lab.record(model, None, out=out, optimizer=opt, precision="bf16", census_every=2) as rec:
        for _ in range(steps):
            x = torch.randn(32, 64, generator=g)
            if block_max is not None:
                x = x.clamp(-1, 1)
                x[:, ::32] = block_max
            with lab.autocast("cpu", torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            rec.step(loss)
            opt.zero_grad(set_to_none=True)
    d = diagnose(out)
    assert_valid_diagnosis(d)
    return d


def test_default_init_weights_clip_under_mx_floor_from_the_start(tmp_path):
    """PyTorch's default init bounds a fan-in-64 layer's weights by exactly 2^-3, so each 32-block's
    largest weight sits just under a power of two, MX floor rounding scales it past E4M3's 448 and about an eighth of
    the weights clip at step 0; diagnose names that cause and advises RCEIL, which clips none."""
    d = _mlp_under({"name": "mxfp8", "rounding": "floor"}, tmp_path / "floor")
    f = next(f for f in d.findings if f.code == "fp8_block_clipping")
    text = format_text(d)
    assert f.evidence["role"] == "weight" and f.evidence["init_power_of_two"], text
    assert 0.05 < f.evidence["clipped"] <= 0.125 and "1/sqrt(fan_in)" in f.message, text
    assert codes(d)[1][0] == "rceil", text
    rceil = _mlp_under({"name": "mxfp8", "rounding": "rceil"}, tmp_path / "rceil")
    assert "fp8_block_clipping" not in codes(rceil)[0] and rceil.fp8["shares"]["weight"]["saturated"] == 0
    # weights bounded by 0.9/8 = 1.8 x 2^-4 still clip under floor rounding, but not because of a power-of-two bound
    other = _mlp_under({"name": "mxfp8", "rounding": "floor"}, tmp_path / "other", scale=0.9)
    g = next(f for f in other.findings if f.code == "fp8_block_clipping")
    assert not g.evidence["init_power_of_two"] and "1/sqrt(fan_in)" not in g.message, format_text(other)


def test_an_fp8_runs_report_and_replay_name_its_own_recipe(tmp_path):
    """lab.record writes the run's recipe with its settings to config.yaml; the text report names it and
    the census's shares; lab replay's first row is that recipe (marked), reproducing the census exactly, where the
    same recipe at its defaults gives other numbers."""
    import pandas as pd
    import yaml

    from lab.fp8.replay import replay_run
    spec = {"name": "fp8-current", "grad_element": "e4m3"}
    d = record(tmp_path, spec)
    run = tmp_path / "run"
    mode = yaml.safe_load((run / "config.yaml").read_text())["mode"]
    assert mode["recipe"] == spec and mode["fp8_layers"] == "lab" and d.recipe == spec
    import json
    metrics = json.loads((run / "metrics.json").read_text())  # as a lab run's say it
    assert metrics["recipe"] == "fp8-current" and metrics["recipe_kept_high"] == ["head"]
    text = format_text(d)
    assert "recipe fp8-current (grad_element e4m3)" in text and "FP8 census" in text, text
    rows = replay_run(run)
    assert rows[0]["recipe"] == "fp8-current grad_element=e4m3 (this run)", rows[0]
    census = pd.read_csv(run / "fp8_census.csv")
    last = census[(census["step"] == census["step"].max()) & (census["role"] == "grad_output")]
    assert rows[0]["flushed_gradient"] == pytest.approx(100 * last.flushed.sum() / last.nonzero.sum())
    default = next(r for r in rows[1:] if r["recipe"] == "fp8-current")
    assert default["flushed_gradient"] != rows[0]["flushed_gradient"]  # E5M2 gradients at the defaults
    # the same recipe and settings named on the command line give the same row
    from lab.cli import main
    import json
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["replay", str(run), "--recipe", "fp8-current:grad_element=e4m3", "--json"]) == 0
    (named,) = json.loads(out.getvalue())
    assert named["recipe"] == "fp8-current grad_element=e4m3"
    assert named["flushed_gradient"] == rows[0]["flushed_gradient"]


@pytest.mark.parametrize("spec", [{"name": "fp8-current", "grad_element": "e4m3"}, {"name": "mxfp8", "rounding": "floor"}])
def test_the_own_recipe_row_reproduces_a_census_without_a_first_layers_input_gradient(tmp_path, spec):
    # each input block's largest value 1.999 in FP32: MX floor rounding clips it (511 > 448), its BF16 rounding, 2.0,
    # what the layer quantized under autocast, it does not (256): a replay of the FP32 input would differ
    """A first linear fed the raw FP32 input under BF16 autocast: the replay quantizes what the layer quantized (the
    input as autocast casts it), and leaves out the input-gradient GEMM the layer never ran, reproducing the census's
    shares of every kind exactly."""
    import pandas as pd

    from lab.fp8.replay import replay_run
    _mlp_under(spec, tmp_path / "run", block_max=1.999)
    census = pd.read_csv(tmp_path / "run" / "fp8_census.csv")
    last = census[census["step"] == census["step"].max()]
    assert not ((last["layer"] == "0") & (last["gemm"] == "grad_input")).any()  # never computed
    own = replay_run(tmp_path / "run")[0]
    assert own["operands"] == len(last)  # the operands the run quantized, no more
    for role, kind in (("input", "activation"), ("weight", "weight"), ("grad_output", "gradient")):
        sel = last[last["role"] == role]
        assert own[f"flushed_{kind}"] == pytest.approx(100 * sel.flushed.sum() / sel.nonzero.sum(), abs=0)
        assert own[f"saturated_{kind}"] == pytest.approx(100 * sel.saturated.sum() / sel.numel.sum(), abs=0)
