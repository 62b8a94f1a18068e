"""Device memory of a study's runs, sized on the CPU without weights, data or a GPU.

Each run's model is built under torch's FakeTensorMode (tensors with shapes and dtypes, no storage) and LiveBytes
(what torch's MemTracker counts, without its per-module account) follows what one training step and one evaluation
batch hold at their peak: parameters, gradients,
optimizer state, the activations saved for backward, temporaries, and the evaluation's logits with their FP32 copy
and log-softmax (lab/run/evaluation.py score_batch, the code the run executes). The forward runs under CPU autocast
in the mode's dtype, casting the ops CUDA autocast casts. What it leaves out: the CUDA context and cuBLAS/cuDNN
workspaces and the caching allocator's fragmentation, so a run fits when its sized peak is at most FIT of the GPU's
memory.

Tracing runs autograd on fake tensors, which starts autograd's device threads: a process that forks after it
cannot run a backward in the child (PyTorch's "Autograd and Fork"). Size in a process of its own (`report` in a
subprocess, as tests/test_sizing.py does), never in one that forks training runs.

A sharded run (processes_per_run > 1) is sized per rank with the whole model on each rank: an upper bound.
A LoRA fine-tune of a Hugging Face folder is sized as the lab's model of the same shape trained whole (the folder
is not read): an upper bound too.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lab.core.run_checks import data_shape
from lab.numerics.precision import DTYPES
from lab.run.evaluation import eval_batch_size, score_batch

#: the share of a GPU's memory a run's sized peak may take: the rest for the CUDA context, workspaces, fragmentation
FIT = 0.8
#: a CPU study's runs (two at a time on a 16 GiB laptop): tensor memory per run
CPU_BUDGET_GIB = 6.0
#: the stand-in for a model read from a local Hugging Face folder (finetune.base_model)
HF_STAND_IN = {"hf-causal-lm": "gpt2-small"}


@dataclass(frozen=True)
class RunSize:
    family: str
    mode: str
    train_gib: float     # one training step (the optimizer's state already there), per rank
    eval_gib: float      # one evaluation batch, with the training state still held
    eval_batch: int
    micro_batch: int     # examples per rank per backward
    note: str = ""

    @property
    def peak_gib(self) -> float:
        return max(self.train_gib, self.eval_gib)


def target(study: dict) -> tuple[str, float]:
    """(what the runs must fit, in GiB): the config's named GPU at FIT of its memory, or the CPU budget."""
    gpu = study.get("gpu")
    if gpu:
        return gpu["name"], FIT * float(gpu["memory_gib"])
    return "a CPU run", CPU_BUDGET_GIB


def load_for_sizing(path) -> tuple[dict, dict]:
    """(the validated study, each family's data_shape) of a config file whose data may not be on this machine:
    its local data folders are replaced by stand-ins of the same shape (digits at the image size, pydoc at the
    context and vocabulary), a Hugging Face base_model folder by the lab's model of its shape."""
    import yaml

    from lab.core.config import DATA_DEFAULTS, validate_study
    from lab.core.study import deep_merge
    study = yaml.safe_load(open(path).read())
    base = deep_merge(DATA_DEFAULTS, study["data"])
    shapes = {}
    for family, spec in study["models"].items():
        data = deep_merge(base, spec.get("data") or {})
        shapes[family] = data_shape(data)
        task, _, _, size = shapes[family]
        stand_in = {"name": "pydoc", "context": size, "vocab_size": data["vocab_size"]} if task == "lm" \
            else {"name": "digits-vqa" if task == "vqa" else "digits", "image_size": size}
        spec["data"] = stand_in
        if (spec.get("finetune") or {}).get("base_model"):
            spec["preset"] = HF_STAND_IN.get(spec["preset"], spec["preset"])
            spec.pop("finetune")
    study["data"] = {"name": "digits"}
    return validate_study(study), shapes


@contextlib.contextmanager
def _host_linspace():
    """torch.linspace computed for real inside FakeTensorMode: timm reads its drop-path schedule back as floats
    (``.item()``) while it builds a ViT, which a fake tensor cannot answer. Only for building a model."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    real = torch.linspace

    def linspace(*args, **kwargs):  # its values as 0-d tensors that fake mode keeps as constants
        with unset_fake_temporarily():
            values = real(*args, **{**kwargs, "device": "cpu"}).tolist()
        return [torch.tensor(v) for v in values]
    torch.linspace = linspace
    try:
        yield
    finally:
        torch.linspace = real


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storage alive while it is on, and their peak: each storage counted once, from the op
    that made it (or from the start, for ``held``: parameters, optimizer state) until it is freed (a weak
    reference on the storage). On fake tensors it equals torch's MemTracker (tests/test_sizing.py) at a quarter
    of the time: it keeps no per-module account."""

    def __init__(self, held=()):
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary
        self.live = self.peak = 0
        self.seen = WeakIdKeyDictionary()
        for t in held:
            self._track(t)

    def _free(self, n: int) -> None:
        self.live -= n

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage in self.seen:
            return
        self.seen[storage] = n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


def _held(model, optimizer) -> list:
    return [*model.parameters(), *model.buffers(),
            *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]


def _traced_peak_gib(model, optimizer, fn) -> float:
    with LiveBytes(_held(model, optimizer)) as live:
        fn()
    return live.peak / 2**30


def size_run(cfg, study: dict, shape: tuple | None = None, eval_batch: int | None = None) -> RunSize:
    """The training step's and the evaluation's peak memory of one resolved run (lab.core.config.resolve_run);
    ``shape``: its data_shape where the run's data is a stand-in (load_for_sizing)."""
    shape = shape or data_shape(dataclasses.asdict(cfg.data))
    world = int(study.get("processes_per_run", 1))
    n_eval = eval_batch or eval_batch_size(shape[0], shape[1], shape[3], cfg.train.batch_size)
    key = (cfg.model.preset, shape, cfg.mode.precision, cfg.train.batch_size, world, n_eval, cfg.train.optimizer)
    if key not in _SIZED:  # configs share runs of one shape (imagenet.yaml and imagenet-1day.yaml)
        _SIZED[key] = _size(cfg, shape, world, n_eval)
    return dataclasses.replace(_SIZED[key], family=cfg.model.family, mode=cfg.mode.name)


_SIZED: dict = {}


def _size(cfg, shape: tuple, world: int, n_eval: int) -> RunSize:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lab.models.presets import create_model
    from lab.run.optim import build_optimizer, param_groups
    task, classes, chans, size = shape
    t, precision = cfg.train, cfg.mode.precision
    micro = max(1, t.batch_size // world)
    preset = HF_STAND_IN.get(cfg.model.preset, cfg.model.preset)
    note = f"sized as {preset} trained whole" if preset != cfg.model.preset else ""
    if world > 1:
        note = "; ".join(filter(None, [note, f"per rank of {world}, the whole model on each"]))

    def forward_context():
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=DTYPES[precision])

    def batch(n):
        if task == "lm":
            x = torch.randint(0, classes, (n, size))
            return x, torch.randint(0, classes, (n, size))
        if task == "vqa":
            from lab.data.vqa import QUESTION_LEN
            x = torch.cat([torch.randn(n, chans * size * size), torch.randint(0, classes, (n, QUESTION_LEN)).float()], 1)
            return x, torch.randint(0, classes, (n,))
        return torch.randn(n, chans, size, size), torch.randint(0, classes, (n,))

    with FakeTensorMode(allow_non_fake_inputs=True):
        with _host_linspace():
            model = create_model(preset, num_classes=classes, in_chans=chans, input_size=size)
        optimizer = build_optimizer(cfg, param_groups(cfg, model))
        x, y = batch(micro)

        def train_step():
            with forward_context():
                logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            (loss * 1024.0).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for p in model.parameters():  # the optimizer's state, made by one step on zero gradients
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train = _traced_peak_gib(model, optimizer, train_step)
        xe, ye = batch(n_eval)

        def evaluation():
            with torch.no_grad():
                model.eval()
                score_batch(model, xe, ye, forward_context())
                model.train()

        evaluate = _traced_peak_gib(model, optimizer, evaluation)
    return RunSize(cfg.model.family, cfg.mode.name, train, evaluate, n_eval, micro, note)


def size_study(study: dict, shapes: dict | None = None, eval_batch: int | None = None) -> list[RunSize]:
    """Every (family, precision width) of a validated study, sized (the modes of one precision hold the same
    tensors, and fp16's the same bytes as bf16's); ``shapes``: each family's data_shape (load_for_sizing)."""
    from lab.core.config import resolve_run
    from lab.core.study import family_modes, family_seeds
    sizes, seen = [], set()
    for family in study["models"]:
        for mode in family_modes(study, family):
            cfg = resolve_run(study, family, mode, family_seeds(study, family)[0])
            width = cfg.mode.precision == "fp32"
            if (family, width) not in seen:
                seen.add((family, width))
                sizes.append(size_run(cfg, study, (shapes or {}).get(family), eval_batch))
    return sizes


def report(paths, eval_batch: int | None = None) -> dict:
    """{config file: {"target": (device, usable GiB), "sizes": [RunSize as a dict]}} for each of ``paths``;
    ``eval_batch``: an evaluation batch to size instead of eval_batch_size's (what a batch of before would need)."""
    out = {}
    for path in paths:
        study, shapes = load_for_sizing(path)
        out[str(path)] = {"target": target(study), "families": sorted(study["models"]), "shapes": shapes,
                          "sizes": [dataclasses.asdict(s) for s in size_study(study, shapes, eval_batch)]}
    return out
