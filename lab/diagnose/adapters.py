"""`lab diagnose` for LoRA fine-tunes: adapters that do not train, and adapter gradients that FP16 flushes.

Reads adapters.csv (lab/numerics/adapters.py: per adapter, every log_every steps, lora_B's norm and change and the
step's adapter gradients) with steps.csv and the census. Findings:

* ``adapters_not_training`` (problem): lora_B still exactly zero, or unchanged, for at least ``STILL_AFTER``
  optimizer steps up to the end of the run, with the cause the files show: every step in that span skipped (each
  overflowed), the adapters' gradients inf/NaN, or the adapters' gradients all zero (flushed by FP16 upstream).
* ``adapters_nonfinite`` (problem): lora_B holds inf/NaN (a step applied a non-finite gradient).
* ``adapter_grads_flushed`` (warning): the census's FP32 replay shows FP16 at the run's scale flushing more than
  ``FLUSH_MATERIAL`` of the adapters' non-zero gradient values, with the scale that would keep them (grad_hist).
"""
from __future__ import annotations

import math
from pathlib import Path

from lab.diagnose.record import Diagnosis, _Builder, _num, _pct, _read_csv, fmt_scale, fmt_scale_value
from lab.numerics.adapters import FILE

STILL_AFTER = 20        # optimizer steps with lora_B exactly zero or unmoved, up to the run's end: not training
ADAPTER = "adapter_grad"
KEEP_SHARE = 0.999      # the scale "that would keep them": 99.9% of the adapters' non-zero gradients above 2^-24


def _read(path: Path) -> dict[str, list[dict]] | None:
    if not path.is_file():
        return None
    by: dict[str, list[dict]] = {}
    for r in _read_csv(path, ("adapter", "step"))[1]:  # DiagnoseError naming the file and line when damaged
        row = {k: _num(path, r, k) for k in r if k not in ("adapter", "_line")}
        row.update(adapter=r["adapter"], step=_num(path, r, "step", int))
        by.setdefault(r["adapter"], []).append(row)
    for rows in by.values():
        rows.sort(key=lambda r: r["step"])
    return by


def adapter_findings(b: _Builder, d: Diagnosis, run_dir: Path, steps: list, census: list[dict] | None,
                     hist: list[dict]) -> None:
    by = _read(run_dir / FILE)
    if not by:
        return
    d.adapters = {name: {"b_norm": rows[-1]["b_norm"], "b_nonzero": rows[-1]["b_nonzero"],
                         "last_change_step": _last_change(rows)} for name, rows in by.items()}
    nonfinite = [n for n, rows in by.items() if not math.isfinite(rows[-1]["b_norm"])]
    if nonfinite:
        b.find("adapters_nonfinite", "problem", f"lora_B of {len(nonfinite)} of {len(by)} adapters holds inf/NaN "
               f"(first: {nonfinite[0]}): a step applied a non-finite adapter gradient", adapters=nonfinite)
    _not_training(b, by, steps, nonfinite)
    if census:
        _flushed(b, d, census, hist)


def _last_change(rows: list[dict]) -> int | None:
    """The last logged step at which lora_B had moved since the row before (None: never)."""
    moved = [r["step"] for r in rows if r["b_change"] != 0]
    return moved[-1] if moved else None


def _not_training(b: _Builder, by: dict[str, list[dict]], steps: list, nonfinite: list[str]) -> None:
    end = max(rows[-1]["step"] for rows in by.values())
    stuck = {}
    for name, rows in by.items():
        if name in nonfinite:
            continue
        zero = rows[-1]["b_norm"] == 0
        last = _last_change(rows)
        since = rows[0]["step"] if zero or last is None else last  # zero: it never left its initial value
        if end - since >= STILL_AFTER:
            stuck[name] = ("still exactly zero" if zero else "unchanged", since)
    if not stuck:
        return
    since = min(s for _, s in stuck.values())
    window = [r for rows in (by[n] for n in stuck) for r in rows if r["step"] >= since]
    span = [s for s in steps if s.step >= since]
    if span and all(s.skipped for s in span):
        why = f"every step from {since} on was skipped ({sum(s.found_inf for s in span)} overflowed)"
        cause = "every_step_skipped"
    elif any(not math.isfinite(r["grad_amax"]) for r in window):
        why = ("their gradients were inf/NaN (an FP16 overflow upstream, in the frozen base, reaches every adapter; "
               "a clipped or applied step then does nothing useful)")
        cause = "nonfinite_grads"
    elif all(r["grad_amax"] == 0 for r in window):
        why = "every adapter gradient was exactly zero: FP16 flushed the gradients flowing into them"
        cause = "flushed"
    else:
        why = "their gradients were finite and non-zero: look at the learning rate and the optimizer's parameters"
        cause = "unknown"
    kinds = sorted({k for k, _ in stuck.values()})
    b.find("adapters_not_training", "problem", f"{len(stuck)} of {len(by)} LoRA adapters did not train: lora_B "
           f"{' or '.join(kinds)} from step {since} to {end} (first: {next(iter(stuck))}); {why}",
           adapters=sorted(stuck), since=since, cause=cause)


def _flushed(b: _Builder, d: Diagnosis, census: list[dict], hist: list[dict]) -> None:
    """What FP16 flushed of the adapters' gradients at the run's scale: the FP32 replay rows (grads fp32)."""
    rows = [r for r in census if r["source"] == ADAPTER and r["layer"] == "__total__" and r["grads"] == "fp32"]
    if not rows:
        return
    nonzero = sum(r["total"] - r["zero"] for r in rows)
    share = sum(r["underflow"] for r in rows) / nonzero if nonzero else 0.0
    from lab.diagnose.underflow import FLUSH_MATERIAL
    if share <= FLUSH_MATERIAL:
        return
    scale = rows[-1]["at_scale"]
    keep = _keeping_scale([h for h in hist if h["source"] == ADAPTER], scale)
    advice = (f"; a loss scale of {fmt_scale_value(keep)} keeps {KEEP_SHARE:.1%} of them (grad_hist)"
              if keep is not None else "")
    b.find("adapter_grads_flushed", "warning", f"FP16 at scale {fmt_scale(scale)} flushed {_pct(share)} of the "
           f"adapters' non-zero gradient values to zero (FP32 replay of {len(rows)} census steps){advice}",
           share=share, scale=scale, keep_scale=keep)
    if keep is not None:
        b.recommend("raise_scale", f"Raise the loss scale to {fmt_scale_value(keep)} (or dynamic scaling from there)",
                    f"at scale {fmt_scale(scale)} FP16 flushed {_pct(share)} of the adapter gradients",
                    "adapter_grads_flushed", change={"scale": keep})


def _keeping_scale(hist: list[dict], scale: float) -> float | None:
    """The power of two times ``scale`` that lifts all but (1 - KEEP_SHARE) of the histogram's values to 2^-24 or
    more (FP16's smallest subnormal): bins count |x| in [2^k, 2^(k+1)) at the scale the histogram was taken."""
    counts: dict[int, int] = {}
    for h in hist:
        if h["at_scale"] == scale:
            counts[h["k"]] = counts.get(h["k"], 0) + h["count"]
    total = sum(counts.values())
    if not total:
        return None
    below, k_keep = 0, None
    for k in sorted(counts):
        if below + counts[k] > (1 - KEEP_SHARE) * total:
            k_keep = k
            break
        below += counts[k]
    return scale * 2.0 ** max(0, -24 - k_keep)
