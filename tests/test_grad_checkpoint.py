"""Gradient checkpointing under the lab's precision (lab/numerics/recompute.py): the recompute inside backward runs
under the forward's CPU tensor-core contract and, for an FP8 recipe layer, with the forward's scales and
stochastic-rounding bits, advancing no recipe state twice. Each run is checked against the same run without
checkpointing: the recompute repeats the forward's operations on the same operands, so losses, gradients and recipe
state are the same bit for bit."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import lab
from lab.fp8 import Gemm, create_recipe
from lab.fp8.linear import convert
from lab.fp8.state import RecipeState
from lab.models.gpt import GPTConfig
from lab.models.presets import create_model

VOCAB, T = 64, 16
DTYPES = [torch.float16, torch.bfloat16]


def tokens(step):
    return torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))


def gpt(dropout=0.0):
    torch.manual_seed(0)
    if dropout:
        return GPTConfig(vocab_size=VOCAB, context=T, n_layer=2, n_head=4, d_model=64, dropout=dropout).build()
    return create_model("gpt-tiny", num_classes=VOCAB, in_chans=0, input_size=T)


def train(model, dtype, steps=3, loss_of=None, state=None):
    """Losses and every step's gradients (SGD steps in between, so later steps see trained weights)."""
    loss_of = loss_of or (lambda m, x: F.cross_entropy(m(x).float().flatten(0, 1), x.flatten()))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(1)  # dropout's draws
    losses, grads = [], []
    for step in range(steps):
        if state is not None:
            state.begin_step(step)
        with lab.autocast("cpu", dtype):
            loss = loss_of(model, tokens(step))
        loss.backward()
        if state is not None:
            state.end_step()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    for step_a, step_b in zip(ga, gb):
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))


def checkpointed(model):
    model.checkpoint_blocks = True
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_tiny_checkpointed_trains_bit_for_bit_as_without(dtype):
    assert_same(train(gpt(), dtype), train(checkpointed(gpt()), dtype))


def test_dropout_draws_the_same_masks_in_the_recompute():
    """Attention and residual dropout: torch restores the global generator for the recompute."""
    assert_same(train(gpt(0.1), torch.float16), train(checkpointed(gpt(0.1)), torch.float16))


def test_torch_checkpoint_alone_recomputes_outside_the_contract():
    """Why: torch.utils.checkpoint restores autocast but not the contract's TorchFunctionMode."""
    def loss_of(m, x):
        h = m.tok(x) + m.pos(torch.arange(T))
        for block in m.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return F.cross_entropy(m.head(m.ln_f(h)).float().flatten(0, 1), x.flatten())
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        train(gpt(), torch.float16, steps=1, loss_of=loss_of)


# --- transformers: a tiny GPT-2 from a config ------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def gpt2(checkpointing=False, patch_first=True, kwargs=None):
    """GPT-2 with its dropouts (0.1); checkpointing enabled by the model's own method, the lab's patch
    (what the adapters do) applied before it or after."""
    from lab.integrations.common import checkpoint_in_precision
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32,
                                                                  n_layer=2, n_head=2, use_cache=False))
    if checkpointing:
        if patch_first:
            checkpoint_in_precision(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        checkpoint_in_precision(model)
    model.train()
    return model


def gpt2_loss(m, x):
    return m(input_ids=x, labels=x).loss


def their_contexts(entered):
    """A context_fn of the user's (selective checkpointing's would be one): kept, entered inside the lab's."""
    def fn():
        entered.append(1)
        return torch.utils.checkpoint.noop_context_fn()
    return fn


@pytest.mark.parametrize("dtype, patch_first, theirs", [(torch.float16, True, False), (torch.bfloat16, False, True)])
def test_hf_gpt2_checkpointed_trains_bit_for_bit_as_without(dtype, patch_first, theirs):
    """Even asked for reentrant checkpointing (which takes no context_fn): the lab's runs non-reentrant."""
    entered = []
    kwargs = {"use_reentrant": True, **({"context_fn": their_contexts(entered)} if theirs else {})}
    with pytest.warns(FutureWarning):  # transformers' gradient_checkpointing_enable is a deprecated alias
        model = gpt2(True, patch_first, kwargs)
    assert model.transformer.gradient_checkpointing
    assert_same(train(gpt2(), dtype, loss_of=gpt2_loss), train(model, dtype, loss_of=gpt2_loss))
    assert len(entered) == (6 if theirs else 0)  # 2 layers x 3 steps


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_hf_trainer_with_gradient_checkpointing_trains_as_without(tmp_path):
    from accelerate.state import AcceleratorState
    from lab.integrations.hf import use_lab_trainer

    def run(checkpointing):
        AcceleratorState._reset_state(True)
        ids = torch.randint(0, VOCAB, (24, T), generator=torch.Generator().manual_seed(2))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, max_steps=3, per_device_train_batch_size=4,
            learning_rate=1e-3, logging_steps=1, report_to=[], disable_tqdm=True, save_strategy="no",
            gradient_checkpointing=checkpointing)
        t = transformers.Trainer(model=gpt2(), args=args, train_dataset=[{"input_ids": r, "labels": r}
                                                                              for r in ids])
        use_lab_trainer(t, "dynamic")
        t.train()
        assert t.model.transformer.gradient_checkpointing == checkpointing
        losses = [h["loss"] for h in t.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in t.model.parameters()]
    try:
        (la, pa), (lb, pb) = run(False), run(True)
    finally:
        AcceleratorState._reset_state(True)
    assert len(la) == 3 and la == lb
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


# --- FP8 and NVFP4 recipes ----------------------------------------------------------------------------------------
def stochastic_forward():
    """nvfp4 with the forward's operands stochastically rounded too: the recompute must draw the forward's bits."""
    r = create_recipe("nvfp4")
    sr = dataclasses.replace(r.forward.a, stochastic=True)
    return dataclasses.replace(r, name="nvfp4-sr-forward", forward=Gemm(sr, dataclasses.replace(r.forward.b,
                                                                                                 stochastic=True)))


RECIPES = {"fp8-current": lambda: create_recipe("fp8-current"), "fp8-delayed": lambda: create_recipe("fp8-delayed"),
           "nvfp4": lambda: create_recipe("nvfp4"), "nvfp4-sr-forward": stochastic_forward}


def recipe_run(name, checkpointing):
    recipe = RECIPES[name]()
    model = convert(gpt(), recipe)
    model.checkpoint_blocks = checkpointing
    state = RecipeState(model, recipe, seed=0, census_every=1)
    result = train(model, torch.bfloat16, state=state)
    return result, state.state_dict()


def test_nested_checkpointed_regions_replay_the_recipe_state_once():
    """The blocks checkpointed inside a checkpoint of the whole decoder: recomputes within a recompute."""
    def loss_of(m, x):
        h = lab.checkpoint(m.hidden, m.tok(x))
        return F.cross_entropy(m.head(m.ln_f(h)).float().flatten(0, 1), x.flatten())

    def run(nested):
        recipe = stochastic_forward()
        model = convert(gpt(), recipe)
        model.checkpoint_blocks = nested
        state = RecipeState(model, recipe, seed=0, census_every=1)
        return train(model, torch.bfloat16, loss_of=loss_of if nested else None, state=state), state.state_dict()
    (plain, plain_state), (nested, nested_state) = run(False), run(True)
    assert_same(plain, nested)
    assert torch.equal(plain_state["generator"], nested_state["generator"])
    assert all(torch.equal(plain_state["counts"][k], nested_state["counts"][k]) for k in plain_state["counts"])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_model_checkpointed_trains_as_without_and_advances_its_state_once(name):
    (plain, plain_state), (ckpt, ckpt_state) = recipe_run(name, False), recipe_run(name, True)
    assert_same(plain, ckpt)
    for key in ("histories", "counts"):  # the delayed history pushed once per step, the census counted once
        assert all(torch.equal(plain_state[key][k], ckpt_state[key][k]) for k in plain_state[key])
    assert torch.equal(plain_state["generator"], ckpt_state["generator"])  # as many stochastic bits drawn
    if name == "fp8-delayed":
        assert any(h.count_nonzero() > 0 for h in plain_state["histories"].values())
    if name.startswith("nvfp4"):
        assert not torch.equal(plain_state["generator"], torch.Generator().manual_seed(17).get_state())


def test_checkpointing_reaches_the_gpt_inside_a_lora_wrapper():
    """train.gradient_checkpointing on a LoRA fine-tune: the flag is set on the GPT that peft wraps (its attribute
    reads pass through peft's wrapper, its writes would not), so each block's forward runs again in backward."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from lab.models.gpt import checkpoint_target
    model = get_peft_model(gpt(), LoraConfig(r=4, target_modules=["qkv"]))
    checkpoint_target(model).checkpoint_blocks = True
    calls = []
    # a pre-hook: the recompute may stop early, once it has what backward needs, before a forward hook would run
    checkpoint_target(model).blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    model(tokens(0)).float().sum().backward()
    assert len(calls) == 2  # the forward, and its recompute in backward
    assert checkpoint_target(create_model("resnet50-digits", num_classes=10, in_chans=1, input_size=16)) is None
