"""One training run: (model family, precision/scaling mode, seed) -> a run directory.

The run directory receives, each written atomically:
  config.yaml      the resolved run configuration
  steps.csv        one row per optimizer step (streamed to steps.csv.partial while training)
  census.csv       FP16 census of activation/parameter gradients every train.census_every steps, and
  grad_hist.csv    their log2 histograms (lab/numerics/census.py; header only when census_every is 0)
  metrics.json     the run's results (also written, with status "failed", if training raises)
  provenance.json  versions, device, git commit, command line, times, config hash
and, while it trains, checkpoint/ (lab/run/checkpoint.py) and .lock (one trainer per run directory); with
recover_finished, .finished/ (lab/run/finished.py: a finished run the workflow has not recorded yet). Under
torchrun the run is distributed (lab/run/distributed.py: rank 0 writes); train.faults plants inf/NaN
(lab/run/faults.py).
"""
from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.core import files, lock
from lab.core.shards import whole
from lab.core.config import RunConfig, import_policy_modules
from lab.core.run_checks import check_run
from lab.core.errors import ConfigError
from lab.formats import kernels
from lab.models.gpt import checkpoint_target
from lab.numerics.contract import FP16_PATH_CONTRACT, FP16_PATH_CUDA
from lab.numerics.adapters import AdapterLog
from lab.scaling.adapters import check_trainable_dtypes
from lab.numerics.monitor import NumericsMonitor
from lab.run import checkpoint, distributed, faults as fault_plan, finished, outcomes, sharding
from lab.run.loop import EpochLoop, clip_groups, forward_backward, replay_step  # noqa: F401 (re-exported)
from lab.run.rundir import STEP_FIELDS, LoopState, RunDirError, StepLog, check_run_dir, resume  # noqa: F401
from lab.run.evaluation import eval_batch_size, flat_cross_entropy, rank_slice
from lab.run.memory import StepMemory, activation_bytes
from lab.run.optim import build_optimizer, build_schedule, check_batches, param_groups
from lab.run.process import (keep_freed_memory, resolve_device, seed_everything, set_deterministic,
                             set_fp32_reductions, set_true_fp32)

log = logging.getLogger("lab.run.train")


def train(cfg: RunConfig, run_dir: str | Path, progress=sys.stderr, recover_finished: bool = False) -> dict:
    """Train one run and write its run directory; returns the metrics dict.

    The data is loaded and the run directory checked before anything is written, so bad input leaves
    nothing behind. ``recover_finished`` (the workflow's train rule): restore run_dir/.finished/ when it
    holds this run finished, instead of training; keep such a copy when the run finishes (lab/run/finished.py)."""
    run_dir = Path(run_dir)
    check_run(cfg)  # what `lab validate` refuses in this run, refused here too, before the run directory is read
    check_run_dir(run_dir, cfg)
    if recover_finished:
        # torchrun: every rank finds the same copy and returns; rank 0 alone writes (as a distributed run does)
        restored = finished.restore(run_dir, cfg.hash(), write=distributed.is_main_process())
        if restored is not None:
            print(f"[{cfg.model.family}/{cfg.mode.name}/seed{cfg.seed}] restored from {run_dir / finished.FOLDER}: "
                  "the run had finished before the workflow could record it", file=progress, flush=True)
            return restored
    bundle = cfg.data.build()
    check_batches(cfg.train, len(bundle.train))
    device = resolve_device(cfg.device)
    d = distributed.from_env(device)  # torchrun: this process's rank; else one process
    try:
        return _train_checked(cfg, run_dir, bundle, d, d.device(device), progress, recover_finished)
    finally:
        d.close()


def _train_checked(cfg: RunConfig, run_dir: Path, bundle, d, device: str, progress, recover_finished: bool) -> dict:
    """train() after the checks that need no model: the rest of the refusals, then the run."""
    distributed.check_batch(cfg.train.batch_size, d.world)
    if not d.is_main:  # one progress stream: rank 0's
        progress = open(os.devnull, "w")
    # a fault that names no module of this model is bad input: refused before anything is written
    faults = fault_plan.check(cfg.train.faults, cfg.train.accum_steps,
                              lambda: cfg.model.build(bundle.num_classes, bundle.in_chans, bundle.input_size),
                              cfg.model.preset, d.world)
    if cfg.model.encoder is not None:  # a pre-trained encoder's weights that are not there: likewise
        from lab.models.multimodal import check_encoder_weights
        check_encoder_weights(cfg.model.encoder["run"])
    if cfg.model.finetune is not None and "base_run" in cfg.model.finetune:  # a base run's weights: likewise
        from lab.models.lora import check_base_weights
        check_base_weights(cfg.model.finetune["base_run"])
    d.gather(None)  # every rank has checked the run directory before rank 0 writes to it
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # one trainer per run directory (two would interleave steps and checkpoints); released on any exit
        lock.hold(run_dir / ".lock", doing=f"another process (pid {{pid}}) is training {run_dir}")
        for stale in ("metrics.json", "steps.csv", "census.csv", "grad_hist.csv"):
            (run_dir / stale).unlink(missing_ok=True)
        shutil.rmtree(run_dir / finished.FOLDER, ignore_errors=True)  # another config's, or an older attempt's
        write_dir = run_dir
    else:  # only rank 0 writes the run directory; the others write their copies here, removed at the end
        write_dir = Path(tempfile.mkdtemp(prefix=f"lab-rank{d.rank}-"))
    try:
        return _train_run(cfg, run_dir, write_dir, bundle, d, device, progress, faults, recover_finished)
    finally:
        if d.is_main:
            lock.release(run_dir / ".lock")
        else:
            shutil.rmtree(write_dir, ignore_errors=True)


def _train_run(cfg: RunConfig, run_dir: Path, write_dir: Path, bundle, d, device: str, progress, faults,
               recover_finished: bool = False) -> dict:
    started = files.now_iso()
    t_start = time.perf_counter()
    import_policy_modules(cfg.policy_modules)
    torch.set_num_threads(cfg.threads)
    files.atomic_write_yaml(write_dir / "config.yaml", cfg.to_dict())
    env = set_true_fp32(device)
    env.update(set_fp32_reductions())
    env.update(keep_freed_memory())
    env.update(set_deterministic(cfg.train.deterministic))
    seed_everything(cfg.seed)

    metrics = {"model": cfg.model.family, "preset": cfg.model.preset, "mode": cfg.mode.name, "seed": cfg.seed,
               "device": device, "device_name": files.device_name(device), "precision": cfg.mode.precision,
               "scaler": (cfg.mode.scaler or {}).get("policy", "none") if cfg.mode.precision == "fp16" else "none",
               "threads": cfg.threads, "config_hash": cfg.hash(), **env, "status": "running"}
    if d.enabled:
        metrics.update(world_size=d.world, batch_per_rank=cfg.train.batch_size // d.world, parallel=cfg.parallel,
                       numerics_view=f"rank 0 of {d.world}" + (" (its shard of each parameter gradient)"
                                                               if cfg.parallel == "fsdp" else ""))
        if cfg.parallel == "fsdp":
            metrics["reduce_dtype"] = cfg.mode.reduce_dtype
        metrics["overflow_decision"] = cfg.mode.overflow_decision
    try:
        metrics.update(_train_loop(cfg, bundle, run_dir, write_dir, device, progress, d, faults))
    except (checkpoint.Interrupted, checkpoint.CheckpointError):
        raise  # not a result: an interrupted run's checkpoint is, and a foreign checkpoint is bad input
    except Exception as exc:
        metrics.update(status="failed", error=f"{type(exc).__name__}: {exc}", wall_s=time.perf_counter() - t_start)
        files.atomic_write_json(write_dir / "metrics.json", metrics)
        raise
    metrics["wall_s"] = time.perf_counter() - t_start
    data = {"data": bundle.provenance} if bundle.provenance else {}  # token files, text corpora: their hashes
    files.atomic_write_json(write_dir / "provenance.json", files.provenance(
        device, cfg.hash(), started, extra={"threads": torch.get_num_threads(), "seed": cfg.seed,
                                                "quantizer_kernels": kernels.provenance(), **data}))
    files.atomic_write_json(write_dir / "metrics.json", metrics)  # last: its presence means the run is complete
    d.gather(None)  # no rank deletes the checkpoint another may still be reading
    if d.is_main:
        if recover_finished:  # before the checkpoint goes: a kill in between resumes from the checkpoint
            finished.keep(run_dir)
        checkpoint.remove(run_dir)  # a finished run needs no checkpoint
    return metrics


def _overflow_split(scaler, steps: int) -> dict:
    """Overflow in two parts: the initial descent (before the run's first clean step: the policy coming down
    from its initial scale) and in training (after it: what probing for a higher scale costs), with the
    in-training rate per 1000 steps and how often the policy raised the scale (its growth attempts)."""
    first_clean = scaler.first_clean_step
    after = steps - first_clean if first_clean is not None else 0
    in_training = scaler.in_training_overflow_steps
    return {"overflow_initial": scaler.initial_overflow_steps, "overflow_in_training": in_training,
            "first_clean_step": first_clean, "steps_after_first_clean": after,
            "overflow_per_1k": 1000.0 * in_training / after if after else None,
            "growth_attempts": scaler.growth_steps,
            # clean steps between growths: DeepSpeed's rules call it scale_window; None: it never grows, or grows by
            # a rule of its own (amax-history), so no overflow horizon can be set (claims)
            "growth_interval": getattr(scaler.policy, "growth_interval", None)
            or getattr(scaler.policy, "scale_window", None)}


def _task_metrics(bundle, t, val_loss: float, world: int = 1) -> dict:
    """What a step holds (samples, or tokens for a language model), a language model's loss units, and the
    backward's magnitude regime: FP16 sees the gradients of a loss averaged over ``tokens_per_backward``
    (samples for an image model; one rank's share under DDP) and divided by ``loss_divisor``
    (accum_steps x emulated_accum), i.e. the magnitudes of a step of ``regime_tokens_per_step``."""
    per_micro = t.batch_size * (bundle.input_size if bundle.task == "lm" else 1)
    divisor = t.accum_steps * t.emulated_accum
    out = {"task": bundle.task, ("tokens_per_step" if bundle.task == "lm" else "samples_per_step"):
           per_micro * t.accum_steps,
           "tokens_per_backward": per_micro // world, "loss_divisor": divisor,
           "emulated_accum": t.emulated_accum, "regime_tokens_per_step": per_micro // world * divisor,
           # what top-1 is measured on (images, or next tokens): one of them is 1/n_val of top-1
           "n_val": len(bundle.val) * (bundle.input_size if bundle.task == "lm" else 1),
           "num_classes": bundle.num_classes}  # ln C: the loss a diverged run's non-finite losses count as
    if bundle.task == "lm":
        from lab.data.text import baselines
        out.update(baselines(bundle.train, bundle.val, bundle.num_classes))
        out.update(val_bits_per_token=val_loss / math.log(2), val_perplexity=math.exp(min(val_loss, 700.0)),
                   vocab_size=bundle.num_classes, context=bundle.input_size)
    return out


def _train_loop(cfg: RunConfig, bundle, run_dir: Path, write_dir: Path, device: str, progress, d, faults) -> dict:
    """Build the run's components (or restore them from run_dir's checkpoint) and train; ``write_dir`` is
    where this process writes (the run directory on rank 0), ``faults`` the checked train.faults."""
    with checkpoint.SignalFlag() as signals:
        loop = build_loop(cfg, bundle, run_dir, write_dir, device, progress, d, faults, signals)
        loop.run()
    model, t = loop.model, cfg.train
    out = _finish(loop, bundle)
    if t.position_probe and d.is_main:  # the final model's gradients by position (lab/numerics/positions.py)
        out.update(_position_probe(loop, bundle, write_dir))
    if getattr(model, "lab_base", None) is not None:  # a LoRA fine-tune: its base model and adapters
        out["base_model"] = model.lab_base
    if t.save_weights and d.is_main:  # a base model for fine-tuning, written before metrics.json
        out["weights_sha256"] = _save_weights(model, write_dir)
    return {**out, **_rank_agreement(d, model, loop.state, loop.planter)} if d.enabled else out


def build_loop(cfg: RunConfig, bundle, run_dir: Path, write_dir: Path, device: str, progress, d, faults,
               signals) -> EpochLoop:
    """The run's loop, its components built (or restored from run_dir's checkpoint), ready to run: what
    _train_loop trains and benchmarks/speed/bench_step.py times step by step."""
    t = cfg.train
    from lab.data.datasets import make_loader
    pinned = device.startswith("cuda")
    train_loader = make_loader(bundle.train, t.batch_size // d.world, shuffle=True, seed=cfg.seed, drop_last=True,
                               num_workers=cfg.data.num_workers, rank=d.rank, world=d.world, pin_memory=pinned)
    sharded = d.enabled and cfg.parallel == "fsdp"
    # sharded: every rank's forward is collective, so each scores its own slice of the validation set
    val = torch.utils.data.Subset(bundle.val, rank_slice(len(bundle.val), d.rank, d.world)) if sharded \
        else bundle.val
    val_loader = make_loader(val, eval_batch_size(bundle.task, bundle.num_classes, bundle.input_size, t.batch_size),
                             shuffle=False, seed=cfg.seed, num_workers=cfg.data.num_workers, pin_memory=pinned,
                             persistent_workers=True)
    precision = cfg.mode.precision
    model = cfg.model.build(bundle.num_classes, bundle.in_chans, bundle.input_size, precision).to(device)
    if cfg.mode.qat is not None:  # torchao's fake quantizers on the linears, before any sharding wraps them
        from lab.models import qat
        qat.prepare(model, **cfg.mode.qat)
    if t.gradient_checkpointing:  # a model without the lab's GPT was refused by check_run
        checkpoint_target(model).checkpoint_blocks = True
    recipe = cfg.mode.build_recipe()
    if recipe is not None:  # an FP8/FP4 recipe: the linears' GEMMs quantized (same parameters, no state_dict change),
        from lab.fp8.linear import convert  # swapped before any sharding wraps the modules
        convert(model, recipe)
    if sharded:  # FSDP2: every block and the root sharded over the ranks, before the optimizer sees the parameters
        sharding.shard(model, precision, cfg.mode.reduce_dtype)
    # which kernels computed the reduced-precision ops: the GPU's own, or the tensor-core contract on CPU
    fp16_path = "n/a" if precision == "fp32" else FP16_PATH_CUDA if device.startswith("cuda") else FP16_PATH_CONTRACT
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, param_groups(cfg, model))
    steps_per_epoch = len(train_loader) // t.accum_steps  # >= 1: check_batches
    total_steps = steps_per_epoch * t.epochs
    if t.max_steps:
        total_steps = min(total_steps, t.max_steps)
    schedule = build_schedule(cfg, optimizer, total_steps)
    scaler = cfg.mode.build_scaler(device)
    if scaler.is_enabled():  # FP16 trainable parameters (adapters cast with their base): refused before step 1
        check_trainable_dtypes(optimizer, model=model)
    if d.enabled:
        scaler.agree_across_ranks()  # one rank's inf skips the step on every rank
        if cfg.mode.overflow_decision == "per-rank":  # the control of configs/fsdp-unscale.yaml: each rank alone
            scaler.decide_alone()
    if scaler.is_enabled() and scaler.per_tensor is not None:  # per-block factors (lab/scaling/pertensor.py)
        if sharded:
            raise ConfigError(f"mode {cfg.mode.name}: scaler.per_tensor does not run under FSDP (sharded gradients)")
        scaler.per_tensor.attach(model)
    # gradient census every census_every steps; on overflow steps, the layer that overflowed first
    # (a policy that does not skip overflow steps changes the parameters: its steps cannot be replayed).
    # Distributed: rank 0's view only (its activations; its replays run on the bare module, without DDP).
    monitor = NumericsMonitor(model, t.census_every if d.is_main else 0, attribute=scaler.is_enabled(),
                              replay_limit=t.attribution_replays if scaler.policy.skip_on_overflow and not sharded
                              else 0, fp32_replay=t.census_fp32_replay and not sharded)
    loss_fn = flat_cross_entropy(t.label_smoothing)
    memory = StepMemory(device)  # the training step's peak, without what the lab adds to it
    # sharded: model and optimizer checkpointed together, as full state dicts gathered on every rank
    weights = {"sharded": sharding.FullState(model, optimizer)} if sharded else {"model": model, "optimizer": optimizer}
    components = {**weights, "schedule": schedule, "scaler": scaler, "monitor": monitor}
    if faults:
        components["faults"] = fault_plan.FaultPlanter(model, faults, d.rank)
    if recipe is not None:  # amax histories, census counts, stochastic rounding's generator
        from lab.fp8.state import RecipeState
        components["recipe"] = RecipeState(model, recipe, cfg.seed, t.census_every, device)
    adapters = AdapterLog(model, t.log_every)
    if adapters:  # a LoRA fine-tune: adapters.csv
        components["adapters"] = adapters
    if bundle.provenance:  # resume only on the same corpus (and tokenizer); its folder (or Python) may change
        components["data"] = checkpoint.DataIdentity({k: v for k, v in bundle.provenance.items()
                                                      if k not in ("tokens", "corpus")})
    resume_from = checkpoint.latest(run_dir)
    if resume_from is not None:
        state, steps_log = resume(resume_from, cfg, write_dir, components, rank=d.rank, world=d.world)
        print(f"[{cfg.model.family}/{cfg.mode.name}/seed{cfg.seed}] resuming from {resume_from} (step "
              f"{state.step})", file=progress, flush=True)
    else:
        # what pairs runs across modes: the same seed must give the same initial weights and data order
        # sharded: the whole tensors (every rank gathers)
        state = LoopState(init_params_sha=files.tensor_digest([whole(v) for v in model.state_dict().values()]))
        x0, y0 = next(iter(train_loader))
        with memory.outside("activation_probe"):
            state.act_bytes = activation_bytes(model, loss_fn, bundle.prepare(x0.to(device)), y0.to(device), device,
                                               precision)
        steps_log = StepLog(write_dir)
    # DDP averages the gradients over ranks; everything else (monitor, replay, evaluation, checkpoints) uses model.
    # FSDP2 shards the model in place: it is what trains
    trained = torch.nn.parallel.DistributedDataParallel(model) if d.enabled and not sharded else model
    loop = EpochLoop(cfg, write_dir, device, progress, train_loader, val_loader, components, state, steps_log,
                     signals, loss_fn, params, steps_per_epoch, total_steps, d, trained, bundle=bundle,
                     fp16_path=fp16_path, memory=memory)
    return loop


def _position_probe(loop: EpochLoop, bundle, write_dir: Path) -> dict:
    """train.position_probe: the final model's gradients by position on the first batch_size validation windows,
    the run's precision (an FP32 run: FP16 at scale 1, the counterfactual) and FP32 against FP64, at the run's final
    scale and loss divisor; positions.csv in the run folder, its tail and head scalars (pos_*) for metrics.json."""
    from lab.numerics import positions
    n = min(loop.cfg.train.batch_size, len(bundle.val))
    idx, targets = (torch.stack(t) for t in zip(*(bundle.val[i] for i in range(n))))
    precision = loop.cfg.mode.precision
    scale = loop.scaler.get_scale() if loop.scaler.is_enabled() else 1.0
    with loop.memory.outside("position_probe"):
        table, scalars = positions.probe(loop.model, idx.to(loop.device), targets.to(loop.device),
                                         "fp16" if precision == "fp32" else precision, scale, loop.divisor)
    files.atomic_write_csv(write_dir / positions.FILE, table.to_dict("records"), list(table.columns))
    return {"pos_scale": scale, "pos_divisor": loop.divisor, "pos_sequences": n, **scalars}


def _save_weights(model, write_dir: Path) -> str:
    """weights.pt (the model's state_dict, atomically); its SHA-256, which every fine-tune of it records."""
    from lab.models.lora import WEIGHTS
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    data = buf.getvalue()
    files.atomic_write(write_dir / WEIGHTS, lambda f: f.write(data), mode="wb")
    return hashlib.sha256(data).hexdigest()


def rank_digests(model, scales: list[float]) -> tuple[str, str, str]:
    """(parameters, buffers, scale trajectory) digests of one rank's model and run. Parameters and buffers apart:
    DDP keeps the parameters equal on every rank, while buffers such as BatchNorm's running statistics are each
    rank's own by design (no --sync-bn), so they differ between ranks that trained in lockstep. Sharded (FSDP2)
    parameters are gathered whole first (a collective: every rank calls this)."""
    return (files.tensor_digest([whole(p) for _, p in model.named_parameters()]),
            files.tensor_digest([b for _, b in model.named_buffers()]),
            files.tensor_digest([torch.tensor(scales, dtype=torch.float64)]))


def rank_agreement(every: list[tuple[str, str, str]]) -> dict:
    """metrics.json's view of every rank's rank_digests: the digests, ``ranks_agree`` (the parameters and the
    scale trajectory are equal on every rank) and ``ranks_differ_in`` (what differs, buffers included)."""
    names = ("parameters", "buffers", "scale trajectory")
    differ = [name for i, name in enumerate(names) if len({e[i] for e in every}) > 1]
    return {"rank_param_digests": [e[0] for e in every], "rank_buffer_digests": [e[1] for e in every],
            "rank_scale_digests": [e[2] for e in every],
            "ranks_agree": "parameters" not in differ and "scale trajectory" not in differ, "ranks_differ_in": differ}


def rank_decisions(every: list[tuple[list, list, list, list]]) -> dict:
    """metrics.json's count of what each rank saw and decided, from every rank's per-step (scales, skips, learning
    rates, own overflow checks): its skipped steps; the steps at which the ranks' own checks differed (an inf in some
    ranks' gradients only: sharded, in some shards only; what the agreement decides for the others); and those at
    which the ranks skipped differently, ran their backward at different scales (the reduced gradient then weights
    the ranks' data unequally) or stepped at different learning rates (the schedule advances on applied steps only).
    All but the first zero where the ranks agree on every overflow."""
    def differ(i: int) -> int:
        return sum(len(set(column)) > 1 for column in zip(*(e[i] for e in every)))
    return {"rank_skipped_steps": [int(sum(e[1])) for e in every], "rank_own_overflow_disagreements": differ(3),
            "rank_skip_disagreements": differ(1), "rank_scale_disagreements": differ(0),
            "rank_lr_disagreements": differ(2)}


def _rank_agreement(d, model, state, planter) -> dict:
    """Every rank's digests (rank_agreement) and decisions (rank_decisions), and the faults planted on any rank."""
    out = rank_agreement(d.gather(rank_digests(model, state.scales)))
    out.update(rank_decisions(d.gather((state.scales, state.skips, state.lrs, state.own_found))))
    if planter is not None:
        planted = sorted({f for fs in d.gather(planter.planted) for f in fs}, key=lambda f: (f.step, f.micro))
        out.update(faults_planted=[f.to_dict() for f in planted], planted_steps=sorted({f.step for f in planted}))
    return out


def _finish(loop: EpochLoop, bundle) -> dict:
    """Publish steps.csv and the census, and gather the run's results from what the loop left."""
    cfg, device, progress, state, scaler, tag, planter = (loop.cfg, loop.device, loop.progress, loop.state,
                                                           loop.scaler, loop.tag, loop.planter)
    t, total_steps = cfg.train, loop.total_steps
    step, scales, train_time = state.step, state.scales, state.train_time
    loop.steps_log.publish()
    numerics = loop.monitor.finish(loop.write_dir)  # census.csv, grad_hist.csv; first_overflow_step, ...
    if loop.recipe is not None:  # the recipe's saturated and flushed shares per tensor kind; fp8_census.csv
        numerics.update(loop.recipe.metrics())
        loop.recipe.write(loop.write_dir)
    if loop.adapters is not None:
        loop.adapters.write(loop.write_dir)
        numerics.update(loop.adapters.metrics())

    skipped_steps = scaler.skipped_steps
    diverged_reason, last_loss = state.diverged_reason, state.last_loss
    if diverged_reason is None and step > 0 and skipped_steps == step:
        diverged_reason = "every optimizer step was skipped"
    if diverged_reason is None and not math.isfinite(last_loss):
        diverged_reason = "final training loss is not finite"
    if diverged_reason:
        log.warning("%s diverged: %s", tag, diverged_reason)
        print(f"{tag} diverged: {diverged_reason}", file=progress, flush=True)
    planted = {} if planter is None else {  # only runs with faults carry these keys
        "faults_planned": len(planter.faults), "faults_planted": [f.to_dict() for f in planter.planted],
        "planted_steps": sorted({f.step for f in planter.planted})}
    if planter is not None:
        planter.close()
    return {
        "fp16_path": loop.fp16_path, "init_params_sha": state.init_params_sha, "first_batch_sha": state.first_batch_sha,
        **planted,
        **numerics,
        "data": bundle.description,
        "steps": step, "epochs": state.epochs_done, "total_steps_planned": total_steps,
        "final_top1": state.top1, "best_top1": state.best_top1, "final_val_loss": state.val_loss,
        "outcomes": outcomes.record(loop.write_dir),  # per-example correctness and loss (lab/run/outcomes.py)
        **_task_metrics(bundle, t, state.val_loss, loop.d.world),
        "final_train_loss": last_loss,
        "overflow_steps": scaler.overflow_steps, "skipped_steps": skipped_steps,
        **_overflow_split(scaler, step),
        "update_ratio": (step - skipped_steps) / step if step else 0.0,
        "max_consecutive_skips": scaler.max_consecutive_skips, "alerts": scaler.alerts,
        "fallback_step": scaler.fallback_step,
        "final_scale": scaler.get_scale(),
        "min_scale": min(scales) if scales else None, "max_scale": max(scales) if scales else None,
        "diverged": diverged_reason is not None, "diverged_reason": diverged_reason,
        "throughput_samples_per_s": state.samples / train_time if train_time else 0.0,
        "train_time_s": train_time,
        **({"settle_steps": t.settle_steps, "settle_overflows": state.settle_overflows,
            "settle_time_s": state.settle_time} if t.settle_steps else {}),
        **loop.memory.metrics(),
        "activation_mb": state.act_bytes / 2**20,
        "status": "diverged" if diverged_reason else "ok",
    }
