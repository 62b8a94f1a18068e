"""One training run, (model, mode, seed) -> a run directory: train.py (builds and writes the run), loop.py (epochs,
micro-batches, the scaled step), parts.py (its building blocks), rundir.py (step log, checks, resume),
checkpoint.py, finished.py, faults.py (planted inf/NaN) and distributed.py (torchrun/DDP).
Imports lab.core, lab.numerics, lab.scaling, lab.models and lab.data; never study, report or diagnose."""
