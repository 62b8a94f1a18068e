"""The bottom layer, which every other package uses: files.py (atomic writes, provenance, digests, CPU facts),
config.py (a study's configuration: the schema in schemas/, ConfigError, validation, one run's settings) and lock.py
(an OS lock that dies with its process). Imports no other lab package at module level; config's validation reaches
the registries above it (data, models, scaling, run.faults) only inside the functions that check against them."""
