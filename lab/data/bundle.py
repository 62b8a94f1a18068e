"""What every data set loads into (a DataBundle) and the error its loaders raise (DataError): a module of their
own, below the loaders (datasets.py, tokens.py), so that a loader builds a bundle without importing another."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the loaders that make the datasets: the CLI imports tokens.py light
    from torch.utils.data import Dataset


class DataError(ValueError):
    """Missing or malformed data; the message names the offending path or value."""


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int          # classes, or the vocabulary size of a language model
    in_chans: int             # image channels (0 for text)
    name: str
    description: str
    input_size: int = 0       # image side in pixels, or a language model's context in tokens
    task: str = "classify"    # "classify" (one label per sample) or "lm" (a label per token)
    provenance: dict | None = None  # what the run's provenance.json records of the data (token files: hashes)
    # (mean, std) per channel where the loader hands uint8 images (4x fewer bytes to copy to a GPU than float32)
    # that `prepare` normalises on the device (ImageNet); None: the batches arrive ready
    normalize_on_device: tuple | None = None
    _stats: dict = field(default_factory=dict, repr=False, compare=False)  # prepare's mean and std, per device

    def prepare(self, x):
        """A batch on its device, as the model takes it: uint8 images to normalised FP32; anything else as is."""
        if self.normalize_on_device is None or x.dtype.is_floating_point or self.task == "lm":
            return x
        if x.device not in self._stats:  # once per device, not a host-to-device copy every batch
            import torch
            self._stats[x.device] = tuple(torch.tensor(v, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
                                          for v in self.normalize_on_device)
        mean, std = self._stats[x.device]
        return (x.float().div_(255.0) - mean) / std
