#!/usr/bin/env bash
# The lab's CUDA check: one prepared script for a session that is lent a GPU (the device tool's 15 minutes
# cover every call together, the machine's start included). Never run in CI.
#
# The GPU machine has PyTorch, timm, pandas, matplotlib, PyYAML and pytest but not jsonschema. Once, from
# the repository root on the development machine:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     jsonschema referencing jsonschema-specifications rpds-py
# then with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540).
# What it measured comes back from $OUT (at most 8 files): commit it under results/benchmarks/.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__,
torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

# 1. Every CUDA case of the tests: census exactness on CUDA tensors, the tally without host syncs (histc and,
#    under deterministic algorithms, index_put), hooks, attribution by replay, a CUDA autocast training run.
timeout 120 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_numerics.py tests/test_monitor.py \
  tests/test_scaling_engine.py 2>&1 | tee "$OUT/tests_cuda.txt"

# 2. Overheads on the GPU, each a ratio measured side by side in one process.
timeout 90 python3 benchmarks/bench_census.py --device cuda --rounds 9 --out "$OUT/census_cuda.json" 2>&1 | tail -4
timeout 45 python3 benchmarks/bench_attribution.py --device cuda --rounds 7 --out "$OUT/attribution_cuda.json" \
  2>&1 | tail -3
timeout 60 python3 benchmarks/bench_scaler.py --device cuda --out "$OUT/scaler_cuda.json" 2>&1 | tail -4

# 3. The default study's models, FP32 and FP16 with dynamic scaling, one seed each, on CUDA autocast.
#    (Every step has its own timeout; together at most 525 s, inside one call's 600.)
runs=()
for model in resnet50 mobilenetv2 vit; do
  for mode in fp32 fp16-dynamic; do
    out=/tmp/runs/$model/$mode/seed0
    timeout 35 python3 -m lab train --model $model --mode $mode --seed 0 --out $out --set device=cuda \
      2>&1 | tail -1
    [ -f "$out/metrics.json" ] && runs+=("$out")  # a run cut off by its timeout has none
  done
done
python3 -m lab aggregate "${runs[@]}" --csv "$OUT/summary_cuda.csv" --md "$OUT/summary_cuda.md" 2>&1 | tail -2
cat "$OUT/summary_cuda.md" 2>/dev/null
