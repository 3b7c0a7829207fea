#!/usr/bin/env bash
# The whole GPU check in one prepared run of at most 8 minutes (device time is short): every
# step has a time limit sized for cold compiles (a fresh machine compiles every flex graph
# and Triton kernel once: 10-40 s each), the most important steps come first, and a step
# is skipped once the budget is spent. Meant for the lent GPU machine, whose python3 has
# its own torch (it may differ from our pin), einops, pytest, hypothesis, torchvision,
# torchaudio and torch_geometric:
#
#   PYTHONPATH=$PWD bash benchmarks/gpu_check.sh   # logs and tables land in $OUT (or out/gpu)
#   DRY_RUN=1 bash benchmarks/gpu_check.sh         # print the steps only
#
# Without a CUDA device (this repository's CPU machines) it says so, runs the CPU logic
# check of benchmarks/gpu_engines.py (--device cpu --tiny) and exits 0.
#
# 1. (issue 40) the engines' CUDA tests: flex and varlen against the fallback, outputs and
#    gradients, graph counts, no host sync (tests/mmattn/kernels/test_engines*.py,
#    tests/mmattn/attention/test_sparse_engines.py);
# 2. (issues 34, 40) benchmarks/gpu_engines.py: every row of issue 34's table side by side
#    (mmattn, torch's varlen_attn itself, flex with a hand-written mask_mod and with
#    Pattern.mask_mod, each compiled apart from mmattn's, dense SDPA; EdgeAttention vs
#    TransformerConv), each output compared with the fallback's before its time is shown,
#    written into docs/performance.md ("GPU engines") after every case;
# 3. the rest of the CUDA tests (xdist -n 8 and a per-test timeout where those plugins are
#    installed);
# then, in whatever budget is left: benchmarks/gpu_patterns.py (issue 33), the examples
# interleaved_digits, multimodal_match and audio_stream with --device cuda --quick; bf16
# MultiHeadAttention vs SDPA and LocalAttention vs FlexAttention (benchmarks/gpu_attention.py);
# NeighborhoodAttention vs FlexAttention (benchmarks/gpu_neighborhood.py); packed vs padded
# (benchmarks/varlen.py, once it has a --device option); the attention core and adapters on
# CUDA; with more than one GPU, DDP / FSDP2 / SequenceParallel on NCCL
# (benchmarks/gpu_dist_check.py).
#
# Build and test everything on the CPU first; this script only adds what needs a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-out/gpu}
BUDGET=${BUDGET:-460}  # seconds for all steps together (the call: at most 8 minutes)
mkdir -p "$DEST"
status=0
start=$SECONDS

# step NAME LIMIT LOG COMMAND...: run with at most LIMIT seconds (less when the budget is
# nearly spent), log to $DEST/LOG, record failures; skip when under 20 s are left.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "== $name (limit ${limit}s, log $log): $*" | tee -a "$DEST/summary.txt"
    return
  fi
  local left=$((BUDGET - (SECONDS - start)))
  if ((left < 20)); then
    echo "== $name: skipped, time budget spent" | tee -a "$DEST/summary.txt"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$DEST/$log"
  local rc=${PIPESTATUS[0]}
  ((rc != 0)) && status=1
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$DEST/summary.txt"
}

if [[ -z ${DRY_RUN:-} ]] && ! $PY -c "import torch" 2>/dev/null; then
  echo "== $PY has no torch: nothing to check here (set PYTHON=... to a python with torch)" \
    | tee -a "$DEST/summary.txt"
  exit 0
fi
if [[ -z ${DRY_RUN:-} ]] && \
    ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no CUDA device here: the GPU steps are skipped; the CPU logic check of" \
    "benchmarks/gpu_engines.py runs instead" | tee -a "$DEST/summary.txt"
  step "gpu_engines.py logic check (cpu, tiny)" 400 gpu_engines_cpu.md \
    $PY benchmarks/gpu_engines.py --device cpu --tiny --only documents,local,per_modality
  echo "total $((SECONDS - start)) s, status $status (no GPU)" | tee -a "$DEST/summary.txt"
  exit $status
fi

NGPU=1
PYTEST=($PY -m pytest -q -p no:cacheprovider -rfEs)
if [[ -z ${DRY_RUN:-} ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
    | tee "$DEST/gpu.txt"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee -a "$DEST/gpu.txt"
  $PY -c "from mmattn.kernels import engines; print(engines.available())" \
    | tee -a "$DEST/gpu.txt"
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
  # pytest: 8 xdist workers and a per-test timeout where the plugins are installed
  $PY -c "import xdist" 2>/dev/null && PYTEST+=(-n 8)
  $PY -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 150)
fi
ENGINE_TESTS=(tests/mmattn/kernels/test_engines.py tests/mmattn/kernels/test_engines_flex.py
  tests/mmattn/kernels/test_engines_flex_cases.py tests/mmattn/kernels/test_engines_safety.py
  tests/mmattn/attention/test_sparse_engines.py)

# The engines first (issue 40), then their table (issues 34, 40), then the other CUDA
# tests; the older steps run in whatever budget is left.
step "engine CUDA tests (issue 40)" 150 cuda_engine_tests.log \
  "${PYTEST[@]}" -k cuda "${ENGINE_TESTS[@]}"
step "engines side by side (issues 34, 40)" 210 gpu_engines.md \
  $PY benchmarks/gpu_engines.py --write-docs --budget 170
IGNORE=()
for f in "${ENGINE_TESTS[@]}"; do IGNORE+=(--ignore "$f"); done
step "other CUDA tests" 100 cuda_tests.log "${PYTEST[@]}" -k cuda "${IGNORE[@]}" tests
if [ -f benchmarks/gpu_patterns.py ]; then
  step "patterns on the GPU (issue 33)" 45 gpu_patterns.md $PY benchmarks/gpu_patterns.py
fi
for example in interleaved_digits multimodal_match audio_stream; do
  step "example $example (cuda, quick)" 35 "example_$example.log" \
    $PY -m examples.$example --device cuda --quick --no-progress
done
step "MHA vs SDPA, LocalAttention vs Flex (bf16)" 120 gpu_attention.md \
  $PY benchmarks/gpu_attention.py
step "NeighborhoodAttention vs Flex (same block mask)" 60 gpu_neighborhood.md \
  $PY benchmarks/gpu_neighborhood.py
if ((NGPU > 1)); then
  step "DDP / FSDP2 / SequenceParallel on NCCL ($NGPU GPUs)" 120 gpu_dist.log \
    torchrun --standalone --nproc-per-node="$NGPU" benchmarks/gpu_dist_check.py
else
  echo "== one GPU: the NCCL DDP/FSDP2/SequenceParallel check needs two" \
    | tee -a "$DEST/summary.txt"
fi
# Packed vs padded: benchmarks/varlen.py (issue 10). It runs on the GPU only once it has a
# --device option; until then it measures the CPU and is skipped here.
if $PY benchmarks/varlen.py --help 2>/dev/null | grep -q -- --device; then
  step "packed vs padded" 90 varlen_cuda.md $PY benchmarks/varlen.py --device cuda --quick
else
  echo "== packed vs padded: benchmarks/varlen.py has no --device option yet, skipped" \
    | tee -a "$DEST/summary.txt"
fi
for dtype in bfloat16 float32; do
  step "attention core $dtype" 45 "mha_cuda_$dtype.md" \
    $PY benchmarks/mha.py --device cuda --dtype "$dtype"
done
step "adapters" 45 adapters_cuda.md $PY benchmarks/adapters.py --device cuda --rounds 20

# the machine's docs/performance.md (its "GPU engines" block) comes back with $DEST
[ -z "${DRY_RUN:-}" ] && cp docs/performance.md "$DEST/performance.md"
echo "total $((SECONDS - start)) s, status $status" | tee -a "$DEST/summary.txt"
exit $status
