"""Unpickling a CIFAR-10 batch file without trusting it.

The official "python version" batches are pickles (as torchvision reads them): a dict of bytes, lists, ints
and one NumPy uint8 array. A pickle can name any importable callable and have it called while it loads, so
a file in a data folder could run code. :func:`load_batch` resolves only the few globals such a batch needs
(a NumPy array and its dtype, and Python 3's way to pickle bytes at protocol 2) and refuses any other before
it is called.
"""
from __future__ import annotations

import codecs
import pickle

import numpy as np

try:  # NumPy 2 moved its internals to numpy._core; files written by NumPy 1 name numpy.core
    from numpy._core import multiarray, numeric
except ImportError:  # NumPy 1
    from numpy.core import multiarray, numeric


class ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle names a global that no CIFAR-10 batch needs; ``name`` is ``module.qualname``."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


ALLOWED = {
    **{(f"{core}.multiarray", "_reconstruct"): multiarray._reconstruct for core in ("numpy.core", "numpy._core")},
    **{(f"{core}.numeric", "_frombuffer"): numeric._frombuffer for core in ("numpy.core", "numpy._core")},  # protocol 5
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,  # bytes pickled by Python 3 at protocol 2; codecs are data transforms
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise ForbiddenGlobal(f"{module}.{name}") from None


def load_batch(handle):
    """The object pickled in ``handle`` (a binary file); :class:`ForbiddenGlobal` for any other global.

    ``encoding="bytes"``: the official batches were pickled by Python 2, and this keeps their keys as b"..."."""
    return _BatchUnpickler(handle, encoding="bytes").load()
