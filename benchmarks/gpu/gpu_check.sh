#!/usr/bin/env bash
# The lab's first GPU run: one prepared command of at most 8 minutes on one GPU, on the machine's own
# PyTorch (2.11 or later), for a session that is lent one (the device tool's 15 minutes cover every call, its start too).
#
#   bash benchmarks/gpu/gpu_check.sh               # on the GPU machine: everything below, on CUDA
#   bash benchmarks/gpu/gpu_check.sh --rehearse    # on a CPU: every step at tiny size (tests/test_gpu_check.py)
#
# Before the call, from the repository root here: `bash benchmarks/gpu/gpu_carry.sh` (jsonschema's wheels and this Python's
# pydoc_data, the LM's corpus, into .gpu_carry/; torchao's wheel for step 6), commit, then with the device tool:
#   run(command="GPU_CHECK_COMMIT=<git rev-parse HEAD> bash benchmarks/gpu/gpu_check.sh", carry=[".gpu_carry"], timeout_s=560)
# and unpack $OUT/gpu_check.tar into results/reference/<gpu>/ (the folder step 0 names); commit it.
#
# In order, each step under a timeout cut to what is left of the budget (GPU_CHECK_BUDGET_S, 460 s), its files packed
# into $OUT/gpu_check.tar as soon as it ends (so a call killed at its limit keeps every finished step), the output in
# $OUT/log.txt:
#   1. the CPU contract against cuBLAS and cuDNN, in ulps, for the lab's op shapes, reduced-precision reductions off
#      and on (benchmarks/gpu/contract_vs_cuda.py);
#   2. the device-parametrised tests (-k cuda), every host synchronisation warned about;
#   3. the flagship verdict on real FP16: the default study's LM family (gpt-tiny, emulated accumulation 32, 300 steps)
#      under fp32, fp16-noscale and fp16-dynamic, its 6 fresh seeds 12-17, trained by `lab train` (three jobs at once,
#      each starting its seeds in fresh interpreters, as a CUDA job does), `lab aggregate`d, beside the CPU study's;
#   4. full-size throughput, ResNet-50 channels_last batch 256 as DeepLearningExamples measures it: FP32, TF32, FP16
#      with torch.amp.GradScaler and with the lab's dynamic scaler (their step-time ratio), a census step's cost, BF16;
#   5. the RL sampler/learner mismatch on native CUDA fp16 and bf16, beside the CPU contract's emulation;
#   6. FP8: the lab's emulated FP8 GEMMs (tensorwise, rowwise) against torch._scaled_mm, in ulps,
#      at the lab's shapes and a K sweep to 8192; torchao's FP8 training step (tensorwise, rowwise) against BF16 on the
#      lab's GPT (benchmarks/gpu/fp8_vs_scaled_mm.py; torchao's wheel comes in .gpu_carry, or the step time is skipped
#      with the reason);
#   7. what is left: the LM's evaluation peak memory against lab/run/sizing.py's, ResNet-50's lab train path on CUDA
#      (two seeds, one job), the ImageNet loader on a synthetic JPEG folder.
set -u -o pipefail
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check_work.XXXX)   # what comes back, packed after every step
RUNS=$(mktemp -d /tmp/gpu_check_runs.XXXX)   # training runs (checkpoints stay here)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "$REHEARSE" = 1 ]; then
  DEV=cpu BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
else
  DEV=cuda BUDGET_S=${GPU_CHECK_BUDGET_S:-460}
fi
exec > >(tee -a "$OUT/log.txt") 2>&1

# step SECONDS CMD...: run CMD under `timeout`, the limit cut to what is left of the budget; a failure (124: its time
# ran out) is named in failed.txt, and the steps after it still run
step() {
  local want=$1 left=$((BUDGET_S - SECONDS)) rc=0
  shift
  if [ "$left" -lt 5 ]; then
    echo "SKIPPED (budget of ${BUDGET_S} s spent): $*" | tee -a "$WORK/failed.txt"
    return 124
  fi
  timeout -k 15 $((want < left ? want : left)) "$@" || rc=$?  # -k: a run that ignores SIGTERM is killed 15 s on
  [ "$rc" = 0 ] || echo "FAILED (exit status $rc): $*" | tee -a "$WORK/failed.txt"
  return $rc
}

# pack NAME: the files so far into $OUT/gpu_check.tar (whole, or the previous one stays)
pack() {
  echo "== $1 done at ${SECONDS} s"
  tar -cf "$OUT/gpu_check.tar.part" -C "$WORK" . && mv -f "$OUT/gpu_check.tar.part" "$OUT/gpu_check.tar"
}

if [ -d .gpu_carry ] && [ "$REHEARSE" = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu_carry/whl/*.whl && export PYTHONPATH=/tmp/site
  # the committed CPU study's corpus: pydoc_data from its Python, ahead of this Python's own
  export PYTHONPATH="$PWD/.gpu_carry:${PYTHONPATH:-}"
  # torchao, for step 6 only (its own folder: a wheel this machine refuses costs step 6's step time, nothing else)
  if ls .gpu_carry/whl_fp8/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fp8 \
      .gpu_carry/whl_fp8/*.whl || echo "gpu_check: torchao's wheel not installed; step 6 records its step time as skipped"
  fi
fi
export PYTHONPATH=".:${PYTHONPATH:-}"
# the commit every run's provenance records where the copy of the tree has no .git (lab/core/files.py git_commit)
[ -n "${GPU_CHECK_COMMIT:-}" ] && export LAB_GIT_COMMIT=$GPU_CHECK_COMMIT

# 0. Fail fast: what every step imports, torch 2.11 or later, and (not rehearsing) a GPU; what ran where.
$PY - "$DEV" "${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" <<'EOF' 2>&1 | tee "$WORK/env.txt"
import importlib.util, json, sys
device, commit = sys.argv[1:3]
missing = [m for m in ("torch", "torchvision", "timm", "yaml", "jsonschema", "pandas", "numpy", "PIL", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing imports {missing} (jsonschema: bash benchmarks/gpu/gpu_carry.sh, carry .gpu_carry)")
import torch, timm
major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 11):
    sys.exit(f"gpu_check: torch {torch.__version__}; the lab needs 2.11 or later")
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (use --rehearse on a CPU)")
name = torch.cuda.get_device_name() if device == "cuda" else "cpu (rehearsal)"
print("commit", commit)
print("torch", torch.__version__, "cuda", torch.version.cuda, "timm", timm.__version__, "device", name)
from lab.data.text import corpus_provenance
print("LM corpus", json.dumps(corpus_provenance("pydoc", None)))
sys.path.insert(0, "benchmarks/speed")
import bench_throughput
print("results folder: results/reference/" + (bench_throughput.gpu_slug(name) if device == "cuda" else "rehearsal"))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 3
[ "$REHEARSE" = 0 ] && nvidia-smi >> "$WORK/env.txt" 2>&1
pack "0 env"

# 1. The contract against CUDA's kernels, in ulps.
if [ "$REHEARSE" = 1 ]; then SIZES=64,512; else SIZES=64,1024,16384,65536; fi
step 45 $PY benchmarks/gpu/contract_vs_cuda.py --device $DEV --sizes $SIZES --out "$WORK/contract_ulps.json" | tail -30
pack "1 contract"

# 2. The device-parametrised tests: the engine's GradScaler parity, call order, clipping, accumulation and one host read
#    per step, lab train's tiny runs with census and attribution, the census's sync-free counting, autocast on CUDA
#    (-o addopts="": the repository's xdist options, which an older pytest-xdist would refuse, are not needed here).
if [ "$REHEARSE" = 1 ]; then SELECT="cpu and one_host_sync_per_step and amax"; else SELECT=cuda; fi
LAB_CUDA_SYNC_DEBUG=warn step 110 $PY -m pytest -o addopts="" -q -p no:cacheprovider -rw -k "$SELECT" \
  tests/test_scaling_engine.py tests/test_train.py tests/test_numerics.py tests/test_monitor.py tests/test_fp16_cpu.py \
  tests/test_autocast.py > "$WORK/tests.txt" 2>&1
tail -15 "$WORK/tests.txt"
pack "2 tests"

# 3. The flagship verdict: the LM family's regime on real FP16, three jobs at once, then the summary beside the CPU's.
if [ "$REHEARSE" = 1 ]; then
  # the seeds start as they will on CUDA: each in a fresh interpreter (lab/run/jobs.py start_method)
  export LAB_JOB_START=spawn
  LM_SEEDS="--seed 12 --seed 13" LM_SET="--set train.max_steps=8 --set train.census_every=4" LM_THREADS=1
else
  LM_SEEDS="--seed 12 --seed 13 --seed 14 --seed 15 --seed 16 --seed 17" LM_SET="" LM_THREADS=4
fi
jobs_started=()
for mode in fp32 fp16-noscale fp16-dynamic; do
  step 170 $PY -m lab train --config configs/default.yaml --model lm --mode $mode $LM_SEEDS --threads $LM_THREADS \
    --out "$RUNS/lm/$mode/seed{seed}" --set device=$DEV $LM_SET > "$WORK/lm_train_$mode.log" 2>&1 &
  jobs_started+=($!)
done
wait "${jobs_started[@]}"
grep -h "status" "$WORK"/lm_train_*.log | tail -18
# the finished runs only (a job stopped at its limit leaves its last seed's folder without metrics.json)
finished() { for m in "$@"; do [ -f "$m/metrics.json" ] && echo "$m"; done; }
step 40 $PY -m lab aggregate $(finished "$RUNS"/lm/*/seed*) --declared configs/claims.yaml --csv "$WORK/lm_summary.csv" \
  --md "$WORK/lm_summary.md" > "$WORK/lm_aggregate.log" 2>&1
step 20 $PY benchmarks/gpu/lm_cuda_vs_cpu.py "$WORK/lm_summary.csv" --out "$WORK/lm_cuda_vs_cpu.md"
tar -cf - --exclude='*.pt' --exclude='.lock' -C "$RUNS" lm | tar -xf - -C "$WORK"
pack "3 LM verdict"

# 4. Full-size throughput, ResNet-50 channels_last (the JSON and its CSV are written after every measurement).
# BF16 before FP16: FP16's census blocks are the slowest part, and the budget must not skip BF16 for them
if [ "$REHEARSE" = 1 ]; then THROUGHPUT="--tiny --precisions fp32,fp16"; else
  THROUGHPUT="--budget-s 75 --precisions fp32,tf32,bf16,fp16"; fi
step 100 $PY benchmarks/speed/bench_throughput.py --device $DEV $THROUGHPUT --models resnet50 --channels-last \
  --out "$WORK/throughput.json" 2>&1 | tail -8
pack "4 throughput"

# 5. The RL sampler/learner mismatch, native CUDA against the CPU contract's emulation.
step 40 $PY benchmarks/gpu/rl_mismatch_cuda.py --device $DEV --out "$WORK/rl_mismatch.json" 2>&1 | tail -12
pack "5 RL mismatch"

# 6. FP8: the lab's emulated GEMMs against torch._scaled_mm, torchao's FP8 step against BF16 (torchao's C++ extensions
#    are not loaded: float8 training needs none, and a build for another torch must not stop the step).
PYTHONPATH="$PYTHONPATH:/tmp/site_fp8" TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 step 60 $PY benchmarks/gpu/fp8_vs_scaled_mm.py --device $DEV \
  $([ "$REHEARSE" = 1 ] && echo --tiny) --out "$WORK" 2>&1 | tail -11
pack "6 FP8"

# 7. What is left: evaluation memory, ResNet-50 through lab train on CUDA, the loader.
step 40 $PY benchmarks/gpu/eval_memory.py --device $DEV $([ "$REHEARSE" = 1 ] && echo --tiny) \
  --out "$WORK/eval_memory.json" | tail -2
pack "7a evaluation memory"
step 60 $PY -m lab train --config benchmarks/gpu/gpu_check.yaml --model resnet50 --mode fp16-dynamic --seed 0 --seed 1 \
  --out "$RUNS/resnet50/fp16-dynamic/seed{seed}" --set device=$DEV $([ "$REHEARSE" = 1 ] && echo --set train.max_steps=6) \
  2>&1 | tail -2
step 20 $PY -m lab aggregate $(finished "$RUNS"/resnet50/*/seed*) --csv "$WORK/resnet50_tiny.csv" --md /tmp/gpu_check_resnet50.md \
  2>&1 | tail -1
pack "7b resnet50 lab train"
if [ "$REHEARSE" = 1 ]; then LOADER="--images 64 --workers 2 --size 32 --batch 16"; else LOADER="--images 4096"; fi
step 45 $PY benchmarks/speed/bench_loader.py --device $DEV $LOADER --out "$WORK/loader.json" | tail -1
echo "gpu_check: ${SECONDS} s of ${BUDGET_S}; failed steps: $(cat "$WORK/failed.txt" 2>/dev/null | wc -l)" \
  | tee -a "$WORK/env.txt"
pack "7c loader"
ls "$WORK"
