"""What a diagnosis is made of, and reading and printing it: the Diagnosis record (key numbers, findings,
recommendations) and the collector the rules fill it in through, the run directory's files as the diagnosis
reads them, and the text report. The rules live in the package's other modules (lab/diagnose/__init__.py lists them).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lab.core import files, runfiles

STEP_COLUMNS = runfiles.STEP_COLUMNS                                    # required in steps.csv
LAYER_COLUMN = "first_nonfinite_layer"                                  # optional in steps.csv
SOURCE_COLUMN = "first_nonfinite_source"                                # optional in steps.csv
CENSUS_COLUMNS = runfiles.CENSUS_COLUMNS                                # required in census.csv
CENSUS_TOTAL = "__total__"
HEALTHY_UPDATE_RATIO = 0.95      # "healthy" > 95 % of steps applied (the source study's monitoring rule)
SEVERITIES = ("problem", "warning", "info")


class DiagnoseError(Exception):
    """The run directory is missing or malformed; the message names the path."""


@dataclass
class Finding:
    code: str                    # stable identifier, e.g. "overflow", "scale_collapse", "underflow"
    severity: str                # problem | warning | info
    message: str                 # plain words with numbers
    evidence: dict = field(default_factory=dict)  # the numbers the message quotes, by name (per code)


@dataclass
class Recommendation:
    code: str                    # lower_init_scale, lower_scale, hysteresis, longer_growth_interval, bf16,
                                 # fp32_fallback, raise_scale, lower_lr, skip_on_overflow, larger_margin,
                                 # lower_min_scale, replay_policy, keep_fp32, measure_underflow, cap_scale,
                                 # fp16_both_paths, truncated_is, healthy
    action: str                  # what to change
    evidence: str                # why, with the numbers
    based_on: list = field(default_factory=list)   # codes of the findings it rests on
    change: dict = field(default_factory=dict)     # what it changes, for the advice rules: policy, scale,
                                                   # init_scale, precision (lab/diagnose/advice.py)


@dataclass
class Diagnosis:
    run_dir: str                 # the run directory diagnosed
    verdict: str                 # healthy | issues | diverged | failed
    headline: str                # one sentence
    model: str | None = None     # metrics.json's model (a family name); None for a recording without one
    mode: str | None = None      # the study's mode name
    seed: int | None = None      # the run's seed
    precision: str | None = None  # fp32 | fp16 | bf16 (an FP8 recipe runs under bf16)
    policy: str | None = None    # the loss-scaling policy; none without a scaler
    recording: bool = False      # lab.record's run of your own loop (not a lab run)
    status: str | None = None    # metrics.json's status: ok | diverged | failed | running
    diverged_reason: str | None = None  # why the run stopped, when it diverged
    steps: int = 0               # optimizer steps recorded in steps.csv
    overflow_steps: int = 0      # steps whose gradients held inf or NaN (found_inf)
    skipped_steps: int = 0       # steps whose update was skipped
    skip_rate: float = 0.0       # skipped_steps / steps
    update_ratio: float = 0.0    # share of steps that updated the weights (healthy: > 0.95)
    first_overflow_step: int | None = None  # the first overflow step; None: none
    longest_skip_streak: int = 0  # the most consecutive skipped steps
    longest_skip_streak_start: int | None = None  # the step that streak started at
    initial_overflow_streak: int = 0                         # overflow steps of the initial descent
    overflow_in_training: int = 0                            # overflow steps after the first clean step
    overflow_per_1k: float | None = None                     # ... per 1000 steps after the first clean step
    growth_attempts: int = 0                                 # steps after which the scale went up
    init_scale: float | None = None  # the loss scale at the first step
    final_scale: float | None = None  # the loss scale after the last update
    min_scale: float | None = None  # the smallest loss scale used
    max_scale: float | None = None  # the largest loss scale used
    scale_halvings: int = 0      # steps after which the scale went down
    nonfinite_loss_steps: int = 0  # steps whose loss was inf or NaN
    first_nonfinite_loss_step: int | None = None  # the first of them
    fallback_step: int | None = None  # the step the run fell back to FP32 (policy fp32_fallback)
    alerts: int | None = None    # the run's own skip-streak alerts (metrics.json)
    planted_steps: list | None = None                        # train.faults' steps (None: the run planted none)
    unplanted_overflow_steps: list | None = None             # overflow steps that no planted fault explains
    overflow_layers: dict = field(default_factory=dict)      # first_nonfinite_layer -> overflow steps
    later_overflow_layers: dict = field(default_factory=dict)  # the same, after the initial overflow streak
    underflow_at_final_scale: dict | None = None             # source -> fraction (census.csv); None: unknown
    forward_overflow: dict | None = None                     # the first module beyond FP16's range (replays)
    overflow_branches: dict | None = None                    # vision-language runs: branch -> overflow steps whose
                                                             # first non-finite value came from it, by pass
    fp16_loss: dict | None = None                            # an FP16 run's FP32 replay: what FP16 flushed
    census: dict | None = None                               # latest census step, summarised
    adapters: dict | None = None                             # LoRA adapters (adapters.csv): lora_B at the end
    rl: dict | None = None                                   # an RL run (rl_steps.csv): the sampler/learner mismatch
    fp8: dict | None = None                                  # an FP8 run's census (fp8_census.csv), summarised
    recipe: dict | None = None                               # an FP8 run's recipe: {name, **settings} (config.yaml)
    fp8_layers: str | None = None                            # whose layers ran it: lab | torchao (a recording's)
    qat: dict | None = None                                  # QAT's fake quantizers: their settings (config.yaml)
    findings: list = field(default_factory=list)  # what was found, the worst first
    recommendations: list = field(default_factory=list)
    withheld: list = field(default_factory=list)             # advice the run's evidence contradicts, and why
    notes: list = field(default_factory=list)  # what could not be measured or was left out, and why

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    def to_dict(self) -> dict:
        """JSON-ready: non-finite numbers become the strings "inf", "-inf", "nan"."""
        return files.json_safe(dataclasses.asdict(self))


class _Builder:
    """Collects the rules' findings and recommendations (one recommendation per code: the first one given)."""

    def __init__(self):
        self.findings: list[Finding] = []
        self.recs: list[Recommendation] = []

    def find(self, code, severity, message, **evidence):
        assert severity in SEVERITIES
        self.findings.append(Finding(code, severity, message, evidence))

    def recommend(self, code, action, evidence, *based_on, change: dict | None = None):
        if all(r.code != code for r in self.recs):
            self.recs.append(Recommendation(code, action, evidence, list(based_on), dict(change or {})))


# --- reading the run directory ---------------------------------------------------------------------------
@dataclass
class _Step:
    step: int
    loss: float
    scale: float
    found_inf: bool
    skipped: bool
    precision: str
    lr: float | None
    layer: str | None
    forward_module: str | None = None   # a replayed step's first module whose output left FP16's range
    forward_type: str | None = None     # its class
    forward_amax: float = math.nan      # its largest output magnitude (inf, NaN, or beyond 65504)
    forward_weight_amax: float = math.nan  # the largest magnitude of its own weights (0: it has none)


def _read_metrics(path: Path) -> dict:
    if not path.is_file():
        raise DiagnoseError(f"{path}: metrics.json is missing (not a run directory, or the run has not finished)")
    try:
        return runfiles.read_json(path)
    except runfiles.RunFileError as e:
        raise DiagnoseError(str(e)) from None


def _read_csv(path: Path, required: tuple[str, ...]) -> tuple[list[str], list[dict]]:
    """The file's columns and rows (lab.core.runfiles.read_csv; a live file, e.g. steps.csv.partial, a crashed
    run's step stream, may end inside its last line, which is left out and said: runfiles.is_live); DiagnoseError
    naming the file and line when damaged."""
    try:
        return runfiles.read_csv(path, required, live=runfiles.is_live(path))
    except runfiles.RunFileError as e:
        raise DiagnoseError(str(e)) from None


def _num(path: Path, row: dict, col: str, kind=float):
    try:
        return runfiles.number(path, row, col, kind)
    except runfiles.RunFileError as e:
        raise DiagnoseError(str(e)) from None


def _read_steps(path: Path) -> tuple[list[_Step], bool]:
    columns, raw = _read_csv(path, STEP_COLUMNS)
    steps = []
    for r in raw:
        lr = r.get("lr")
        layer = (r.get(LAYER_COLUMN) or "").strip() or None
        source = (r.get(SOURCE_COLUMN) or "").strip()
        if layer and source:  # activation_grad: the gradient at the layer's output; param_grad: its weights
            layer = f"{layer} ({source})"
        steps.append(_Step(step=_num(path, r, "step", int), loss=_num(path, r, "loss"),
                           scale=_num(path, r, "scale"), found_inf=_num(path, r, "found_inf", bool),
                           skipped=_num(path, r, "skipped", bool), precision=(r.get("precision") or "").strip(),
                           lr=_num(path, r, "lr") if lr not in (None, "") else None, layer=layer,
                           forward_module=(r.get("forward_overflow_module") or "").strip() or None,
                           forward_type=(r.get("forward_overflow_type") or "").strip() or None,
                           forward_amax=_num(path, r, "forward_amax") if (r.get("forward_amax") or "").strip()
                           else math.nan,
                           forward_weight_amax=_num(path, r, "forward_weight_amax")
                           if (r.get("forward_weight_amax") or "").strip() else math.nan))
    return steps, LAYER_COLUMN in columns


def _read_census(path: Path) -> list[dict]:
    _, raw = _read_csv(path, CENSUS_COLUMNS)
    rows = []
    for r in raw:
        row = {"step": _num(path, r, "step", int), "scale": _num(path, r, "scale"),
               "at_scale": _num(path, r, "at_scale"), "source": r["source"].strip(), "layer": r["layer"].strip()}
        for c in ("total", "zero", "underflow", "subnormal", "normal", "overflow"):
            row[c] = _num(path, r, c, int)
        row["grads"] = (r.get("grads") or "").strip() or None  # None: from before the FP32 replay (the run's own)
        rows.append(row)
    return rows


def _read_hist(path: Path) -> list[dict]:
    """grad_hist.csv's FP32 rows with a numeric bin: step, source, at_scale, k (|x| in [2^k, 2^(k+1))), count."""
    if not path.is_file():
        return []
    columns, raw = _read_csv(path, ("step", "source", "at_scale", "log2_bin", "count"))
    if "grads" not in columns:
        return []
    rows = []
    for r in raw:
        if (r.get("grads") or "").strip() != "fp32":
            continue
        try:
            k = int(r["log2_bin"])
        except ValueError:  # "zero", "nonfinite"
            continue
        rows.append({"step": _num(path, r, "step", int), "source": r["source"].strip(),
                     "at_scale": _num(path, r, "at_scale"), "k": k, "count": _num(path, r, "count", int)})
    return rows


def _read_config(path: Path) -> dict:
    """config.yaml ({} when the run has none); DiagnoseError naming the file when it is damaged."""
    if not path.is_file():
        return {}
    try:
        return runfiles.read_yaml(path)
    except runfiles.RunFileError as e:
        raise DiagnoseError(str(e)) from None


# --- formatting helpers ----------------------------------------------------------------------------------
def fmt_scale(x: float | None) -> str:
    """2^k for powers of two outside 1..1024 (the usual case), else %g."""
    if x is None:
        return "n/a"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x > 0:
        m, e = math.frexp(x)
        if m == 0.5 and not 1 <= x <= 1024:
            return f"2^{e - 1}"
    return f"{x:g}"


def fmt_scale_value(x: float) -> str:
    """2^k = value, for recommendations one can paste into a config."""
    s = fmt_scale(x)
    if not s.startswith("2^"):
        return s
    return f"{s} = {int(x)}" if x.is_integer() and x < 2.0 ** 53 else f"{s} = {x!r}"


def _pct(x: float | None) -> str:
    if x is None:
        return "n/a"
    if 0 < x < 0.001:
        return f"{100 * x:.3f}%"
    return f"{100 * x:.1f}%"


def _streaks(flags: list[bool]) -> list[tuple[int, int]]:
    """(start index, length) of each run of True."""
    out, start = [], None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - start))
            start = None
    return out


def _halvings(seq: list[float]) -> int:
    """How many times the scale fell from one entry of the sequence to the next."""
    return sum(1 for a, c in zip(seq, seq[1:]) if c < a)


def _steps_span(steps: list[_Step], start: int, length: int) -> str:
    a, b = steps[start].step, steps[start + length - 1].step
    return f"step {a}" if a == b else f"steps {a}-{b}"


# --- text report -----------------------------------------------------------------------------------------
def format_text(d: Diagnosis) -> str:
    ident = " / ".join(str(x) for x in (d.model, d.mode, f"seed {d.seed}" if d.seed is not None else None) if x)
    lines = [f"Diagnosis of {d.run_dir}"]
    if ident:
        lines.append(f"  {ident}: {d.precision}, policy {d.policy}, {d.steps} steps, status {d.status}")
    if d.recipe:
        settings = ", ".join(f"{k} {v}" for k, v in d.recipe.items() if k != "name")
        lines.append(f"  recipe {d.recipe.get('name')}" + (f" ({settings})" if settings else "")
                     + (", torchao's Float8Linear layers" if d.fp8_layers == "torchao" else ""))
    if d.qat is not None:
        from lab.models.qat import describe
        lines.append(f"  quantization-aware training: torchao's fake quantizers, {describe(d.qat)}")
    lines += [f"Verdict: {d.headline}", "", "Key numbers"]

    def kv(k, v):
        lines.append(f"  {k:<18}{v}")

    kv("overflow steps", f"{d.overflow_steps} of {d.steps}" + (f" (first at step {d.first_overflow_step})"
                                                               if d.first_overflow_step is not None else ""))
    if d.overflow_steps or d.growth_attempts:
        rate = "" if d.overflow_per_1k is None else f", {d.overflow_per_1k:.2f} per 1000 steps"
        kv("  split", f"{d.initial_overflow_streak} in the initial descent, {d.overflow_in_training} in training"
           f"{rate}; {d.growth_attempts} growth attempts")
    kv("skipped steps", f"{d.skipped_steps} ({_pct(d.skip_rate)})" + (
        f", longest streak {d.longest_skip_streak} from step {d.longest_skip_streak_start}"
        if d.longest_skip_streak else ""))
    kv("update ratio", f"{_pct(d.update_ratio)} (healthy: > {_pct(HEALTHY_UPDATE_RATIO)})")
    if d.precision == "fp16":
        kv("loss scale", f"start {fmt_scale(d.init_scale)}, final {fmt_scale(d.final_scale)}, min "
           f"{fmt_scale(d.min_scale)}, max {fmt_scale(d.max_scale)}; {d.scale_halvings} halvings")
    if d.fp8:  # what the recipe did to each tensor kind, over its census steps
        kv("FP8 census", f"{d.fp8['census_steps']} step(s), {d.fp8['operands']} operands "
           f"({', '.join(d.fp8['formats'])})")
        kv("  clipped/flushed", "; ".join(f"{kind} {_pct(v['saturated'])} / {_pct(v['flushed'])}"
                                          for kind, v in d.fp8["shares"].items()))
    kv("non-finite loss", f"{d.nonfinite_loss_steps} steps" + (
        f" (first at step {d.first_nonfinite_loss_step})" if d.first_nonfinite_loss_step is not None else ""))
    if d.fallback_step is not None:
        kv("FP32 fallback", f"at step {d.fallback_step}")
    if d.overflow_layers:
        kv("overflow layers", ", ".join(f"{k} x{v}" for k, v in list(d.overflow_layers.items())[:3]))
    if d.overflow_branches:  # a vision-language model: the branch and the pass each overflow started in
        kv("overflow branch", ", ".join(f"{e['label']} x{e['steps']} (" + ", ".join(
            f"{p} x{e[p]}" for p in ("forward", "backward", "unknown") if e[p]) + ")"
            for e in d.overflow_branches.values()))
    if d.fp16_loss:
        kv("FP16 lost", ", ".join(f"{k.replace('_', ' ')}s {_pct(v['flushed'])} flushed, {_pct(v['subnormal'])} "
                                  "subnormal" for k, v in d.fp16_loss["sources"].items())
           + f" (FP32 replay at scale {fmt_scale(d.fp16_loss['scale'])}, step {d.fp16_loss['step']})")
    elif d.underflow_at_final_scale:
        kv("underflow", ", ".join(f"{k.replace('_', ' ')}s {_pct(v)}" for k, v in d.underflow_at_final_scale.items())
           + " (census)")
    elif d.precision == "fp16" and d.census:
        kv("underflow", "not measured (FP16's own zeros hold the flushed values; no FP32 replay)")
    if d.forward_overflow:
        f = d.forward_overflow
        kv("forward range", f"first beyond FP16: {f['module']} ({f['type']}){f.get('in_branch', '')}, on {f['steps']} "
           "measured steps (replayed or probed)")
    if d.rl:
        r = d.rl
        kv("RL mismatch", f"sampler {r['sampler']}, learner {r['learner']}: mean |log pi - log mu| "
           f"{r['mismatch_abs_mean']:.2g}, out of PPO's band {_pct(r['out_of_band_step0'])} at step 0 (at most "
           f"{_pct(r['out_of_band_max'])}), weights' ESS at least {_pct(r['ess_min'])}")
    lines += ["", "Findings"]
    lines += [f"  [{f.severity}] {f.message}" for f in d.findings] or ["  none"]
    lines += ["", "Recommendations"]
    for i, r in enumerate(d.recommendations, 1):
        lines.append(f"  {i}. {r.action}")
        lines.append(f"     evidence: {r.evidence}")
    if not d.recommendations:
        lines.append("  none beyond the findings above")
    if d.withheld:
        lines += ["", "Not recommended (the run's evidence contradicts it)"]
        lines += [f"  - {w['action']}: {w['reason']}" for w in d.withheld]
    if d.notes:
        lines += ["", "Notes"] + [f"  - {n}" for n in d.notes]
    return "\n".join(lines) + "\n"


def format_json(d: Diagnosis) -> str:
    return json.dumps(d.to_dict(), indent=2) + "\n"
