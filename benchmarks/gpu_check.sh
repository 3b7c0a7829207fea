#!/usr/bin/env bash
# The whole GPU check in one prepared run (device time is short): every CUDA-parametrized
# test, then the GPU benchmarks. Meant for the lent GPU machine, whose python3 already has
# torch, einops, pytest, hypothesis, torchvision, torchaudio and torch_geometric:
#
#   bash benchmarks/gpu_check.sh            # logs and tables land in $OUT (or out/gpu)
#
# Build and test everything on the CPU first; this script only adds what needs a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-out/gpu}
mkdir -p "$DEST"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DEST/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$DEST/gpu.txt"

# 1. The CUDA half of the suite (the CPU half already ran in CI).
$PY -m pytest -q -p no:cacheprovider -k cuda tests 2>&1 | tee "$DEST/cuda_tests.log" \
  || status=1

# 2. Benchmarks on the GPU: attention core (fp32 and bf16) and the adapters.
for dtype in float32 bfloat16; do
  $PY benchmarks/mha.py --device cuda --dtype "$dtype" 2>&1 | tee "$DEST/mha_cuda_$dtype.md" \
    || status=1
done
$PY benchmarks/adapters.py --device cuda --rounds 20 2>&1 | tee "$DEST/adapters_cuda.md" \
  || status=1
exit $status
