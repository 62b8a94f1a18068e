"""Replay any loss-scaling policy over a recorded run: the scales it would have chosen, the steps it would have
skipped, the share of gradients it would have lost to underflow.

``python -m lab replay RUN_DIR [--policy NAME[:KEY=VALUE,...]] ...`` (every registered policy at its defaults when
no ``--policy`` is given). What a run records is enough:

* ``steps.csv``'s ``grad_amax`` per step: the largest unscaled gradient the optimizer received (what the
  amax-history policy observes at ``unscale_``; inf when the run itself overflowed), ``grad_norm`` (for policies
  that need it) and the scale the run used;
* the census's log2 histograms (``grad_hist.csv``, every ``census_every`` steps) of the backward's activation and
  parameter gradients at scale 1 (an FP16 run's FP32 replay of its census steps; an FP32 or BF16 run's own).

The model of one step, at the replayed scale S:

* **overflow** when ``S * grad_amax / divisor * 2**headroom >= 65520`` (FP16's overflow bound). ``divisor`` is
  accum_steps x emulated_accum: one backward's gradients are that fraction of the step's sum. ``headroom`` is
  the run's largest gap, in binades, between the activation gradients' and the parameter gradients' top
  histogram bins over its census steps (0 without a census): the backward's peak sits that far above what the
  optimizer receives. A step the run itself overflowed (``grad_amax`` not finite at scale s) overflows at
  every ``S >= s``; below s its amax is unknown: counted as not overflowing, and in ``uncertain_steps``.
* **underflow**: at each census step, the share of the non-zero gradient values ``v`` with
  ``S * v <= 2**-25`` (they round to 0), from the binade histogram: exact for power-of-two scales but for
  values exactly on a bin edge; pooled over census steps as the run's own ``flushed_*`` metrics are.

This is exact where the policy is: its rule is the real class (``lab.scaling.create``), run over the recorded
observations. It is an approximation where the run is: a replayed skip does not change the weights that
follow (the recorded run's do not skip), and an FP16 backward's maximum is not an FP32 one's. The study
measures how close it comes (``python -m lab replay-agreement``; docs/replay.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from lab.core import runfiles
from lab.core.fp16 import OVERFLOW_BOUND, UNDERFLOW_BOUND

__all__ = ["ReplayError", "RunRecord", "ReplayEnv", "read_run", "replay", "replay_run", "parse_policy", "REPLAY_COLUMNS"]

ACTIVATION, PARAM = "activation_grad", "param_grad"
REPLAY_COLUMNS = ["policy", "params", "steps", "overflow_steps", "skipped_steps", "uncertain_steps", "final_scale",
                  "min_scale", "max_scale", "flushed_activation", "flushed_param", "ended_at", "ended_reason"]


class ReplayError(ValueError):
    """A run directory replay cannot use, or a policy it cannot build: the message says which. (A damaged file in
    the run directory raises lab.core.runfiles.RunFileError.)"""


@dataclass
class RunRecord:
    """What replay reads from one run directory."""
    path: Path
    steps: list[int]
    scales: list[float]          # the scale the run used at each step
    amax: list[float]            # unscaled max |grad| the optimizer received (inf/nan: the run overflowed)
    grad_norm: list[float]
    divisor: int                 # accum_steps x emulated_accum
    headroom: int                # binades from the parameter gradients' top bin to the activation gradients'
    hist: dict[int, dict[str, dict]] = field(default_factory=dict)  # census step -> source -> {bin: count}
    mode: dict = field(default_factory=dict)


def _num(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _read_hist(path: Path) -> dict[int, dict[str, dict]]:
    """Census histograms at scale 1: {step: {source: {bin or 'nonfinite': count}}}, from FP32 values where the
    run has them (an FP16 run's FP32 replay), else from the run's own FP32/BF16 gradients; {} for an FP16 run
    without the replay (its own FP16 values have lost what replay would count)."""
    if not path.is_file():
        return {}
    rows = runfiles.read_csv(path, ("step", "source", "at_scale", "log2_bin", "count"),
                            live=runfiles.is_live(path))[1]
    from lab.numerics.census import HIST_RANGE, replay_rows
    # FP32 values at one scale per step and source (lab.numerics.census.replay_rows), else a BF16 run's own
    rows = replay_rows(rows) or [r for r in rows if r.get("grads") == "bf16"]
    # the histogram's top bin holds everything above it: a step and source with values there saturated the range (a
    # huge loss scale) and cannot say what a lower scale would flush
    saturated = {(r["step"], r["source"]) for r in rows
                 if r["log2_bin"].strip() == str(HIST_RANGE[1] - 1) and float(r["count"]) > 0}
    out: dict[int, dict[str, dict]] = {}
    for r in rows:
        if (r["step"], r["source"]) in saturated:
            continue
        shift = math.log2(float(r["at_scale"]))
        label = r["log2_bin"].strip().lower()
        bins = out.setdefault(int(r["step"]), {}).setdefault(r["source"], {})
        if label == "zero":
            continue
        b = "nonfinite" if label == "nonfinite" else int(label) - shift  # the bin of the unscaled value
        bins[b] = bins.get(b, 0) + int(float(r["count"]))
    return out


def _headroom(hist: dict[int, dict[str, dict]]) -> int:
    gaps = []
    for sources in hist.values():
        tops = {s: max((b for b, n in bins.items() if b != "nonfinite" and n > 0), default=None)
                for s, bins in sources.items()}
        if tops.get(ACTIVATION) is not None and tops.get(PARAM) is not None:
            gaps.append(tops[ACTIVATION] - tops[PARAM])
    return max(0, int(math.ceil(max(gaps)))) if gaps else 0


def read_run(run_dir: str | Path) -> RunRecord:
    """Read a run directory (steps.csv with grad_amax, config.yaml, grad_hist.csv when present): ReplayError for a
    run replay cannot use (no steps.csv, no grad_amax); lab.core.runfiles.RunFileError, naming the file and line,
    for a damaged file (not a ReplayError: the study's replay table skips the runs replay cannot use, never a
    damaged one)."""
    run_dir = Path(run_dir)
    steps_csv = run_dir / "steps.csv"
    if not steps_csv.is_file():
        steps_csv = run_dir / "steps.csv.partial"  # a run still going, or killed: its last line may be half-written
    if not steps_csv.is_file():
        raise ReplayError(f"{run_dir}: no steps.csv (not a run directory?)")
    columns, rows = runfiles.read_csv(steps_csv, ("step", "scale"), live=runfiles.is_live(steps_csv))
    if not rows:
        raise ReplayError(f"{steps_csv}: no steps recorded")
    if "grad_amax" not in columns:
        raise ReplayError(f"{steps_csv}: no grad_amax column (a run made before the lab recorded it); train it again")
    cfg = runfiles.read_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else {}
    divisor = int(train.get("accum_steps", 1)) * int(train.get("emulated_accum", 1))
    hist = _read_hist(run_dir / "grad_hist.csv")
    return RunRecord(path=run_dir, steps=[runfiles.number(steps_csv, r, "step", int) for r in rows],
                     scales=[_num(r["scale"]) for r in rows], amax=[_num(r["grad_amax"]) for r in rows],
                     grad_norm=[_num(r.get("grad_norm")) for r in rows], divisor=divisor, headroom=_headroom(hist),
                     hist=hist, mode=cfg.get("mode", {}))


def parse_policy(spec: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (values read as YAML: 1000, 2.0e-3, true) -> (name, params): the
    predictors' spec syntax (lab.scaling.predictors.parse_spec), refused as a ReplayError."""
    from lab.core.errors import ConfigError
    from lab.scaling.predictors import parse_spec
    try:
        return parse_spec(spec)
    except ConfigError as e:
        raise ReplayError(str(e).replace("predictor ", "policy ", 1)) from None


def _binade_flushed(bins: dict, scale: float) -> tuple[int, int]:
    """(values flushed, non-zero values) of one census histogram at ``scale``: a whole binade [2^b, 2^(b+1)) whose
    scaled top is at most 2^-25 rounds to 0."""
    under = nonzero = 0
    for b, n in bins.items():
        nonzero += n
        if b != "nonfinite" and math.ldexp(scale, int(b) + 1) <= UNDERFLOW_BOUND:
            under += n
    return under, nonzero


def _flushed(record: RunRecord, scale_at: dict[int, float]) -> dict[str, float | None]:
    """Pooled over the census steps: the share of non-zero values of each source that FP16 flushes at the
    replayed scale of that step."""
    out = {}
    for source, key in ((ACTIVATION, "activation"), (PARAM, "param")):
        under = nonzero = 0
        for step, sources in record.hist.items():
            bins, scale = sources.get(source), scale_at.get(step)
            if not bins or scale is None:
                continue
            u, n = _binade_flushed(bins, scale)
            under, nonzero = under + u, nonzero + n
        out[f"flushed_{key}"] = under / nonzero if nonzero else None
    return out


class ReplayEnv:
    """A recorded run as an environment, by the module docstring's model of a step: what a policy's scale meets at
    step i (``outcome``), what the engine would then hand the policy (``observations``), and the share of the
    gradient values it flushes (``flushed``). ``replay`` runs every policy through it; the learned controller
    (lab/scaling/learning/controller.py) learns in it."""

    def __init__(self, record: RunRecord):
        self.record = record
        census = sorted(record.hist)
        # each step's census: the latest at or before it (the first one before any): its histogram stands for the
        # step's gradient distribution, which moves slowly between census steps
        self._census = [max((c for c in census if c <= s), default=census[0]) if census else None
                        for s in record.steps]

    def __len__(self) -> int:
        return len(self.record.steps)

    def outcome(self, i: int, scale: float) -> tuple[bool, bool]:
        """(overflow at ``scale`` in step i, whether that is uncertain)."""
        record = self.record
        amax = record.amax[i]
        if not math.isfinite(amax):  # the run overflowed at its own scale: so would any scale at least as high
            return scale >= record.scales[i], scale < record.scales[i]
        return math.ldexp(scale * amax / record.divisor, record.headroom) >= OVERFLOW_BOUND, False

    def observations(self, i: int, found: bool) -> tuple[float, float]:
        """(grad_norm, grad_amax) as the engine gives them to the policy after step i: inf on an overflow. For a
        step the run overflowed (and the replayed scale did not), grad_amax is the least value that explains the
        run's overflow, in the same units: a lower bound."""
        if found:
            return math.inf, math.inf
        record, amax = self.record, self.record.amax[i]
        if not math.isfinite(amax):
            amax = math.ldexp(OVERFLOW_BOUND / record.scales[i] * record.divisor, -record.headroom)
        return record.grad_norm[i], amax

    def flushed(self, i: int, scale: float) -> float | None:
        """The share of the non-zero gradient values (activation and parameter gradients pooled) of step i's census
        that ``scale`` flushes; None for a run without a census."""
        step = self._census[i]
        if step is None:
            return None
        under = nonzero = 0
        for bins in self.record.hist[step].values():
            u, n = _binade_flushed(bins, scale)
            under, nonzero = under + u, nonzero + n
        return under / nonzero if nonzero else 0.0


def replay(record: RunRecord, name: str, params: dict | None = None, trajectory: bool = False) -> dict:
    """Run policy ``name`` (with ``params``, engine parameters included) over the record; returns a REPLAY_COLUMNS
    dict (plus ``trajectory``: per step (step, scale, overflow, skipped), when asked)."""
    import lab.scaling
    from lab.scaling import to_f32
    from lab.scaling.policies.deepspeed import ScaleFloorReached

    params = dict(params or {})
    fallback_after = params.pop("fp32_fallback_after", None)
    for engine_only in ("alert_after", "device", "enabled"):
        params.pop(engine_only, None)
    try:
        policy = lab.scaling.create(name, device="cpu", **params).policy
    except ValueError as e:
        raise ReplayError(f"policy {name!r}: {e}") from None
    env = ReplayEnv(record)
    scale = to_f32(policy.init_scale)
    overflow = skipped = uncertain = run_of_skips = 0
    scales, scale_at, traj = [], {}, []
    ended_at, reason = None, ""
    for i, step in enumerate(record.steps):
        scale_at[step] = scale
        scales.append(scale)
        found, unsure = env.outcome(i, scale)
        uncertain += unsure
        skip = found and policy.skip_on_overflow
        overflow += found
        skipped += skip
        run_of_skips = run_of_skips + 1 if skip else 0
        if trajectory:
            traj.append((step, scale, found, skip))
        if fallback_after is not None and run_of_skips >= fallback_after:
            ended_at, reason = step, f"FP32 fallback after {run_of_skips} consecutive skips"
            break
        norm, amax = env.observations(i, found)
        extra = {"grad_amax": amax} if policy.needs_grad_amax else {}
        try:
            scale = to_f32(policy.update(scale, found, i, norm if policy.needs_grad_norm else None, **extra))
        except ScaleFloorReached as e:
            ended_at, reason = step, str(e)
            break
    out = {"policy": name, "params": ",".join(f"{k}={v}" for k, v in sorted(params.items())),
           "steps": len(scales), "overflow_steps": overflow, "skipped_steps": skipped, "uncertain_steps": uncertain,
           "final_scale": scale, "min_scale": min(scales), "max_scale": max(scales), **_flushed(record, scale_at),
           "ended_at": ended_at, "ended_reason": reason}
    if trajectory:
        out["trajectory"] = traj
    return out


def default_policies() -> list[tuple[str, dict]]:
    """What `lab replay RUN` replays without --policy: every registered policy at its defaults, amax-predicted once
    per registered predictor (lab/scaling/predictors; ``max`` is amax-history itself), and the learned ones only
    where their fitted model exists (``auto``: the lab's committed one)."""
    import lab.scaling
    from lab.scaling.learning import artefact
    from lab.scaling.predictors import available_predictors
    out = []
    for name in lab.scaling.available():
        if name == "amax-predicted":
            out += [(name, {"predictor": p}) for p in available_predictors() if p != "max"
                    and (p != "learned" or artefact.exists("auto", "learned-fp16"))]
        elif name != "rl-controller" or artefact.exists("auto", "rl-fp16"):
            out.append((name, {}))
    return out


def replay_run(run_dir: str | Path, policies: list[tuple[str, dict]] | None = None) -> list[dict]:
    """Every policy of ``policies`` (default: ``default_policies()``) replayed on one run."""
    record = read_run(run_dir)
    return [replay(record, name, params) for name, params in (policies if policies is not None
                                                               else default_policies())]
