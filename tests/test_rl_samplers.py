"""Quantized samplers (lab/rl/samplers, applied at lab/rl/paths.py's points) against FP64 references.

A random one-block GPT of the lab's (width 64: whole MX and NVFP4 blocks, one short 1x128 tile). What is asserted:
each quantized linear inside the sampler's forward equals the FP64 product of its operands quantized by lab/formats'
quantizer on the declaration's spec (the weight from the model's own parameter), within FP32 accumulation's bound;
the FP32 head within the same bound; the FP32-master and 16-bit-copy sources differ exactly where the FP64 MX
reference says the 16-bit rounding moves a weight across a rounding boundary; the KV cache holds K and V at the
scale its rule gives (fixed, current, a predictor), as the FP64 E4M3 reference rounds them; a quantization of
nothing gives the plain path's bits; the integer quantizer keeps its stated rule.
"""
import pytest
import torch

from lab.core.errors import ConfigError
from lab.formats import IntFormat, quantize
from lab.formats.reference import ref_cast, ref_mx
from lab.models.gpt import GPTConfig
from lab.rl import paths, samplers
from lab.rl.grpo import GRPOConfig, grpo_step
from lab.rl.grpo_study import parse_modes

U32 = torch.finfo(torch.float32).eps / 2  # FP32's unit roundoff
FORMATS = [n for n in samplers.available() if n != "none"]


def gamma(k: int) -> float:
    """The bound on a k-term FP32 dot product's relative error (Higham's gamma_k), one more for the bias add."""
    return (k + 1) * U32 / (1 - (k + 1) * U32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPTConfig(vocab_size=48, context=24, n_layer=1, n_head=4, d_model=64).build().eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 48, (4, 8), generator=torch.Generator().manual_seed(1))


def spy(monkeypatch, name):
    calls, real = [], getattr(paths, name)

    def wrapped(*args, **kw):
        out = real(*args, **kw)
        calls.append((args, kw, out))
        return out
    monkeypatch.setattr(paths, name, wrapped)
    return calls


@pytest.mark.parametrize("name", FORMATS)
def test_each_quantized_linear_is_the_fp64_product_of_its_quantized_operands(model, prompt, name, monkeypatch):
    rd = samplers.sampler_path({"path": "fp32", "quant": name})
    q = rd.quant
    calls = spy(monkeypatch, "_linear")
    with torch.no_grad():
        paths.sample(model, prompt, 4, rd, torch.Generator().manual_seed(2))
    weights = dict(model.named_parameters(remove_duplicate=False))
    quantized = [(a, kw, out) for a, kw, out in calls if kw.get("quantized")]
    assert len(quantized) == 4 * 4  # the block's 4 linears in each of 4 forwards (the prefill, 3 decode steps)
    moved = 0
    for i, (args, kw, out) in enumerate(quantized):
        x, pname = args[1], "blocks.0." + paths.QUANTIZED[i % 4]  # called in the block's order
        w = quantize(weights[pname].detach(), q.weights, 1).values.double()  # from the FP32 master, on its spec
        xq = (quantize(x, q.activations, -1).values if q.activations is not None else x).double()
        b = args[3].double()
        exact = xq @ w.t() + b
        bound = gamma(x.shape[-1]) * (xq.abs() @ w.abs().t() + b.abs())
        assert ((out.double() - exact).abs() <= bound).all(), (name, pname)
        plain = x.double() @ weights[pname].detach().double().t() + b
        moved += int(((plain - exact).abs() > bound).sum())
    assert moved > 0  # the quantization changed the products: a path that skipped it fails the bound above


def test_the_fp32_head_is_the_fp64_product_and_the_16_bit_one_rounds(model, prompt, monkeypatch):
    norms = spy(monkeypatch, "_norm")
    tokens = torch.cat([prompt, prompt[:, :2]], dim=1)
    for head_fp32 in (True, False):
        norms.clear()
        rd = samplers.sampler_path({"path": "bf16", "quant": "none", "head_fp32": head_fp32})
        with torch.no_grad():
            logits = paths.forward(model, tokens, rd)
        h = norms[-1][2].double()  # ln_f's output as the bf16 path holds it
        w = model.head.weight.detach().double()
        exact = h @ w.t()
        within = ((logits.double() - exact).abs() <= gamma(h.shape[-1]) * (h.abs() @ w.abs().t())).all()
        assert bool(within) == head_fp32
        assert torch.equal(logits, logits.bfloat16().float()) == (not head_fp32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_master_and_the_16_bit_copy_differ_exactly_where_the_rounding_crosses_a_boundary(model, fmt):
    held = {src: paths.hold(model, samplers.sampler_path({"path": fmt, "quant": "mxfp8", "source": src}))
            for src in ("master", "copy")}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    differ = total = 0
    for name, p in model.named_parameters():
        if not name.endswith(paths.QUANTIZED):
            continue
        w64 = p.detach().double()
        crossed = ref_mx(w64, 1, "e4m3").values != ref_mx(p.detach().to(dtype).double(), 1, "e4m3").values
        got = held["master"][name] != held["copy"][name]
        assert torch.equal(got, crossed), name
        assert torch.equal(held["master"][name].double(), ref_mx(w64, 1, "e4m3").values)
        differ, total = differ + int(got.sum()), total + got.numel()
    assert 0 < differ < total  # some weights cross, most do not


def kv_reference(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """K or V in FP8 E4M3 at the scale of ``amax`` (FP32 448 / amax), by the FP64 reference of the format: the
    product x * scale and the dequantizing division each one FP32 operation (an FP64 result rounded once)."""
    scale = (448.0 / amax.double()).float().double()
    return (ref_cast((t.double() * scale).float().double(), "e4m3") / scale).float().double()


def prefill_amax(model, prompt, rd):
    """Each layer's K and V amax over the prompt's prefill along ``rd`` with its cache unquantized."""
    import dataclasses
    cache = []
    with torch.no_grad():
        paths.forward(model, prompt, dataclasses.replace(rd, kv_scales=None), cache)
    return torch.stack([torch.stack([k.abs().amax(), v.abs().amax()]) for k, v in cache])


@pytest.mark.parametrize("rule", ["fixed", "current", {"predictor": "max"}])
def test_the_kv_cache_scale_is_fixed_recalibrated_or_predicted_each_policy_update(model, prompt, rule, monkeypatch):
    rd = samplers.sampler_path({"path": "bf16", "quant": "fp8-row", "kv": rule})
    read = spy(monkeypatch, "_attention")
    m, seen = model, []
    for step in range(3):  # three policy updates, the qkv weights doubled before each: K and V's amax with them
        seen.append(prefill_amax(m, prompt, rd))
        read.clear()
        with torch.no_grad():
            paths.sample(m, prompt, 2, rd, torch.Generator().manual_seed(3))
        stored = [args for args, _, _ in read if args[0].kv_scales is not None]  # not the calibration's prefill
        assert len(stored) == 2
        for args in stored:  # the attention read K and V as stored: already on E4M3's grid at this scale
            for j, t in enumerate(args[2:4]):
                assert torch.equal(t.double(), kv_reference(t, rd.kv_scales.amax[0, j]))
        expect = {"fixed": seen[0], "current": seen[-1]}.get(rule if isinstance(rule, str) else "predictor")
        if expect is None:  # the max of the earlier rollouts' calibrations; the first rollout its own
            expect = seen[0] if step == 0 else torch.stack(seen[:-1]).amax(0)
        assert torch.equal(rd.kv_scales.amax, expect), (rule, step)
        nxt = GPTConfig(vocab_size=48, context=24, n_layer=1, n_head=4, d_model=64).build().eval()
        nxt.load_state_dict(m.state_dict())
        with torch.no_grad():
            nxt.blocks[0].attn.qkv.weight.mul_(2)
        m = nxt
    assert not torch.equal(seen[0], seen[1])  # the calibrations moved: the rules were told apart


def test_the_kv_store_is_the_fp64_e4m3_rounding_and_a_stale_fixed_scale_saturates():
    kv = samplers.KVScales("fixed")
    kv.calibrate(torch.tensor([[1.0, 2.0]]))
    k, v = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(4)).mul(3).unbind(0)
    sk, sv = kv.store(0, k, v)
    assert torch.equal(sk.double(), kv_reference(k, torch.tensor(1.0)))
    assert torch.equal(sv.double(), kv_reference(v, torch.tensor(2.0)))
    assert sk.abs().max() <= 1.0 < k.abs().max()  # K beyond the calibrated amax saturates at E4M3's max
    kv.calibrate(torch.tensor([[8.0, 8.0]]))  # fixed: the first calibration stays
    assert torch.equal(kv.amax, torch.tensor([[1.0, 2.0]]))
    cur = samplers.KVScales("current")
    for a in (1.0, 8.0):
        cur.calibrate(torch.tensor([[a, a]]))
    assert torch.equal(cur.store(0, k, v)[0].double(), kv_reference(k, torch.tensor(8.0)))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_a_quantization_of_nothing_gives_the_plain_paths_bits(model, prompt, fmt):
    got = []
    for rd in (paths.engine(fmt), samplers.sampler_path({"path": fmt, "quant": "none"})):
        tokens, mu = paths.sample(model, prompt, 6, rd, torch.Generator().manual_seed(5))
        got.append((tokens, mu, paths.logprobs(model, tokens, prompt.shape[1], rd)))
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("fmt", [IntFormat(8, "row"), IntFormat(4, "group", 32)])
def test_the_integer_quantizer_keeps_its_rule(fmt):
    """Symmetric: scale = amax / ((q_max - q_min) / 2) per row or group (FP64, rounded once to FP32); elements the
    nearest integers to x / scale (within FP32's product by the reciprocal), clipped to the range; values = elements
    x scale."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 3, 6)[:, None]
    q = quantize(x, fmt, 1, stats=True)
    along = 64 if fmt.granularity == "row" else fmt.group
    xg = x.double().view(6, -1, along)
    lo, hi = fmt.q_range
    scale = (xg.abs().amax(-1, keepdim=True) / ((hi - lo) / 2)).float().double()
    e = q.elements.double().view(6, -1, along)
    assert torch.equal(e, e.round()) and e.min() >= lo and e.max() <= hi
    assert ((e - (xg / scale).clamp(lo, hi)).abs() <= 0.5 + 4 * U32 * (xg / scale).abs()).all()
    assert torch.equal(q.values.double().view(6, -1, along), (e * scale).float().double())


def test_sampler_lines_are_checked_in_one_line():
    for line, said in (({"quant": "fp8-blokwise"}, "did you mean"),
                       ({"quant": "w4a16:group=0"}, "group"),
                       ({"quant": "fp8-row", "kv": "sometimes"}, "kv must be null"),
                       ({"quant": "fp8-row", "kv": {"predictor": "nonesuch"}}, "unknown predictor"),
                       ({"path": "fp32", "quant": "fp8-row", "source": "copy"}, "path fp32 has none"),
                       ({"quant": "fp8-row", "head": True}, "unknown sampler key")):
        with pytest.raises(ConfigError, match=said):
            samplers.sampler_path(line)
    modes = parse_modes({"q": {"sampler": {"path": "bf16", "quant": "fp8-blockwise", "kv": "current",
                                           "head_fp32": True}}}, "rl.yaml")
    assert modes["q"].sampler["quant"] == "fp8-blockwise"


def test_a_new_declaration_is_one_registered_function():
    from lab.formats import OperandFormat

    @samplers.register_sampler("test-e5m2-row")
    def e5m2_row() -> samplers.Quantization:
        fmt = OperandFormat("e5m2", "row")
        return samplers.Quantization("test-e5m2-row", weights=fmt, activations=fmt)
    try:
        rd = samplers.sampler_path({"path": "bf16", "quant": "test-e5m2-row"})
        assert rd.quant.weights.element == "e5m2"
    finally:
        del samplers.SAMPLERS["test-e5m2-row"]


def test_grpo_steps_with_a_quantized_sampler_recalibrate_its_kv_cache_once_per_step():
    from lab.rl import task
    from lab.rl.grpo_run import base_model
    torch.manual_seed(0)
    model = base_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = GRPOConfig(prompts=2, group=2, sampler={"path": "bf16", "quant": "fp8-blockwise", "kv": "current"})
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        out = grpo_step(model, opt, None, cfg, task.problems(2, g), g)
        assert cfg.sampler_path.kv_scales.history.shape[-1] == step + 1
        assert torch.isfinite(torch.tensor(out["mismatch"]["k3"]))
