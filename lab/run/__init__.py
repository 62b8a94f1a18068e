"""One training run, (model, mode, seed) -> a run directory: train.py (builds and writes the run), loop.py (epochs,
micro-batches, the scaled step), its building blocks process.py (device, seeds, FP32/determinism switches), optim.py
(optimizer, schedule), evaluation.py (the loss, evaluation) and memory.py (memory measures; the precision's forward
context is lab/numerics/precision.py), rundir.py (step log, checks, resume), checkpoint.py, finished.py, faults.py
(planted inf/NaN) and distributed.py (torchrun/DDP); parts.py: the old building blocks' names, deprecated.
Imports lab.core, lab.numerics, lab.scaling, lab.models and lab.data; never study, report or diagnose."""
