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
# then with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=570).
# (Without .whl the CUDA tests that build a study config fail to import; bench_throughput.py needs no
# jsonschema.)
#
# The whole script stops itself after GPU_CHECK_BUDGET_S seconds (default 530, under 9 minutes): every step
# has its own timeout (together more than the budget), cut to what is left of the budget, and a step with
# under 5 s left is skipped and says so. Steps run in order of priority: the CUDA tests, the throughput
# reference, the overhead benchmarks, the short training runs (these get what is left).
#
# What it measured comes back from $OUT (8 files: the device tool returns at most 8): copy all of them into
# results/reference/<gpu>/ (the script prints the folder name, e.g. nvidia-h200) and commit them there;
# results/reference/README.md says what each file is.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
RESERVE=0  # seconds kept back for the steps after the current group

# step SECONDS CMD...: run CMD under `timeout`, the limit cut to what is left of the script's budget
step() {
  local want=$1 left=$((BUDGET_S - RESERVE - SECONDS))
  shift
  if [ "$left" -lt 5 ]; then
    echo "SKIPPED (budget of ${BUDGET_S} s spent): $*"
    return 124
  fi
  timeout $((want < left ? want : left)) "$@"
}

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}"
GPU_SLUG=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import torch, bench_throughput as b
print(b.gpu_slug(torch.cuda.get_device_name()))" 2>/dev/null || echo unknown-gpu)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), 'timm', timm.__version__, torch.cuda.get_device_name())"
  echo "results folder: results/reference/$GPU_SLUG/"
} 2>&1 | tee "$OUT/env.txt"

# 1. Every CUDA case of the tests: census exactness on CUDA tensors, the tally without host syncs (histc and,
#    under deterministic algorithms, index_put), hooks, attribution by replay, a CUDA autocast training run.
step 120 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_numerics.py tests/test_monitor.py \
  tests/test_scaling_engine.py 2>&1 | tee "$OUT/tests_cuda.txt"

# 2. The throughput reference (issue 11): resnet50, gpt2-small, vit_small, mobilenetv2_100 at full size x
#    FP32 (TF32 off), TF32, FP16 (GradScaler and the lab's scaler, A/B), BF16. It starts no new
#    measurement after 130 s and writes its JSON/CSV after every one, so a cut leaves what was measured.
step 170 python3 benchmarks/bench_throughput.py --device cuda --budget-s 130 --models resnet50,lm,vit,mobilenetv2 \
  --out "$OUT/throughput.json" 2>&1 | tail -30

# 3. Overheads on the GPU, each a ratio measured side by side in one process.
step 90 python3 benchmarks/bench_census.py --device cuda --rounds 9 --out "$OUT/census_cuda.json" 2>&1 | tail -4
step 45 python3 benchmarks/bench_attribution.py --device cuda --rounds 7 --out "$OUT/attribution_cuda.json" \
  2>&1 | tail -3
step 60 python3 benchmarks/bench_scaler.py --device cuda --out "$OUT/scaler_cuda.json" 2>&1 | tail -4

# 4. The default study's models, FP32 and FP16 with dynamic scaling, one seed each, on CUDA autocast.
runs=()
RESERVE=10  # for the aggregation
for model in resnet50 mobilenetv2 vit; do
  for mode in fp32 fp16-dynamic; do
    out=/tmp/runs/$model/$mode/seed0
    step 35 python3 -m lab train --model $model --mode $mode --seed 0 --out $out \
      --set device=cuda 2>&1 | tail -1
    [ -f "$out/metrics.json" ] && runs+=("$out")  # a run cut off by its timeout has none
  done
done
# 5. What train.deterministic costs on CUDA (docs/reliability.md): the same resnet50 fp16-dynamic run with
#    deterministic algorithms; its throughput_samples_per_s against the run of step 4.
out=/tmp/runs/resnet50/fp16-dynamic-deterministic/seed0
step 35 python3 -m lab train --model resnet50 --mode fp16-dynamic --seed 0 --out $out --set device=cuda \
  --set train.deterministic=true 2>&1 | tail -1
[ -f "$out/metrics.json" ] && python3 -c "import json; a, b = (json.load(open(p)) for p in ('$out/metrics.json',
'/tmp/runs/resnet50/fp16-dynamic/seed0/metrics.json')); print('deterministic / default throughput:',
a['throughput_samples_per_s'] / b['throughput_samples_per_s'])" 2>&1 | tee -a "$OUT/env.txt"
RESERVE=0
if [ ${#runs[@]} -gt 0 ]; then
  step 10 python3 -m lab aggregate "${runs[@]}" --csv "$OUT/summary_cuda.csv" --md /tmp/summary_cuda.md 2>&1 | tail -2
  cat /tmp/summary_cuda.md 2>/dev/null
fi
echo "gpu_check: ${SECONDS} s of ${BUDGET_S}; copy what came back into results/reference/$GPU_SLUG/"
ls "$OUT"
