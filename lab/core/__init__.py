"""The bottom layer, which every other package uses: files.py (atomic writes, provenance, digests, CPU facts),
runfiles.py (a run directory's CSV, JSON and YAML files read back: one reader per format, a damaged file refused
in one line naming it), config.py (a study's configuration: the schema in schemas/, validation, one run's
settings), errors.py (ConfigError), fault_spec.py (planted faults' format and checks, which validation and a run
share), lock.py (an OS lock that dies with its process) and fp16.py (FP16's limits and rounding bounds from
torch.finfo, and the per-tensor maxima the census, the engine and a recording take). Imports no other lab package
at module level; config's validation reaches the registries above it (data, models, scaling) only inside the
functions that check against them, and none of those imports config back (tests/test_imports.py: no import cycle
between modules)."""
