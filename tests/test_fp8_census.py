"""The FP8 census (lab/fp8/census.py, lab/fp8/model_census.py): each quantizer's elements and clipped mask against the
FP64 references of the formats, each census number against its definition computed in FP64, the lab's recipe layers
and torchao's Float8Linear giving the same rows for the same operands, census steps only, and resume."""
import math

import pytest
import torch
import torch.nn as nn

from lab.formats import OperandFormat, overflow_bound, quantize
from lab.formats.reference import ref_mx, ref_nvfp4
from lab.fp8 import create_recipe
from lab.fp8.census import NUMBERS, _blocks, operand_stats, smallest_normal
from lab.fp8.linear import convert
from lab.fp8.model_census import Fp8Census

FORMATS = [OperandFormat("e4m3", g) for g in ("tensor", "row", "tile", "block")] + [
    OperandFormat("e5m2", "tile"), OperandFormat("e4m3", "row", "pow2"), OperandFormat("e4m3", "tensor", "one"),
    OperandFormat("e4m3", "mx", scale_rounding="floor"), OperandFormat("e4m3", "mx", scale_rounding="rceil"),
    OperandFormat("e2m1", "mx", scale_rounding="floor"),
    OperandFormat("e2m1", "nvfp4"), OperandFormat("e2m1", "nvfp4-2d"), OperandFormat("e4m3", "tile", stochastic=True)]


def operand(seed=0, m=256, k=384):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 4, (m, 1), generator=g).float())
    x[3, 5] = 300.0     # an outlier: one block's scale set by it
    x[7] = 0.0          # an all-zero row
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.element}-{f.granularity}-{f.scale}"
                         + ("-sr" if f.stochastic else ""))
@pytest.mark.parametrize("k_dim", [0, 1])
def test_elements_and_clipped_are_what_the_quantizer_did(fmt, k_dim):
    x = operand()
    q = quantize(x, fmt, k_dim, generator=torch.Generator().manual_seed(1), stats=True)
    top = 6.0 if fmt.element == "e2m1" else float(torch.finfo({"e4m3": torch.float8_e4m3fn,
                                                              "e5m2": torch.float8_e5m2}[fmt.element]).max)
    assert q.elements.shape == q.clipped.shape == x.shape and q.clipped.dtype == torch.bool
    assert float(q.elements.abs().max()) <= top
    assert bool((q.elements[q.clipped].abs() == top).all())  # a clipped element sits at the format's maximum
    if fmt.element != "e2m1":  # on the FP8 grid
        dtype = torch.float8_e4m3fn if fmt.element == "e4m3" else torch.float8_e5m2
        assert torch.equal(q.elements.to(dtype).float(), q.elements)
    # one decode scale per scaling block: values / elements is constant within each block
    ratio = torch.where(q.elements != 0, q.values / q.elements, torch.full_like(x, math.nan))
    rb = _blocks(ratio, k_dim, fmt.granularity)
    spread = torch.nan_to_num(rb, nan=-math.inf).amax(1) / torch.nan_to_num(rb, nan=math.inf).amin(1)
    finite = spread[torch.isfinite(spread)]
    assert torch.allclose(finite, torch.ones_like(finite), rtol=2e-7)  # values = elements / scale, rounded once


@pytest.mark.parametrize("element, rounding", [("e4m3", "floor"), ("e4m3", "rceil"), ("e2m1", "floor")])
def test_mx_elements_and_clipping_equal_the_specification(element, rounding):
    x = operand(2)
    q = quantize(x, OperandFormat(element, "mx", scale_rounding=rounding), 1, stats=True)
    ref = ref_mx(x.double(), 1, element, rounding)
    assert torch.equal(q.elements.double(), ref.elements)
    assert int(q.clipped.sum()) == ref.saturated


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_elements_equal_the_specification(two_d):
    x = operand(3)
    q = quantize(x, OperandFormat("e2m1", "nvfp4-2d" if two_d else "nvfp4"), 1, stats=True)
    ref = ref_nvfp4(x.double(), 1, two_d=two_d)
    assert torch.equal(q.elements.double(), ref.elements)
    assert int(q.clipped.sum()) == ref.saturated


def fp64_stats(x, q, fmt, k_dim, history=None):
    """Each census number from its definition, in FP64 and plain loops over the blocks."""
    x64, v64, e64 = x.double(), q.values.double(), q.elements.double()
    nz = x64 != 0
    blocks_x, blocks_v = _blocks(x64, k_dim, fmt.granularity), _blocks(v64, k_dim, fmt.granularity)
    blocks_c = _blocks(q.clipped.double(), k_dim, fmt.granularity)
    worst = 0.0
    for bx, bv in zip(blocks_x, blocks_v):
        if bx.norm() > 0:
            worst = max(worst, float((bv - bx).norm() / bx.norm()))
    scale = (e64 / v64)[(e64 != 0) & (v64 != 0)].abs()
    return {"numel": x.numel(), "nonzero": int(nz.sum()), "amax": float(x64.abs().max()),
            "history_amax": math.nan if history is None else float(history),
            "scale_min": float(scale.min()), "scale_max": float(scale.max()),
            "saturated": int(q.clipped.sum()), "flushed": int((nz & (v64 == 0)).sum()),
            "subnormal": int(((e64 != 0) & (e64.abs() < smallest_normal(fmt.element))).sum()),
            "nonfinite": int((~v64.isfinite()).sum()),
            "rel_error": float((v64 - x64).norm() / x64.norm()), "blocks": len(blocks_x),
            "blocks_clipped": int((blocks_c.amax(1) > 0).sum()),
            "zero_blocks": int((blocks_x.abs().amax(1) == 0).sum()), "worst_block_error": worst}


@pytest.mark.parametrize("fmt", FORMATS[:8] + FORMATS[9:12], ids=lambda f: f"{f.element}-{f.granularity}-{f.scale}")
@pytest.mark.parametrize("layout", ["k1", "k0", "k1-transposed", "k0-transposed"])
def test_census_numbers_equal_their_definitions(fmt, layout):
    """k along either dimension, the operand contiguous or a transposed view (go^T, the weight-gradient GEMM's):
    the census reduces each block on a view of whichever of t and t^T is contiguous."""
    k_dim = int(layout[1])
    x = operand(4) if k_dim == 1 else operand(4).t().contiguous()
    if layout.endswith("transposed"):
        x = x.t().contiguous().t()
    q = quantize(x, fmt, k_dim, stats=True)
    got = dict(zip(NUMBERS, operand_stats(x, q, fmt, k_dim).tolist()))
    want = fp64_stats(x, q, fmt, k_dim)
    for key in NUMBERS:
        if key in ("scale_min", "scale_max"):  # elements / values: the scale, to the dequantization's rounding
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
        elif isinstance(want[key], float) and math.isnan(want[key]):
            assert math.isnan(got[key]), key
        elif key in ("rel_error", "worst_block_error"):  # FP32 squares and sums
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        else:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


def test_delayed_scaling_clips_what_jumped_beyond_its_history():
    """A history amax 16x below the tensor's: the census sees the lag and the clipped elements and blocks."""
    x = operand(5)
    fmt = OperandFormat("e4m3", "tensor", "delayed")
    history = x.abs().max() / 16
    q = quantize(x, fmt, 1, history_amax=history, stats=True)
    got = dict(zip(NUMBERS, operand_stats(x, q, fmt, 1, history).tolist()))
    assert got["amax"] / got["history_amax"] == pytest.approx(16.0)
    # the scale used: one per tensor, from the history's amax (Transformer Engine's 448 / amax)
    assert got["scale_min"] == pytest.approx(448.0 / float(history), rel=1e-6) == got["scale_max"]
    scaled = x * (448.0 / history)
    assert got["saturated"] == int((scaled.abs() > overflow_bound("e4m3")).sum()) > 0
    assert got["blocks"] == 1 and got["blocks_clipped"] == 1


def gpt(recipe=None, seed=0):
    from lab.models.presets import create_model
    torch.manual_seed(seed)
    model = create_model("gpt-tiny", num_classes=128, in_chans=1, input_size=16)
    return model if recipe is None else convert(model, create_recipe(recipe))


def train_steps(model, census, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randint(0, 128, (4, 16), generator=g)
        census.begin_step(step)
        logits = model(x)
        nn.functional.cross_entropy(logits.reshape(-1, 128), x.reshape(-1)).backward()
        census.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("lab_name, torchao_name", [("fp8-current", "tensorwise"), ("fp8-rowwise", "rowwise"),
                                                    ("fp8-rowwise-gw-hp", "rowwise_with_gw_hp")])
def test_torchao_layers_are_censused_as_the_lab_s_equal_recipe(lab_name, torchao_name):
    """The same weights and batches: torchao's Float8Linear (observed through hooks) and the lab's RecipeLinear
    (counting its own operands) give the same census rows, bit for bit (their GEMMs are equal: test_fp8_linear)."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    lab_model = gpt(lab_name)
    ao_model = gpt()
    config = Float8LinearConfig.from_recipe_name(torchao_name)
    convert_to_float8_training(ao_model, config=type(config)(**{**config.__dict__, "emulate": True}),
                               module_filter_fn=lambda mod, name: "head" not in name)
    lab_census, ao_census = Fp8Census(lab_model, every=2), Fp8Census(ao_model, every=2)
    assert len(ao_census.torchao) == len(lab_census.layers) > 0
    train_steps(lab_model, lab_census)
    train_steps(ao_model, ao_census)
    key = lambda r: (r["step"], r["layer"], r["gemm"], r["role"])  # noqa: E731
    lab_rows, ao_rows = sorted(lab_census.taken, key=key), sorted(ao_census.taken, key=key)
    assert {r["step"] for r in lab_rows} == {0, 2}  # census steps only
    assert len(lab_rows) == len(ao_rows)
    for a, b in zip(lab_rows, ao_rows):
        assert key(a) == key(b)
        for col in NUMBERS:
            assert a[col] == b[col] or (math.isnan(a[col]) and math.isnan(b[col])), (key(a), col)


def test_census_rows_survive_a_checkpoint(tmp_path):
    model = gpt("fp8-delayed")
    census = Fp8Census(model, every=1)
    train_steps(model, census, steps=2)
    again = Fp8Census(gpt("fp8-delayed"), every=1)
    again.load_state_dict(census.state_dict())
    assert again.taken == census.taken and len(census.taken) > 0
    path = census.write(tmp_path)
    import pandas as pd
    table = pd.read_csv(path)
    assert len(table) == len(census.taken) and set(table["role"]) == {"input", "weight", "grad_output"}
    delayed = table[table["step"] == 1]
    assert delayed["history_amax"].notna().all()  # the lag: each operand's amax against its history's


@pytest.mark.parametrize("granularity", ["row", "tile", "block"])
@pytest.mark.parametrize("k_dim", [0, 1])
def test_census_blocks_are_the_quantizer_s_scaling_blocks(granularity, k_dim):
    """One scale per census block (above) and, with current E4M3 scales (not powers of two: random data gives every
    block its own), a different scale in nearly every block: a census block half a scaling block would share it."""
    x = torch.randn(384, 512, generator=torch.Generator().manual_seed(6))
    fmt = OperandFormat("e4m3", granularity)
    q = quantize(x, fmt, k_dim, stats=True)
    ratio = torch.where(q.elements != 0, q.values / q.elements, torch.zeros_like(x))  # 1 / the element's scale
    per_block = _blocks(ratio, k_dim, granularity).amax(1)
    distinct = len(torch.unique(per_block.float()))
    assert distinct >= 0.9 * len(per_block)


def test_an_all_zero_row_without_an_amax_floor_is_counted_non_finite():
    """pytorch/ao#3356: rowwise scales without a lower bound on the amax give an all-zero row an infinite scale and
    NaN values; with torchao's EPS the row stays zero."""
    x = operand(7)
    for floor, bad in ((1e-12, 0), (0.0, x.shape[1])):
        fmt = OperandFormat("e4m3", "row", "pow2", amax_floor=floor)
        q = quantize(x, fmt, 1, stats=True)
        got = dict(zip(NUMBERS, operand_stats(x, q, fmt, 1).tolist()))
        assert got["zero_blocks"] == 1 and got["nonfinite"] == bad


def test_an_evaluation_forward_on_a_census_step_is_not_counted():
    """A forward without gradients (an evaluation between steps) is not the step's: no census rows from it."""
    model = gpt("fp8-current")
    census = Fp8Census(model, every=1)
    census.begin_step(0)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16)))
    assert not census.rows.pending
    census.end_step()
    assert census.taken == []


def test_replay_history_keys_keep_numeric_layer_names(tmp_path):
    """nn.Sequential names its layers "0", "1": the replay's delayed history must find them by those names (a CSV
    reader that made them integers gave every delayed recipe an empty history: scale 1)."""
    import pandas as pd

    from lab.fp8.replay import _histories
    rows = [{"step": s, "layer": "0", "role": "input", "amax": a} for s, a in ((0, 2.0), (5, 3.0), (10, 1.0))]
    pd.DataFrame(rows).to_csv(tmp_path / "fp8_census.csv", index=False)
    got = _histories(tmp_path, 10)
    assert float(got[("0", "input")]) == 3.0


def test_a_layer_s_counts_are_its_census_rows_summed():
    """The run's saturated and flushed shares (lab/fp8/state.py metrics) add up each layer's census rows per tensor
    kind (taken from the rows, not counted twice): without a scale E4M3 flushes small gradients, so the kinds'
    saturated and flushed counts differ and a mix-up of the two shows."""
    from lab.fp8.census import KIND
    from lab.fp8.linear import KINDS, recipe_layers
    model = gpt("fp8-noscale")
    census = Fp8Census(model, every=1)
    train_steps(model, census, steps=2)
    checked = 0
    for layer in recipe_layers(model):
        for i, kind in enumerate(KINDS):
            rows = [r for r in census.taken if r["layer"] == layer.lab_name and KIND[r["role"]] == kind]
            want = [sum(int(r[c]) for r in rows) for c in ("saturated", "flushed", "nonzero", "numel")]
            assert layer.counts[i].tolist() == want, (layer.lab_name, kind)
            checked += want[0] != want[1]
    assert checked > 0
