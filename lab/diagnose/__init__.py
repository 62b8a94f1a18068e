"""Diagnose a run directory: why is my loss NaN, why is this run not learning?

The package: here only the entry, ``diagnose()``; one module per concern: record.py (the Diagnosis record, reading
a run directory's files, the text and JSON reports), run.py (status, step counts, planted faults, fallback, the
loss's trend and spikes), overflow.py (non-finite losses, overflow and skipped steps, overflow layers), forward.py
(the first module beyond FP16's range), branch.py (a vision-language model: the branch and the pass, forward or
backward, each overflow started in), scale.py (the loss scale's trajectory), underflow.py (census.csv: what FP16
flushed, or that it was not measured), adapters.py (LoRA), fp8.py (an FP8 run's census: clipped, flushed, infinite
scales), rl.py (an RL run: the sampler/learner mismatch told from
the loss scale), advice.py (replayed policies, advice the evidence contradicts, ranking, the verdict); replay.py (any policy replayed over a run: ``python -m lab replay``) and
inspect.py (``lab inspect``). It reads a run's files only; of the lab it imports lab.core (files, fp16) and, inside
the functions that replay, lab.scaling and lab.numerics, and for a vision-language run lab.models.multimodal's
``branch_of``. The rules and the catalogue of failures they are tested on: docs/diagnose.md.

Reads only what the run recorded (``metrics.json``, ``steps.csv``, ``config.yaml`` and, when present,
``census.csv``) and answers in plain words with numbers::

    from lab.diagnose import diagnose, format_text
    d = diagnose("results/runs/lm/fp16-noscale/seed0")
    print(format_text(d))          # or json.dumps(d.to_dict())

``python -m lab diagnose RUN_DIR [--json]`` prints the same. A missing or malformed run directory raises
:class:`DiagnoseError` (the CLI exits with status 2), naming the path.

What is looked at:

* ``steps.csv`` (one row per optimizer step): overflow steps (``found_inf``), skipped steps and streaks,
  the scale trajectory (halvings, collapse, runaway), non-finite losses, the learning rate, and the optional columns
  ``first_nonfinite_layer`` (the layer whose gradient first became non-finite in backward order),
  ``first_nonfinite_source`` (``activation_grad``: the gradient at its output; ``param_grad``: its weights') and
  ``forward_overflow_module`` / ``_type`` / ``forward_amax`` (a replayed step's first module whose output left
  FP16's range).
* ``metrics.json``: status, diverged reason, final scale (after the last update), FP32 fallback step.
* ``config.yaml``: policy parameters and the learning rate, quoted in the recommendations.
* ``census.csv`` (optional): per-layer counts of values that underflow/overflow FP16. FP32 runs hold
  counterfactual rows (``at_scale`` 1, 128, 1024, 65536: what FP16 would lose at that scale); FP16 runs hold
  rows at the scale in use and, with the FP32 replay, rows of the same step in FP32 (what FP16 flushed). Without
  the replay an FP16 run's underflow is unknown, never 0%.

* ``steps.csv``'s ``grad_amax`` (when recorded): an FP16 run that skipped steps is replayed under every registered
  policy; the ones that would have skipped fewer steps without flushing more are named (``replay_fewer_skips``).

Severity: ``problem`` (the run is broken), ``warning`` (it costs updates or range), ``info``. A run is
``healthy`` when its status is ok, more than 95 % of its steps updated the weights and no finding is a
problem or a warning.

``lab.diagnose`` is both this package and the function: ``lab.diagnose(run_dir)`` calls ``diagnose(run_dir)``.
"""
from __future__ import annotations

import math
import sys
import types
from pathlib import Path

from lab.core.settings import spec_dict
from lab.diagnose import advice, branch, forward, fp8, overflow, rl, run
# the record, reading and printing (lab/diagnose/record.py) and the rules' thresholds are re-exported for callers
from lab.diagnose.adapters import adapter_findings
from lab.diagnose.record import (CENSUS_COLUMNS, CENSUS_TOTAL, HEALTHY_UPDATE_RATIO, SEVERITIES,  # noqa: F401
                                 DiagnoseError, Diagnosis, Finding, Recommendation, _Builder, _read_hist, fmt_scale,
                                 fmt_scale_value, format_json, format_text)
from lab.diagnose.scale import ALERT_STREAK, COLLAPSE_FACTOR, LONG_STREAK, RUNAWAY_SCALE, scale_findings  # noqa: F401
from lab.diagnose.underflow import FLUSH_MATERIAL, UNDERFLOW_LARGE, census_findings  # noqa: F401


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Read a run directory and explain what went wrong (or that nothing did)."""
    run_dir = Path(run_dir)
    metrics, steps, has_layer_column, config, census, notes = run.read_run(run_dir)
    mode_cfg = config.get("mode") if isinstance(config.get("mode"), dict) else {}
    scaler_cfg = mode_cfg.get("scaler") if isinstance(mode_cfg.get("scaler"), dict) else {}
    train_cfg = config.get("train") if isinstance(config.get("train"), dict) else {}
    precision = metrics.get("precision") or mode_cfg.get("precision") or (steps[0].precision if steps else None)
    d = Diagnosis(run_dir=str(run_dir), verdict="issues", headline="", model=metrics.get("model"),
                  mode=metrics.get("mode"), seed=metrics.get("seed"), precision=precision,
                  policy=metrics.get("scaler") or scaler_cfg.get("policy") or "none",
                  recording=bool(metrics.get("recording") or config.get("recording")), status=metrics.get("status"),
                  diverged_reason=metrics.get("diverged_reason"), steps=len(steps), alerts=metrics.get("alerts"),
                  notes=notes, recipe=spec_dict(mode_cfg.get("recipe")), fp8_layers=mode_cfg.get("fp8_layers"),
                  qat=mode_cfg["qat"] if isinstance(mode_cfg.get("qat"), dict) else None)
    nonfinite = [i for i, s in enumerate(steps) if not math.isfinite(s.loss)]    # row indices
    longest_skip = run.count_steps(d, steps, nonfinite)
    fp16_rows, fp32_rows = run.fp16_phase(d, steps, metrics)
    lr = run.learning_rate(train_cfg, steps, nonfinite[0] if nonfinite else None)

    branch.branch_origins(d, steps, config)  # a vision-language model: the branch each overflow started in
    b = _Builder()
    run.run_status_findings(b, d, metrics)
    forward.forward_findings(b, d, steps, metrics.get("attribution_replays"), metrics.get("forward_probes"))
    overflow.nonfinite_loss_findings(b, d, steps, nonfinite, fp16_rows, fp32_rows, lr)
    run.planted_findings(b, d, steps, train_cfg, metrics)
    overflow.overflow_findings(b, d, steps, fp16_rows, longest_skip)
    if fp16_rows:
        scale_findings(b, d, fp16_rows, scaler_cfg)
    run.fallback_finding(b, d, fp32_rows, scaler_cfg)
    overflow.overflow_layer_findings(b, d, steps, has_layer_column)
    branch.branch_findings(b, d)
    if census is None:
        if precision in ("fp16", "fp32"):
            notes.append("no census.csv: underflow was not measured")
    elif not census:
        notes.append("census.csv holds no rows: underflow was not measured")
    else:
        census_findings(b, d, census, _read_hist(run_dir / "grad_hist.csv"))
    adapter_findings(b, d, run_dir, steps, census, _read_hist(run_dir / "grad_hist.csv"))
    rl.rl_findings(b, d, run_dir, metrics)  # an RL run: the sampler/learner mismatch told from a scale problem
    if (Path(run_dir) / "rl_steps.csv").is_file():
        # GRPO's loss is a clipped policy-gradient surrogate, about 0 by construction (advantages sum to zero per
        # group): its trend and spikes say nothing about learning; the reward (the RL note) does
        notes.append("a GRPO run: its loss (the policy-gradient surrogate) is not read for a trend or spikes; the "
                     "reward is")
    else:
        run.loss_trend_findings(b, steps)
        run.loss_spike_findings(b, steps)
    fp8.fp8_findings(b, d, run_dir)  # an FP8 run's census: what its recipe clipped, flushed or made NaN
    advice.replay_findings(b, d, run_dir)
    advice.sort_findings(b)
    advice.check_advice(b, d, fp16_rows, scaler_cfg)
    advice.verdict(b, d, metrics)
    d.findings, d.recommendations = b.findings, b.recs
    return d


class _CallableModule(types.ModuleType):
    """The package's module type: calling the package, ``lab.diagnose(run_dir)``, is ``diagnose(run_dir)``."""

    def __call__(self, run_dir: str | Path) -> Diagnosis:
        return diagnose(run_dir)


sys.modules[__name__].__class__ = _CallableModule
