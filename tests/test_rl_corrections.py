"""The corrections of the sampler/learner mismatch (lab/rl/corrections): TRL's own code on the same log-probs where
TRL has the mode (bit for bit), verl's written formulas in FP64 otherwise (docs/algo/rollout_corr_math.md), the
on-policy identity (a sampler whose log-probs are the learner's: every weight exactly 1, nothing rejected), the
sum-against-mean closed form (trl#5815) and the top-p/top-k renormalisation bias (trl#6789), and GRPO's loss with
them."""
import math

import pytest
import torch

from lab.core.errors import ConfigError
from lab.rl.corrections import CORRECTIONS, available_corrections, create_correction
from lab.rl.grpo import GRPOConfig, token_loss
from lab.rl.grpo_study import RLMode, mode_settings, parse_modes

EPS = torch.finfo(torch.float32).eps


def batch(n=24, t=12, seed=0):
    """The learner's and the sampler's log-probs of n sampled responses of up to t tokens, row i drifting by
    10^(-4 + 4.3 i / n) per token (from on-policy noise to a sampler far off), and the response mask (lengths 1..t)."""
    g = torch.Generator().manual_seed(seed)
    log_old = -3 * torch.rand(n, t, generator=g)
    spread = 10 ** torch.linspace(-4, 0.3, n)[:, None]
    log_mu = log_old + spread * torch.randn(n, t, generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t  # one full row: TRL pads to the longest
    return log_old, log_mu, torch.arange(t)[None, :] < lengths[:, None]


# verl's written formulas (rollout_corr_math.md, sections 3.3 and 3.5) and the field's, in FP64 from the log-ratios
# d = log pi_old - log mu over a sequence's response tokens T: (the weight of each token, whether it is kept)
def _seq(d, m, mean):
    s = (d * m).sum(-1, keepdim=True)
    return s / m.sum(-1, keepdim=True) if mean else s


REFERENCE = {
    "none": lambda s, d, m: (torch.ones_like(d), torch.ones_like(m, dtype=torch.bool)),
    "token-tis": lambda s, d, m: (torch.minimum(d.exp(), torch.tensor(s["cap"], dtype=d.dtype)),
                                  torch.ones_like(m, dtype=torch.bool)),
    "token-mis": lambda s, d, m: _mis(d.exp(), (d.exp() >= s["low"]) & (d.exp() <= s["high"])),
    "sequence-tis": lambda s, d, m: (torch.minimum(_seq(d, m, s["mean"]).exp(), torch.tensor(s["cap"], dtype=d.dtype))
                                     .expand_as(d), torch.ones_like(m, dtype=torch.bool)),
    "sequence-mis": lambda s, d, m: _mis(_seq(d, m, s["mean"]).exp(), _seq(d, m, s["mean"]).exp() <= s["cap"]),
    "geometric": lambda s, d, m: _mis(torch.ones_like(d), (_seq(d, m, True).exp() >= s["low"])
                                      & (_seq(d, m, True).exp() <= s["high"])),
}
REFERENCE["icepop"] = REFERENCE["token-mis"]


def _mis(rho, keep):
    keep = keep.expand(rho.shape[0], -1) if keep.shape[-1] == 1 else keep
    return torch.where(keep, rho, torch.zeros_like(rho)), keep


def _bound(d, m, level):
    """|weight - reference| / reference, at most: FP32's rounding of d, of the (up to T-term) sum and of exp."""
    terms = (d.abs() * m).sum(-1, keepdim=True) if level == "sequence" else d.abs()
    count = m.sum(-1, keepdim=True) if level == "sequence" else 1
    return EPS * (4 + (count + 2) * terms)


SPECS = [("none", {}), ("token-tis", {"cap": 2.0}), ("token-mis", {"low": 0.5, "high": 5.0}), ("icepop", {}),
         ("sequence-tis", {"cap": 2.0, "mean": False}), ("sequence-tis", {"cap": 1.05, "mean": True}),
         ("sequence-mis", {"cap": 3.0, "mean": False}), ("sequence-mis", {"cap": 1.01, "mean": True}),
         ("geometric", {"low": 0.999, "high": 1.001}), ("geometric", {"low": 0.9, "high": 1.2})]


@pytest.mark.parametrize("name,settings", SPECS)
def test_each_correction_is_verls_written_formula(name, settings):
    """The FP32 weights within FP32's rounding of the FP64 formula; a keep decision where the FP64 statistic is
    clear of the bound by more than that rounding. The batch holds both sides of every bound (asserted)."""
    corr = create_correction({"name": name, **settings})
    full = {**corr.settings(), **settings}
    log_old, log_mu, mask = batch()
    weight, keep = corr(log_old, log_mu, mask)
    d = log_old.double() - log_mu.double()
    m = mask.double()
    ref_w, ref_keep = REFERENCE[name](full, d, m)
    level = "sequence" if name.startswith(("sequence", "geometric")) else "token"
    tol = _bound(d, m, level).expand_as(d)
    close = (weight.double() - ref_w).abs() <= tol * ref_w.abs()  # a rejected token's weight: exactly 0
    # a decision taken on a statistic within its rounding of a bound may go either way in FP32: those are left out
    stat = _seq(d, m, full.get("mean", True)).expand_as(d) if level == "sequence" else d
    bounds = [math.log(full[k]) for k in ("cap", "low", "high") if k in full]
    decided = torch.stack([(stat - b).abs() > tol for b in bounds]).all(0) if bounds else torch.ones_like(mask)
    where = mask & decided
    assert where.sum() >= 0.9 * mask.sum()
    assert torch.all(close[where]) and torch.equal(keep[where], ref_keep.expand_as(mask)[where])
    # both sides of the bound are in the batch: a test of the bound, not of one side
    acted = {"token-tis": ref_w < d.exp(), "sequence-tis": ref_w < stat.exp()}.get(name, ~ref_keep.expand_as(mask))
    assert name == "none" or (acted[mask].any() and (~acted)[mask].any())


@pytest.mark.parametrize("name", available_corrections())
def test_an_fp32_sampler_makes_every_correction_exactly_one(name):
    """Sampler log-probs equal to the learner's (an FP32 sampler on the learner's path): every weight exactly 1,
    nothing rejected, for every registered correction (a user's new one included) at its defaults and the edges of
    its settings' ranges."""
    log_old, _, mask = batch()
    corr = create_correction(name)
    for spec in (name, {"name": name, **{k: 1.0 for k, v in corr.settings().items() if isinstance(v, float)}}):
        weight, keep = create_correction(spec)(log_old, log_old.clone(), mask)
        assert weight.shape == keep.shape == mask.shape
        assert torch.all(weight[mask] == 1.0) and torch.all(keep[mask])


@pytest.mark.parametrize("name", available_corrections())
def test_an_fp32_sampler_leaves_grpos_loss_and_gradient_those_of_no_correction(name):
    """On-policy (mu = pi_old), GRPO's loss and gradient under any correction are the uncorrected ones, bit for bit."""
    log_old, _, mask = batch()
    adv = torch.randn(log_old.shape[0], 1, generator=torch.Generator().manual_seed(1))
    out = {}
    for spec in ("none", name):
        log_pi = log_old.clone().requires_grad_()
        per_token, _, keep = token_loss(log_pi, log_pi.detach(), adv, GRPOConfig(correction=spec), mask)
        (per_token * mask).sum().backward()
        out[spec] = (per_token.detach(), log_pi.grad, keep)
    assert torch.equal(out[name][0], out["none"][0]) and torch.equal(out[name][1], out["none"][1])
    assert torch.all(out[name][2])


def test_sum_against_mean_closed_form():
    """trl#5815 / trl#4772: T = 100 tokens, each at log-ratio d = 3/256 (~0.012, exact in FP32, as are its partial
    sums): the product of the ratios is e^(T d) ~ e^1.17 = 3.2, which sequence-mis at C = 3 rejects whole; the
    per-token mean gives e^d, kept. Each within one exp rounding of the closed form."""
    t, d = 100, 3 / 256
    log_old = -torch.arange(t, dtype=torch.float32)[None] / 1024  # multiples of 2^-10: log_old - d is exact
    log_mu = log_old - d
    mask = torch.ones(1, t, dtype=torch.bool)
    assert torch.all(log_old - log_mu == d)
    prod = create_correction({"name": "sequence-tis", "cap": 1e30})(log_old, log_mu, mask)[0]
    mean = create_correction({"name": "sequence-tis", "cap": 1e30, "mean": True})(log_old, log_mu, mask)[0]
    assert torch.all((prod.double() / math.exp(t * d) - 1).abs() <= 2 * EPS)
    assert torch.all((mean.double() / math.exp(d) - 1).abs() <= 2 * EPS)
    w, keep = create_correction({"name": "sequence-mis", "cap": 3.0})(log_old, log_mu, mask)
    assert not keep.any() and torch.all(w == 0)
    w, keep = create_correction({"name": "sequence-mis", "cap": 3.0, "mean": True})(log_old, log_mu, mask)
    assert keep.all() and torch.equal(w, mean)


def test_sequence_corrections_read_only_the_response_tokens():
    """A token past the response (after the answer's end) changes no sequence's weight."""
    log_old, log_mu, mask = batch()
    moved = torch.where(mask, log_mu, log_mu - 5.0)
    for spec in ("sequence-tis", "sequence-mis", {"name": "sequence-mis", "mean": True}, "geometric"):
        corr = create_correction(spec)
        assert torch.equal(corr(log_old, log_mu, mask)[0][mask], corr(log_old, moved, mask)[0][mask])


@pytest.mark.parametrize("keep_set", ["top-k", "top-p"])
def test_a_renormalising_sampler_biases_every_token_by_log_s(keep_set):
    """trl#6789: a sampler that keeps a set of mass S (top-k 8 or top-p 0.9 of 64 tokens) and renormalises over it,
    and otherwise computes the learner's logits exactly: every kept token's log mu - log pi_old is -log S, so token
    TIS weighs it S (< 1: never truncated), sequence TIS prod_t S_t, and geometric rejection at 0.999 rejects every
    sequence though nothing else differs. Each within FP32's rounding of the FP64 closed form."""
    g = torch.Generator().manual_seed(3)
    n, t, v = 8, 10, 64
    logits = 3 * torch.randn(n, t, v, generator=g)
    p = torch.softmax(logits.double(), -1)
    order = p.argsort(-1, descending=True)
    if keep_set == "top-k":
        kept_sorted = torch.arange(v) < 8
    else:  # the smallest prefix of the sorted tokens whose mass reaches 0.9
        kept_sorted = (p.gather(-1, order).cumsum(-1) - p.gather(-1, order)) < 0.9
    kept = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, kept_sorted.expand_as(p))
    s = (p * kept).sum(-1)  # the kept mass S of each position, FP64
    tokens = torch.multinomial(torch.where(kept, p, 0).view(-1, v), 1, generator=g).view(n, t, 1)
    log_old = torch.log_softmax(logits, -1).gather(-1, tokens)[..., 0]
    log_mu = torch.log_softmax(logits.masked_fill(~kept, -math.inf), -1).gather(-1, tokens)[..., 0]
    mask = torch.ones(n, t, dtype=torch.bool)
    tol = 8 * EPS * (1 + logits.abs().amax())  # two FP32 log-softmaxes of logits this large
    assert torch.all(((log_mu - log_old).double() + s.log()).abs() <= tol)
    w = create_correction("token-tis")(log_old, log_mu, mask)[0]
    assert torch.all((w.double() / s - 1).abs() <= 2 * tol)
    w = create_correction({"name": "sequence-tis", "cap": 1e30})(log_old, log_mu, mask)[0]
    assert torch.all((w.double().log() - s.log().sum(-1, keepdim=True)).abs() <= t * 2 * tol)
    assert s.max() < 0.999 and not create_correction("geometric")(log_old, log_mu, mask)[1].any()


def test_grpo_tis_is_token_tis_bit_for_bit():
    """loss: grpo-tis (tis_cap C) and correction {name: token-tis, cap: C}: the same loss and gradient, bit for bit."""
    log_old, log_mu, mask = batch()
    adv = torch.randn(log_old.shape[0], 1, generator=torch.Generator().manual_seed(1))
    got = []
    for cfg in (GRPOConfig(loss="grpo-tis", tis_cap=1.5), GRPOConfig(correction={"name": "token-tis", "cap": 1.5})):
        log_pi = log_old.clone().requires_grad_()
        per_token, _, _ = token_loss(log_pi, log_mu, adv, cfg, mask)
        (per_token * mask).sum().backward()
        got.append((per_token.detach(), log_pi.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.any(got[0][0] != token_loss(log_old, log_mu, adv, GRPOConfig(loss="grpo-tis"), mask)[0])  # C acts


@pytest.mark.parametrize("name", available_corrections())
def test_every_correction_says_what_it_computes(name):
    """docs/rl.md's table is read from the registrations: a row without its formula, its equivalent or a setting's
    description would be one a user cannot work from."""
    from lab.core.settings import declared_settings, doc
    cls = CORRECTIONS[name]
    assert cls.formula and cls.equivalent and cls.clip_against in ("learner", "sampler")
    assert all(doc(kind) for kind in declared_settings(cls)[0].values())


def test_a_new_correction_is_its_class_and_one_config_line(monkeypatch):
    """What a file in lab/rl/corrections/ holds (a registered class) and a mode's `correction:` line are all a new
    correction needs: the mode validates, GRPO's loss applies its weight, its settings are checked."""
    import lab.rl.corrections as corrections
    from lab.core.settings import Range
    from typing import Annotated
    monkeypatch.setattr(corrections, "CORRECTIONS", dict(CORRECTIONS))

    @corrections.register_correction("scaled")
    class Scaled(corrections.Correction):
        formula, equivalent = "k", "none"

        def __init__(self, k: Annotated[float, Range(gt=0), "the weight"] = 0.5):
            self.k = k

        def weigh(self, log_ratio, mask):
            return torch.full_like(log_ratio, self.k), torch.ones_like(mask)

    modes = parse_modes({"mine": {"sampler": "bf16", "learner": "bf16", "correction": {"name": "scaled", "k": 0.25}}},
                        "rl.yaml")
    assert modes["mine"].loss_kind == "grpo+scaled:k=0.25"
    log_old, log_mu, mask = batch()
    adv = torch.ones(log_old.shape[0], 1)
    ours = token_loss(log_old, log_mu, adv, GRPOConfig(correction=modes["mine"].correction), mask)[0]
    assert torch.all(ours == -0.25)  # the surrogate at pi = pi_old is A = 1; the correction weighs it k
    with pytest.raises(ConfigError, match="k must be > 0"):
        create_correction({"name": "scaled", "k": 0})


def test_a_correction_is_checked_where_it_is_named():
    with pytest.raises(ConfigError, match="unknown correction 'token-tsi'.*token-tis"):
        create_correction("token-tsi")
    with pytest.raises(ConfigError, match="unknown setting 'cpa'.*cap"):
        create_correction({"name": "token-tis", "cpa": 2})
    with pytest.raises(ConfigError, match="cap must be >= 1"):  # a cap below 1 would down-weight on-policy tokens
        create_correction("sequence-mis:cap=0.5")
    with pytest.raises(ConfigError, match="low must be in"):
        create_correction({"name": "geometric", "low": 1.5})
    assert CORRECTIONS["icepop"] is CORRECTIONS["token-mis"] and repr(create_correction("icepop")).startswith("icepop")
    with pytest.raises(ValueError, match="grpo-tis is the token-tis correction already"):
        GRPOConfig(loss="grpo-tis", correction="token-mis")
    with pytest.raises(ConfigError, match="mode m: unknown correction"):
        parse_modes({"m": {"correction": {"name": "nope"}}}, "rl.yaml")
    with pytest.raises(ConfigError, match="mode m: loss grpo-tis is the token-tis correction already"):
        parse_modes({"m": {"loss": "grpo-tis", "correction": "none"}}, "rl.yaml")


def test_a_mode_names_a_correction_and_the_modes_that_do_not_keep_their_runs():
    modes = parse_modes({"tis": {"sampler": "bf16", "learner": "bf16", "loss": "grpo-tis"},
                         "seq": {"sampler": "bf16", "learner": "bf16", "correction": {"name": "sequence-mis"}},
                         "plain": {"correction": "none"}}, "rl.yaml")
    study = {"modes": modes, "train": {"steps": 60}}
    assert [modes[m].loss_kind for m in ("tis", "seq", "plain")] == [
        "grpo-tis", "grpo+sequence-mis:cap=3.0,mean=False", "grpo"]
    # a mode without a correction: the settings text the workflow reruns on is what it was before corrections
    assert mode_settings(study, "tis") == repr(("bf16", "bf16", None, "grpo-tis", (), [("steps", 60)]))
    assert mode_settings(study, "seq").endswith("{'name': 'sequence-mis'})")
    assert RLMode(name="x").correction is None


# TRL's own code: its GRPOTrainer's importance-sampling step, fed the sampler's log-probs as vLLM would give them
TRL_CASES = [("token-tis", {"cap": 2.0}, "token_truncate", None, 2.0),
             ("token-tis", {"cap": 3.0}, "token_truncate", None, 3.0),
             ("token-mis", {"low": 0.5, "high": 5.0}, "token_mask", 0.5, 5.0),
             ("icepop", {}, "token_mask", 0.5, 5.0),
             ("sequence-tis", {"cap": 3.0}, "sequence_truncate", None, 3.0),
             ("sequence-mis", {"cap": 3.0}, "sequence_mask", None, 3.0),
             ("sequence-mis", {"cap": 1.2}, "sequence_mask", None, 1.2)]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """A GRPOTrainer on a tiny GPT-2 whose generation is the given sampler's (tokens and log-probs, as vLLM returns
    them) and whose forward returns the given learner's log-probs: the rest of its scoring step is TRL's own."""
    pytest.importorskip("trl")
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import GRPOConfig as TRLConfig, GRPOTrainer

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", *"0123456789+=; "])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="<eos>")
    AcceleratorState._reset_state(True)
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, report_to=[], disable_tqdm=True,
                     per_device_train_batch_size=24, num_generations=4, max_completion_length=12)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=32, n_embd=8, n_layer=1, n_head=1))
    t = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                    args=args, train_dataset=Dataset.from_list([{"prompt": "1+2="}] * 24), processing_class=tokenizer)
    t.use_vllm = t.vllm_importance_sampling_correction = True  # the vLLM path's correction, without a vLLM server
    yield t
    AcceleratorState._reset_state(True)


def trl_weights(t, log_old, log_mu, mask, mode, clip_min, clip_max):
    """TRL's importance-sampling ratio for these log-probs (B, T) or (B, 1), with its completion mask and the
    sampler's log-probs as it padded them."""
    lengths = mask.sum(-1).tolist()
    n = len(lengths)
    t._generate = lambda prompts: ([[3, 4]] * n, [[5] * k for k in lengths], None, ["1" * k for k in lengths],
                                   [log_mu[i, :k].tolist() for i, k in enumerate(lengths)], None, None, None)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (log_old, None, None)
    t.vllm_importance_sampling_mode = mode
    t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max = clip_min, clip_max
    out = t._generate_and_score_completions([{"prompt": "1+2="}] * n)
    return out["importance_sampling_ratio"], out["completion_mask"].bool(), out["sampling_per_token_logps"]


@pytest.mark.parametrize("name,settings,mode,clip_min,clip_max", TRL_CASES)
def test_each_correction_is_trls_bit_for_bit(trl_trainer, name, settings, mode, clip_min, clip_max):
    log_old, log_mu, mask = batch()
    ratio, trl_mask, trl_mu = trl_weights(trl_trainer, log_old, log_mu, mask, mode, clip_min, clip_max)
    assert torch.equal(trl_mask, mask)
    weight, keep = create_correction({"name": name, **settings})(log_old, trl_mu, trl_mask)
    expected = ratio.expand_as(weight)
    assert torch.equal(weight[mask], expected[mask])
    if mode.endswith("mask"):
        assert torch.equal(keep[mask], expected[mask] != 0)
    # TRL's output holds both sides of its bound: the comparison tests the bound, not one side of it
    acted = (expected == clip_max) | (expected == 0)
    assert acted[mask].any() and (~acted)[mask].any()
