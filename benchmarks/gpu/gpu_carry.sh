#!/usr/bin/env bash
# What benchmarks/gpu/gpu_check.sh needs on the GPU machine that the machine lacks, gathered here into .gpu_carry/
# (ignored by git; the device tool's `carry`):
#   .gpu_carry/whl/         jsonschema and its own needs, as CPython 3.12 manylinux wheels (the machine has no
#                           jsonschema and no package registry; field notes section 9)
#   .gpu_carry/whl_fp8/     torchao's wheel (step 6's FP8 training step time; a cp310-abi3 manylinux_2_24/2_28 wheel,
#                           its C++ extensions unused: float8 training runs on torch._scaled_mm), installed apart from
#                           the others so that a refusal costs that measurement only
#   .gpu_carry/pydoc_data/  this Python's pydoc_data package: the LM's corpus is the running Python's documentation,
#                           which differs between releases (the machine runs 3.12), so the CUDA runs read the text
#                           the committed CPU study read; gpu_check.sh puts it first on PYTHONPATH
# Run once per session from the repository root, with the study's Python (the venv's):
#   bash benchmarks/gpu/gpu_carry.sh
set -eu
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu_carry
mkdir -p .gpu_carry/whl
versions=$($PY - <<'PYEOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("jsonschema", "referencing", "jsonschema-specifications", "rpds-py")))
PYEOF
)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu_carry/whl $versions
mkdir -p .gpu_carry/whl_fp8
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .gpu_carry/whl_fp8 "torchao==$($PY -c 'from importlib.metadata import version; print(version("torchao"))')"
src=$($PY -c "import os, pydoc_data; print(os.path.dirname(pydoc_data.__file__))")
mkdir -p .gpu_carry/pydoc_data
cp "$src/__init__.py" "$src/topics.py" .gpu_carry/pydoc_data/
$PY -c "import platform; print(platform.python_version())" > .gpu_carry/pydoc_data/PYTHON_VERSION
ls .gpu_carry/whl .gpu_carry/whl_fp8 .gpu_carry/pydoc_data
du -sh .gpu_carry
