"""TensorBoard event files from finished runs (`python -m lab tensorboard RUN_DIR... --out results/tensorboard`).

A separate step after training, so training jobs never import TensorBoard. Each run becomes
<out>/<model>/<mode>/seed<n>/ holding one event file with, per optimizer step, the scalars
  loss          training loss
  loss_scale    the loss scale the step used
  grad_norm     unscaled gradient norm (inf/nan on overflow steps)
  skip_count    skipped steps so far (cumulative)
  update_ratio  applied steps / steps so far (running)
  lr            learning rate
and at the last step val/final_top1, val/best_top1 plus a text summary of metrics.json.
`tensorboard --logdir results/tensorboard` then compares runs side by side (run names are model/mode/seedN).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from lab.core import runfiles
from lab.report import load as R

STEP_SCALARS = {"loss": "loss", "loss_scale": "scale", "grad_norm": "grad_norm", "skip_count": "skip_count",
                "update_ratio": "update_ratio", "lr": "lr"}
METRIC_SCALARS = {"val/final_top1": "final_top1", "val/best_top1": "best_top1"}


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write one run's event file under `out`; replaces the event files a previous export left there."""
    # tensorboard's own writer: a fraction of a second to import (torch.utils.tensorboard pulls in torch)
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.text.summary_v2 import text_pb
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    run_dir = Path(run_dir)
    ident = R.run_identity(run_dir)
    target = R.tensorboard_dir(out, ident["model"], ident["mode"], ident["seed"])
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob("events.out.tfevents.*"):
        old.unlink()
    steps = R.load_steps(run_dir)
    metrics_path = run_dir / "metrics.json"
    metrics = runfiles.read_json(metrics_path) if metrics_path.is_file() else {}
    now = time.time()

    def event(step: int, summary) -> Event:
        return Event(wall_time=now, step=step, summary=summary)

    def scalars(values: dict) -> Summary:
        return Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])

    writer = EventFileWriter(str(target), flush_secs=3600)
    try:
        columns = {tag: col for tag, col in STEP_SCALARS.items() if col in steps}
        for row in steps[["step", *columns.values()]].itertuples(index=False):
            step = int(row[0])
            writer.add_event(event(step, scalars({tag: row[i + 1] for i, tag in enumerate(columns)})))
        last = int(steps["step"].max()) if len(steps) else 0
        final = {tag: metrics[key] for tag, key in METRIC_SCALARS.items()
                 if isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key])}
        if final:
            writer.add_event(event(last, scalars(final)))
        if metrics:
            lines = ["| metric | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in metrics.items() if not isinstance(v, (dict, list))]
            writer.add_event(event(last, text_pb("metrics", "\n".join(lines))))
    finally:
        writer.close()
    return target


def export(sources, out: str | Path) -> list[Path]:
    """Export every run under `sources` (run directories or results folders, see lab.report.load)."""
    dirs = R.run_dirs(sources)
    if not dirs:
        raise FileNotFoundError(f"no run directories (with steps.csv) under {', '.join(map(str, sources))}")
    return [export_run(d, out) for d in dirs if (d / "steps.csv").is_file()]


def read_scalars(event_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of an event folder as {tag: [(step, value), ...]} (for tests and quick checks)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
