"""Loss-Scale Lab: measure what each FP16 loss-scaling policy costs.

The public API (docs/api.md); every other module is internal and may move::

    lab.scaling.create(name, **params)   a GradScaler-compatible loss scaler running policy `name`
    lab.scaling.LossScaler               the scaler's class (the engine every policy runs in)
    lab.scaling.ScalingPolicy            the base class of a policy
    lab.scaling.register(name)           class decorator: register a ScalingPolicy under `name`
    lab.scaling.available()              the registered policies' names
    lab.diagnose(run_dir)                a run directory's Diagnosis (also lab.diagnose.diagnose; with
                                         lab.diagnose.format_text, format_json and Diagnosis)
    lab.replay(run_dir, policies=None)   every (or each given) policy replayed over a recorded run
    lab.record(model, scaler, out=...)   record your own training loop into a lab run directory
    lab.autocast(device, dtype)          the FP16/BF16 forward context: torch.autocast, plus on a CPU the lab's
                                         tensor-core contract (the numbers a GPU's tensor cores compute)
    lab.checkpoint(fn, *args)            gradient checkpointing recomputed under the forward's precision (the
                                         contract, FP8 recipe state): the gradients without checkpointing
    lab.integrations.lightning / .hf     Lightning, Fabric, accelerate, the transformers Trainer: one line each
    lab.fp8.create_recipe / .convert     FP8 and block-scaled recipes (emulated exactly on a CPU) for your model
    lab.models.qat.prepare               quantization-aware training: torchao's fake quantizers on your linears
    lab.models.nf4.quantize_nf4          a QLoRA base: your model's linears as frozen NF4 weights (NF4Linear)
    lab.load_metrics(source, ...)        the runs' metrics.json files as one DataFrame
    lab.load_steps(source, ...)          their steps.csv files
    lab.load_census(source, ...)         their census.csv files
    lab.__version__                      the lab's version

Each name is imported on first use (a module ``__getattr__``), so ``import lab`` stays light.

The packages, lowest layer first; a package imports (at module level) only from its own layer or below, and
no two packages import each other (tests/test_public_api.py checks both):

    core/                              files (atomic writes, provenance), config (+ schemas/), lock
    numerics/ scaling/ models/ data/   FP16 facts and the census; the loss scaler; model presets; data sets
    run/ study/ rl/                    one training run; a study's summary table, statistics and claims; RL's
                                       sampler and learner paths and their mismatch
    report/ diagnose/ integrations/    results loaded, derived tables, figures; a run's diagnosis; frameworks
    cli.py (+ __main__.py), commands/  `python -m lab ...`: every command a file in commands/, collected by cli.py
"""

__version__ = "0.1.0"

# public name -> (module, attribute in it; None: the module itself)
_PUBLIC = {
    "scaling": ("lab.scaling", None),
    "diagnose": ("lab.diagnose", None),  # a package that is also callable: lab.diagnose(run_dir)
    "replay": ("lab.diagnose.replay", "replay_run"),
    "record": ("lab.run.record", "record"),
    "autocast": ("lab.numerics.precision", "autocast"),
    "checkpoint": ("lab.numerics.recompute", "checkpoint"),
    "integrations": ("lab.integrations", None),  # its modules import their framework on first use
    "fp8": ("lab.fp8", None),  # FP8 and block-scaled recipes for your own model: create_recipe, convert
    "models": ("lab.models", None),  # its public modules: qat (prepare), nf4 (quantize_nf4, NF4Linear)
    "load_metrics": ("lab.report.load", "load_metrics"),
    "load_steps": ("lab.report.load", "load_steps"),
    "load_census": ("lab.report.load", "load_census"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    module, attr = _PUBLIC[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
