"""The bottom layer, which every other package uses: files.py (atomic writes, provenance, digests, CPU facts),
config.py (a study's configuration: the schema in schemas/, ConfigError, validation, one run's settings), lock.py
(an OS lock that dies with its process) and fp16.py (FP16's limits and rounding bounds from torch.finfo, and the
per-tensor maxima the census, the engine and a recording take). Imports no other lab package at module level;
config's validation reaches the registries above it (data, models, scaling, run.faults) only inside the functions
that check against them."""
