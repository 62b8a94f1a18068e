"""Amax predictors (lab/scaling/predictors): TE's two rules as TE computes them, the statistics against an FP64
reference, the learned quantile model against a synthetic history whose next amax is known, the settings' checks, and
their use by FP16's amax-predicted policy and FP8's delayed recipe."""
import functools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.stats import norm

import lab.scaling
from lab.core.errors import ConfigError
from lab.diagnose.replay import read_run, replay
from lab.scaling.learning.features import features, windows
from lab.scaling.learning.fit import quantile_fit, samples
from lab.scaling.predictors import HISTORIES as HISTORY_KINDS, available_predictors, create_predictor
from test_replay import write_run


def history(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_te_rules_are_the_history_max_and_its_latest_entry():
    h = torch.tensor([[0.5, 2.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(create_predictor("max")(h), torch.tensor([2.0, 0.0]))  # an empty history: 0 (TE's scale 1)
    assert torch.equal(create_predictor("most_recent")(h), torch.tensor([0.5, 0.0]))
    h2 = torch.tensor([float("nan"), 1.0])
    assert float(create_predictor("max")(h2)) == 1.0  # TE's fmaxf passes over a NaN amax (delayed_scaling.cu)
    # an inf amax makes TE's maximum inf: no new scale while it is in the window (0: the caller keeps its scale)
    h3 = torch.tensor([[0.5, math.inf, 1.0], [0.5, 2.0, 1.0]])
    assert torch.equal(create_predictor("max")(h3), torch.tensor([0.0, 2.0]))
    assert torch.equal(create_predictor("most_recent")(h3), torch.tensor([0.5, 0.5]))


def observed(values):
    """(age, log2 amax) of the observed entries, most recent first: finite and positive."""
    return [(i, math.log2(v)) for i, v in enumerate(values) if math.isfinite(v) and v > 0]


def ema_reference(values, decay, k):
    """FP64 by hand: weights decay^age over the observed entries, most recent first."""
    obs = observed(values)
    w = [decay ** i for i, _ in obs]
    mean = sum(wi * l for wi, (_, l) in zip(w, obs)) / sum(w)
    var = sum(wi * (l - mean) ** 2 for wi, (_, l) in zip(w, obs)) / sum(w)
    return 2 ** (mean + k * math.sqrt(var))


def trend_reference(values, n, k):
    """FP64 by hand: the least-squares line through the n most recent observed entries, at their ages."""
    pts = observed(values)[:n]
    ages, logs = np.array([a for a, _ in pts], float), np.array([l for _, l in pts])
    slope, intercept = np.polyfit(ages, logs, 1)
    resid = logs - (slope * ages + intercept)
    sd = math.sqrt((resid ** 2).sum() / max(len(pts) - 2, 1))
    return 2 ** (intercept + slope * -1.0 + k * sd)


def test_ema_and_trend_equal_their_fp64_reference_and_skip_unobserved_entries():
    """Unobserved: not yet (0 at the old end, as TE's history starts), and 0, inf or NaN anywhere (an all-zero or
    overflowed operand, a frozen layer): trend's line runs through the n latest observed steps, however far back."""
    rng = random.Random(3)
    for i in range(40):
        vals = [2.0 ** rng.uniform(-20, 5) for _ in range(12)] + [0.0] * 4  # the last 4: not observed yet
        if i % 2:  # a run of unobserved steps at the newest end, and single ones inside
            vals = [rng.choice([0.0, math.inf, math.nan]) for _ in range(rng.randint(1, 10))] + vals
            vals[rng.randrange(len(vals))] = rng.choice([0.0, math.inf, math.nan])
        got = create_predictor({"name": "ema", "decay": 0.8, "k": 2.0})(history(*vals))
        assert float(got) == pytest.approx(ema_reference(vals, 0.8, 2.0), rel=1e-12)
        got = create_predictor({"name": "trend", "n": 8, "k": 1.5})(history(*vals))
        assert float(got) == pytest.approx(trend_reference(vals, 8, 1.5), rel=1e-9)


def test_trend_extrapolates_a_steady_fall():
    vals = [2.0 ** (-t) for t in range(8)]  # most recent first: the amax doubles every step
    assert float(create_predictor("trend:k=0")(history(*vals))) == pytest.approx(2.0, rel=1e-12)


def test_predictors_are_batched_over_leading_dimensions():
    torch.manual_seed(0)
    h = torch.exp2(torch.randn(3, 5, 16, dtype=torch.float64) * 4)
    h[1, 2, 6:] = 0.0
    for name in ("max", "most_recent", "ema", "trend"):
        p = create_predictor(name)
        batched = p(h)
        one = torch.stack([torch.stack([p(h[i, j]) for j in range(5)]) for i in range(3)])
        assert torch.allclose(batched, one, rtol=1e-12, atol=0), name


def test_settings_are_checked_with_the_names_allowed():
    with pytest.raises(ConfigError, match="did you mean 'ema'"):
        create_predictor("emma")
    with pytest.raises(ConfigError, match="unknown setting 'kk' .did you mean 'k'"):
        create_predictor({"name": "ema", "kk": 2.0})
    with pytest.raises(ConfigError, match="k must be a real number"):
        create_predictor({"name": "ema", "k": "2"})
    with pytest.raises(ConfigError, match="decay must be in"):
        create_predictor("ema:decay=1.5")
    with pytest.raises(ConfigError, match="n must be an int"):
        create_predictor({"name": "trend", "n": True})
    assert {"max", "most_recent", "ema", "trend", "learned"} <= set(available_predictors())


# --- the learned quantile model ------------------------------------------------------------------------------
def ar_history(n, c, s, gen):
    """log2 amax whose changes follow d[t] = c d[t-1] + N(0, s^2): the q-quantile of the next change given the
    history is c * d[t] + s * Phi^-1(q), known exactly."""
    d, lg = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    e = torch.randn(n, generator=gen, dtype=torch.float64) * s
    for t in range(1, n):
        d[t] = c * d[t - 1] + e[t]
        lg[t] = lg[t - 1] + d[t]
    return torch.exp2(lg - 12.0)


@pytest.mark.parametrize("q", [0.9, 0.99])
def test_learned_fit_recovers_the_known_conditional_quantile(q):
    gen = torch.Generator().manual_seed(7)
    c, s = 0.5, 0.3
    x, y = samples([ar_history(400, c, s, gen) for _ in range(20)])
    beta = quantile_fit(x, y, q)
    # on fresh histories: the prediction against the true quantile (from the raw amaxes, not the features), and
    # how often the next amax exceeds it
    amax, observed, yt = (torch.cat(t) for t in zip(*(windows(ar_history(400, c, s, gen)) for _ in range(10))))
    xt, _ = features(amax, observed)
    xt, yt = xt.numpy(), yt.numpy()
    truth = c * (torch.log2(amax[:, 0]) - torch.log2(amax[:, 1])).numpy() + s * norm.ppf(q)
    pred = xt @ beta
    mature = observed.all(1).numpy()  # a full window
    # 0.01-0.02 binades here; with last_change read two steps back instead of one, 0.05-0.06
    assert np.median(np.abs(pred - truth)[mature]) < 0.04
    exceeded = np.mean(yt[mature] > pred[mature])
    assert abs(exceeded - (1 - q)) < 0.35 * (1 - q) + 0.004


def test_features_are_scale_free_and_masked():
    gen = torch.Generator().manual_seed(1)
    a = torch.exp2(torch.randn(16, generator=gen, dtype=torch.float64))
    seen = torch.ones(16, dtype=torch.bool)
    f1, l1 = features(a, seen)
    f2, l2 = features(a * 2.0 ** 13, seen)
    assert torch.allclose(f1, f2, atol=1e-12) and float(l2 - l1) == pytest.approx(13.0)
    seen[5:] = False
    f3, _ = features(torch.where(seen, a, torch.full_like(a, 123.0)), seen)
    f4, _ = features(a[:5], torch.ones(5, dtype=torch.bool))
    assert torch.allclose(f3, f4, atol=1e-12)  # what sits in unobserved entries changes nothing


# --- FP16: amax-predicted ---------------------------------------------------------------------------------------
def test_amax_predicted_with_max_is_amax_history_step_for_step(tmp_path):
    rng = random.Random(5)
    amax = [2.0 ** rng.uniform(-20, 6) for _ in range(200)]
    record = read_run(write_run(tmp_path / "run", amax))
    a = replay(record, "amax-history", {"history": 8, "margin": 2}, trajectory=True)
    b = replay(record, "amax-predicted", {"predictor": "max", "history": 8, "margin": 2}, trajectory=True)
    assert a["trajectory"] == b["trajectory"] and a["overflow_steps"] > 0


def test_amax_predicted_checks_its_predictor_without_torch_state():
    with pytest.raises(ValueError, match="did you mean 'trend'"):
        lab.scaling.check("amax-predicted", predictor="trnd")
    assert lab.scaling.check("amax-predicted", predictor={"name": "ema", "k": 1.0}).predictor.k == 1.0


def test_learned_model_that_does_not_exist_yet_fails_at_first_use(tmp_path):
    p = create_predictor({"name": "learned", "model": str(tmp_path / "later.json")}, history="fp16")
    with pytest.raises(ConfigError, match="no fitted scale model"):
        p(torch.ones(4))


def test_per_block_scaling_predicts_from_each_blocks_history_most_recent_first():
    from lab.scaling.base import per_tensor_settings
    from lab.scaling.pertensor import PerBlockScaling
    with pytest.raises(ValueError, match="per_tensor.predictor: unknown predictor 'mx'"):
        per_tensor_settings({"predictor": "mx"})
    p = PerBlockScaling(history=4, predictor="most_recent")
    p.maxima = torch.tensor([[1.0, 2.0, 3.0, 4.0], [8.0, 7.0, 6.0, 5.0]])
    p.seen = 6  # the ring's next column is 6 % 4 = 2: the most recent observation sits in column 1
    assert torch.equal(p._predicted(), torch.tensor([2.0, 7.0]))
    p.predictor = create_predictor("trend:k=0")
    p.maxima = torch.exp2(torch.tensor([[3.0, 4.0, 1.0, 2.0]]))  # oldest first from column 2: 1, 2, 3, 4
    p.seen = 2
    assert float(p._predicted()) == pytest.approx(2.0 ** 5)


def test_every_predictor_runs_without_reading_a_value_on_the_host(tmp_path):
    """On the meta device a tensor has no values: a rule that read one back (.item(), float(), a branch on data:
    a host synchronisation on a GPU) fails there. Every registered predictor predicts there."""
    x, y = samples([ar_history(100, 0.5, 0.3, torch.Generator().manual_seed(0))])
    from lab.scaling.learning import artefact
    from lab.scaling.learning.features import FEATURES
    artefact.save({"kind": "quantile-linear", "features": list(FEATURES), "coef": quantile_fit(x, y, 0.9).tolist()},
                  tmp_path / "m.json")
    h = torch.ones(3, 64, device="meta")
    for name in available_predictors():
        spec = {"name": name, "model": str(tmp_path / "m.json")} if name == "learned" else name
        out = create_predictor(spec)(h)
        assert out.shape == (3,) and out.device.type == "meta", name


def test_a_steps_predictions_for_every_layer_at_once_equal_each_layers_own(tmp_path):
    """RecipeState predicts every delayed layer's three roles in one call at a step's start (predict_all); a layer
    then reads its prediction until its role's history changes. The same bits as the layer's own call, for every
    predictor, and a push makes that role's prediction its own call again (a second micro-batch)."""
    import torch.nn as nn
    from lab.fp8 import create_recipe
    from lab.fp8.linear import convert, predict_all, recipe_layers
    x, y = samples([ar_history(100, 0.5, 0.3, torch.Generator().manual_seed(0))])
    from lab.scaling.learning import artefact
    from lab.scaling.learning.features import FEATURES
    artefact.save({"kind": "quantile-linear", "features": list(FEATURES), "coef": quantile_fit(x, y, 0.9).tolist()},
                  tmp_path / "m.json")
    g = torch.Generator().manual_seed(1)
    for name in available_predictors():
        algo = {"name": name, "model": str(tmp_path / "m.json")} if name == "learned" else name
        model = convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)),
                        create_recipe({"name": "fp8-delayed", "history_len": 16, "algorithm": algo}))
        layers = recipe_layers(model)
        for m in layers:
            m.amax_history.copy_(torch.exp2(torch.randn(3, 16, generator=g) * 6))
            m.amax_history[1, 9:] = 0.0
        own = [[m.history_amax(role) for role in ("input", "weight", "grad_output")] for m in layers]
        predict_all(layers)
        for m, expected in zip(layers, own):
            assert [torch.equal(m.history_amax(r), e) for r, e in zip(("input", "weight", "grad_output"),
                                                                      expected)] == [True] * 3, name
        m = layers[0]
        m.push_amax("input", torch.full((4, 32), 1e3))
        assert 0 not in m.fresh and torch.equal(m.history_amax("input"), m.predictor(m.amax_history[0]))


# --- every predictor at the edges of its input -------------------------------------------------------------------
F32 = torch.finfo(torch.float32)
#: what a history may hold, by kind: observed (any binade of FP32's range, its subnormals, next to its largest
#: value) or not (0, inf, NaN, a negative value)
ENTRY_KINDS = ("normal", "subnormal", "huge", "zero", "inf", "nan", "negative")


def entries(kind, count, gen):
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    centre = float(torch.rand((), generator=gen, dtype=torch.float64)) * 240 - 120
    return {"normal": lambda: torch.exp2(centre + 4 * (u - 0.5)),
            "subnormal": lambda: torch.exp2(-149 + 22 * u),  # FP32's subnormals: 2^-149 to 2^-127
            "huge": lambda: F32.max * (1 - u / 2),
            "zero": lambda: torch.zeros(count, dtype=torch.float64),
            "inf": lambda: torch.full((count,), math.inf, dtype=torch.float64),
            "nan": lambda: torch.full((count,), math.nan, dtype=torch.float64),
            "negative": lambda: -torch.exp2(centre + u)}[kind]()


@st.composite
def edge_histories(draw):
    """(histories (rows, length) or (length,), FP32 or FP64): runs of each kind of entry in any order, 1 to 2048
    steps long."""
    length = draw(st.integers(1, 2048))
    rows = draw(st.sampled_from([None, 1, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    out = []
    for _ in range(rows or 1):
        runs = draw(st.lists(st.tuples(st.sampled_from(ENTRY_KINDS), st.integers(1, 2048)), min_size=1, max_size=5))
        values = torch.cat([entries(kind, count, gen) for kind, count in runs])
        out.append(values.repeat(length // len(values) + 1)[:length])
    h = torch.stack(out).to(draw(st.sampled_from([torch.float32, torch.float64])))
    return h if rows else h[0]


@functools.cache
def every_predictor(history):
    """Every registered predictor at its defaults, learned with the lab's committed model for the history kind."""
    return {name: create_predictor(name, history=history) for name in available_predictors()}


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(edge_histories())
def test_every_predictor_is_finite_and_zero_only_where_nothing_was_observed(h):
    """docs/controllers.md's contract, on any history: observed means finite and positive; the prediction has the
    history's leading shape, is finite (never NaN, never inf: at most FP32's largest value), and is 0 exactly where
    nothing was observed (or, for a predictor that ``inf_keeps_scale``, TE's max, where an inf is in the window);
    a history's other unobserved entries, whatever they hold, change nothing."""
    seen = torch.isfinite(h) & (h > 0)
    for kind in HISTORY_KINDS:
        for name, p in every_predictor(kind).items():
            held = torch.isposinf(h) if p.inf_keeps_scale else torch.zeros_like(seen)
            other = torch.where(seen | held, h, torch.full_like(h, math.nan))  # the rest another unobserved value
            out = p(h)
            assert out.shape == h.shape[:-1] and out.dtype == h.dtype, name
            assert torch.isfinite(out).all() and (out <= F32.max).all(), (name, out)
            assert torch.equal(out > 0, seen.any(-1) & ~held.any(-1)) and (out >= 0).all(), (name, out)
            assert torch.equal(p(other), out), name


def learned_reference(values, coef):
    """The learned rule in FP64 by hand on a fully observed history (most recent first): the next log2 amax is the
    last one plus coef . (1, last change, above the mean of 4 and of 16, below the max of 16, their spread, the
    largest step of 16, 1/count) over the 16 latest steps (docs/controllers.md)."""
    logs = [math.log2(v) for v in values[:16]]
    last, n = logs[0], len(logs)
    mean4, mean16 = sum(logs[:4]) / min(n, 4), sum(logs) / n
    x = [1.0, last - logs[1] if n > 1 else 0.0, last - mean4, last - mean16, max(logs) - last,
         math.sqrt(sum((lg - mean16) ** 2 for lg in logs) / n),
         max([abs(a - b) for a, b in zip(logs, logs[1:])], default=0.0), 1.0 / n]
    return 2.0 ** (last + sum(c * f for c, f in zip(coef, x)))


@pytest.mark.parametrize("kind", HISTORY_KINDS)
def test_the_committed_learned_models_predict_their_rule_on_fully_observed_histories(kind):
    """The lab's committed models (results/controllers/models/learned-*.json) on fully observed histories of any
    length: the rule they were fitted as, in FP64; reading past unobserved steps changes nothing here."""
    from lab.scaling.learning import artefact
    p = create_predictor("learned", history=kind)
    coef = artefact.load("auto", f"learned-{kind}", "quantile-linear")["coef"]
    rng = random.Random(11)
    for n in (1, 2, 3, 5, 16, 17, 100):
        values = [2.0 ** rng.gauss(-12, 3) for _ in range(n)]
        assert float(p(history(*values))) == pytest.approx(learned_reference(values, coef), rel=1e-12), n


@pytest.mark.parametrize("kind", HISTORY_KINDS)
def test_the_learned_predictor_reads_past_unobserved_latest_steps(kind):
    """A step of amax 0, inf or NaN (an all-zero FP8 operand, a frozen layer, an overflow) after 64 steps near
    2^-10: the prediction is the one from the step before it, near 2^-10 (it once read the unobserved step as
    log2 1 = 0 and predicted up to 8 binades off)."""
    p = create_predictor("learned", history=kind)
    gen = torch.Generator().manual_seed(4)
    steady = torch.exp2(-10 + 0.1 * torch.randn(64, generator=gen, dtype=torch.float64))
    for gap in ([0.0], [math.inf], [math.nan, 0.0, math.inf]):
        got = p(torch.cat([history(*gap), steady]))
        assert torch.equal(got, p(steady)) and abs(math.log2(float(got)) + 10) < 2, (gap, float(got))
