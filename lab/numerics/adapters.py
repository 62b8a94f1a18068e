"""LoRA adapters as their own subject: per adapter, every ``log_every`` steps, the norms of lora_A and lora_B, how far
lora_B moved since the previous row, and the step's unscaled adapter gradients (largest magnitude and mean absolute
value, the source study's `track_lora_grad`) -> adapters.csv in the run folder.

Why: an adapter can fail to train while the loss looks normal. lora_B starts at exactly zero; if every step is
skipped, or its gradients are NaN and clipped away, or flushed to zero by FP16, it stays zero (or unchanged) for
thousands of steps (`lab diagnose` reads this file: lab/diagnose/adapters.py). Also written: a row at each step that
applied an overflowing gradient. The values stay on the device and come to the host in one transfer per
``log_every`` steps, with the step log's.
"""
from __future__ import annotations

from pathlib import Path

import torch

COLUMNS = ["step", "adapter", "b_norm", "a_norm", "b_change", "b_nonzero", "grad_amax", "grad_mean_abs"]
FILE = "adapters.csv"


def is_adapter(name: str) -> bool:
    """A parameter or module name that belongs to a LoRA adapter (peft names them lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def lora_pairs(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]]:
    """(adapter name, lora_A weight, lora_B weight) of every LoRA adapter peft put in ``model``."""
    pairs = []
    for name, module in model.named_modules():
        a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if isinstance(a, torch.nn.ModuleDict) and isinstance(b, torch.nn.ModuleDict):
            for key in a.keys() & b.keys():
                label = name.removeprefix("base_model.model.") + ("" if key == "default" else f"[{key}]")
                pairs.append((label, a[key].weight, b[key].weight))
    return sorted(pairs, key=lambda p: p[0])


class AdapterLog:
    """Observe the adapters of ``model`` at each ``every``-th step (call :meth:`observe` after the optimizer step,
    before zero_grad); :meth:`flush` brings the rows to the host, :meth:`write` writes adapters.csv."""

    def __init__(self, model: torch.nn.Module, every: int):
        self.pairs = lora_pairs(model)
        self.every = every
        self.rows: list[dict] = []
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.previous = [b.detach().clone() for _, _, b in self.pairs]

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def observe(self, step: int, applied_overflow: bool = False) -> None:
        """Every ``every``-th step, and on a step that applied an overflowing gradient (a policy that does not
        skip): that is when lora_B can turn inf/NaN, and a run whose loss then goes NaN ends before the next row."""
        if not self.pairs or (step % self.every and not applied_overflow):
            return
        with torch.no_grad():
            values = []
            for i, (_, a, b) in enumerate(self.pairs):
                grads = [g for g in (a.grad, b.grad) if g is not None]
                if grads:
                    flat = torch.cat([g.detach().float().flatten() for g in grads])
                    amax, mean_abs = flat.abs().max(), flat.abs().mean()
                else:  # no gradient this step (none computed): zeros, as the optimizer saw them
                    amax = mean_abs = torch.zeros((), device=b.device)
                values.append(torch.stack([b.float().norm(), a.float().norm(), (b - self.previous[i]).float().norm(),
                                           (b != 0).float().mean(), amax.float(), mean_abs.float()]))
                self.previous[i] = b.detach().clone()
            self.pending.append((step, torch.stack(values)))

    def flush(self) -> None:
        if not self.pending:
            return
        values = torch.stack([v for _, v in self.pending]).tolist()  # one transfer
        for (step, _), per_adapter in zip(self.pending, values):
            for (name, _, _), v in zip(self.pairs, per_adapter):
                self.rows.append(dict(zip(COLUMNS, [step, name, *v])))
        self.pending.clear()

    def metrics(self) -> dict:
        """metrics.json's view of the log: ``adapter_grad_mean_abs``, the mean over the regular rows (every
        ``every``-th step) and adapters of the step's mean absolute unscaled adapter gradient (the source study's
        `track_lora_grad` number, "below 1e-6"), and ``adapter_grad_amax``, the largest; None before any row."""
        self.flush()
        rows = [r for r in self.rows if r["step"] % self.every == 0]
        if not rows:
            return {"adapter_grad_mean_abs": None, "adapter_grad_amax": None}
        return {"adapter_grad_mean_abs": sum(r["grad_mean_abs"] for r in rows) / len(rows),
                "adapter_grad_amax": max(r["grad_amax"] for r in rows)}

    def write(self, run_dir: str | Path) -> None:
        from lab.core import files
        self.flush()
        files.atomic_write_csv(Path(run_dir) / FILE, self.rows, COLUMNS)

    def state_dict(self) -> dict:
        self.flush()
        return {"rows": list(self.rows), "previous": [t.cpu() for t in self.previous]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = list(state["rows"])
        self.previous = [t.to(b.device, b.dtype) for t, (_, _, b) in zip(state["previous"], self.pairs)]
