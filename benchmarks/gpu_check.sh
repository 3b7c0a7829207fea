#!/usr/bin/env bash
# The whole GPU check in one prepared run (device time is short, so the script stays under
# 8 minutes: every step has a time limit and steps are skipped once the budget is spent).
# Meant for the lent GPU machine, whose python3 already has torch, einops, pytest,
# hypothesis, torchvision, torchaudio and torch_geometric:
#
#   bash benchmarks/gpu_check.sh            # logs and tables land in $OUT (or out/gpu)
#   DRY_RUN=1 bash benchmarks/gpu_check.sh  # print the steps only (checked on the CPU)
#
# 1. the CUDA half of the test suite (compile on CUDA included; xdist -n 8 and a per-test
#    timeout where those plugins are installed);
# 1b. (issue 34) benchmarks/gpu_engines.py: every row of issue 34's table side by side
#    (mmattn, varlen_attn, flex with a hand-written mask_mod, flex with Pattern.mask_mod,
#    dense SDPA; EdgeAttention vs TransformerConv), written into docs/performance.md ("GPU
#    engines") with the GPU's name and torch's version; benchmarks/gpu_patterns.py (issue
#    33) when present; the examples interleaved_digits, multimodal_match and audio_stream
#    with --device cuda --quick;
# 2. bf16 TFLOP/s of MultiHeadAttention vs raw SDPA (+ the projections' fair share) at
#    L in {1024, 4096, 16384}, D=1024, H=16 (target >= 90 %), and LocalAttention vs
#    FlexAttention with a sliding-window block mask (target: no slower);
# 2b. NeighborhoodAttention's kernel vs FlexAttention with the same window block mask:
#    outputs and gradients equal, fwd+bwd bf16 time (benchmarks/gpu_neighborhood.py);
# 3. the CPU benchmarks' CUDA variants (attention core fp32/bf16, adapters), packed vs
#    padded (benchmarks/varlen.py) once it has a CUDA mode;
# 4. with more than one GPU: DDP (with/without find_unused_parameters), compiled DDP, FSDP2
#    and SequenceParallel on NCCL against one GPU (benchmarks/gpu_dist_check.py).
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

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DEST/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$DEST/gpu.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# pytest: 8 xdist workers and a per-test timeout where the plugins are installed
PYTEST=($PY -m pytest -q -p no:cacheprovider)
$PY -c "import xdist" 2>/dev/null && PYTEST+=(-n 8)
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 120)

# The CUDA tests, then issue 34 (the engines): the side-by-side table, issue 33's patterns,
# the examples. The older steps below run in whatever budget is left.
step "CUDA tests" 140 cuda_tests.log "${PYTEST[@]}" -k cuda tests
step "engines side by side (issue 34's table)" 170 gpu_engines.md \
  $PY benchmarks/gpu_engines.py --write-docs
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
