#!/usr/bin/env bash
# The lab's CUDA check (issue 40): one prepared run of at most 8 minutes on one GPU, on the machine's own PyTorch
# (2.11 or later), for a session that is lent one (the device tool's 15 minutes cover every call, the start too).
#
#   bash benchmarks/gpu_check.sh               # on the GPU machine: everything below, on CUDA
#   bash benchmarks/gpu_check.sh --rehearse    # on a CPU: every step at tiny size (tests/test_gpu_check.py)
#
# The GPU machine has torch, torchvision, timm, pandas, PyYAML, PIL and pytest but not jsonschema (field notes
# section 9). Once, from the repository root on the development machine:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     jsonschema referencing jsonschema-specifications rpds-py
# then with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540).
#
# In order, each step under a timeout cut to what is left of the budget (GPU_CHECK_BUDGET_S, 450 s):
#   1. the device-parametrised tests (-k cuda) under torch.cuda.set_sync_debug_mode("warn");
#   2. the CPU contract against CUDA's GEMMs, in ulps, cuBLAS reduced-precision reductions off and on;
#   3. the LM's evaluation peak memory (GPT-2 small's shape) against lab/run/sizing.py's prediction;
#   4. the study's CUDA path on a tiny config (benchmarks/gpu_check.yaml): lab train with two seeds forked from
#      one process, per (model, mode), then lab aggregate;
#   5. the ImageNet loader's throughput on a synthetic JPEG folder;
#   6. full-size throughput: ResNet-50 channels_last, as DeepLearningExamples measures it (FP32, TF32, FP16, BF16).
# Everything measured is written into $OUT (8 files): copy them into results/reference/<gpu>/ and commit them.
set -u
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "$REHEARSE" = 1 ]; then
  DEV=cpu BUDGET_S=${GPU_CHECK_BUDGET_S:-400}
else
  DEV=cuda BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
fi

# step SECONDS CMD...: run CMD under `timeout`, the limit cut to what is left of the budget
step() {
  local want=$1 left=$((BUDGET_S - SECONDS))
  shift
  if [ "$left" -lt 5 ]; then
    echo "SKIPPED (budget of ${BUDGET_S} s spent): $*"
    return 124
  fi
  timeout $((want < left ? want : left)) "$@"
}

if [ -d .whl ] && [ "$REHEARSE" = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}"

# 0. Fail fast: what every step imports, torch 2.11 or later, and (not rehearsing) a GPU.
$PY - "$DEV" <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib.util, sys
device = sys.argv[1]
missing = [m for m in ("torch", "torchvision", "timm", "yaml", "jsonschema", "pandas", "numpy", "PIL", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing imports {missing} (jsonschema: carry .whl, see the header)")
import torch, timm
major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 11):
    sys.exit(f"gpu_check: torch {torch.__version__}; the lab needs 2.11 or later")
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (use --rehearse on a CPU)")
name = torch.cuda.get_device_name() if device == "cuda" else "cpu (rehearsal)"
print("torch", torch.__version__, "cuda", torch.version.cuda, "timm", timm.__version__, "device", name)
sys.path.insert(0, "benchmarks")
import bench_throughput
print("results folder: results/reference/" + (bench_throughput.gpu_slug(name) if device == "cuda" else "rehearsal"))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 3

# 1. The device-parametrised tests: the engine's GradScaler parity, call order, clipping, accumulation and one
#    host read per step (amax-history and deepspeed among the policies), lab train's tiny runs with census and
#    attribution, the recorder, the contract's CUDA test; every synchronisation warned about.
if [ "$REHEARSE" = 1 ]; then SELECT="cpu and one_host_sync_per_step and amax"; else SELECT=cuda; fi
LAB_CUDA_SYNC_DEBUG=warn step 150 $PY -m pytest -q -n 0 -p no:cacheprovider -k "$SELECT" tests/test_scaling_engine.py \
  tests/test_train.py tests/test_numerics.py tests/test_monitor.py tests/test_fp16_cpu.py 2>&1 | tail -25 \
  | tee "$OUT/tests.txt"

# 2. The contract against CUDA's kernels, in ulps.
if [ "$REHEARSE" = 1 ]; then SIZES=64,512; else SIZES=64,1024,16384,65536; fi
step 40 $PY benchmarks/contract_vs_cuda.py --device $DEV --sizes $SIZES --out "$OUT/contract_ulps.json" | tail -2

# 3. The LM's evaluation peak memory.
step 60 $PY benchmarks/eval_memory.py --device $DEV $([ "$REHEARSE" = 1 ] && echo --tiny) \
  --out "$OUT/eval_memory.json" | tail -2

# 4. The study's CUDA path, tiny: two seeds forked per job, then the summary.
RUNS=$(mktemp -d /tmp/gpu_check_runs.XXXX)

for model in resnet50 lm; do
  for mode in fp32 fp16-dynamic; do
    step 60 $PY -m lab train --config benchmarks/gpu_check.yaml --model $model --mode $mode --seed 0 --seed 1 \
      --out "$RUNS/$model/$mode/seed{seed}" --set device=$DEV $([ "$REHEARSE" = 1 ] && echo --set train.max_steps=6) \
      2>&1 | tail -1
  done
done
step 30 $PY -m lab aggregate "$RUNS"/*/*/seed* --csv "$OUT/summary_tiny.csv" --md /tmp/gpu_check_summary.md 2>&1 | tail -2

# 5. The loader on a synthetic JPEG folder.
if [ "$REHEARSE" = 1 ]; then LOADER="--images 64 --workers 2 --size 32 --batch 16"; else LOADER="--images 4096"; fi
step 90 $PY benchmarks/bench_loader.py --device $DEV $LOADER --out "$OUT/loader.json" | tail -1

# 6. Full-size throughput, ResNet-50 channels_last (the JSON and its CSV are written after every measurement).
if [ "$REHEARSE" = 1 ]; then THROUGHPUT="--tiny --precisions fp16"; else THROUGHPUT="--budget-s 80"; fi
step 120 $PY benchmarks/bench_throughput.py --device $DEV $THROUGHPUT --models resnet50 --channels-last \
  --out "$OUT/throughput.json" 2>&1 | tail -8

echo "gpu_check: ${SECONDS} s of ${BUDGET_S}" | tee -a "$OUT/env.txt"
ls "$OUT"
