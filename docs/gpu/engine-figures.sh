#!/usr/bin/env bash
# How the GPU figures of docs/benchmarks.md were made: run from the repository root on a CUDA machine whose image
# has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
  python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt"
kvchat() { python3 -m kvchat.app.cli "$@"; }
case "${1:-all}" in
  all)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_dequant.py 2>&1 | tail -3 | tee "$OUT/pytest-gpu.txt"
    kvchat bench parity --device cuda --json "$OUT/parity-cuda-bf16.json" | tee "$OUT/parity-cuda-bf16.txt"
    kvchat bench engine --shape llama-3.2-1b --shape llama-3.1-8b --context 1024,8192 --cold \
      --cache-dir /tmp/bench-models --json "$OUT/engine-bf16.json" 2>&1 | tee "$OUT/engine-bf16.txt"
    ;;
  q4km)
    kvchat bench engine --qtype Q4_K_M --shape llama-3.2-1b --shape llama-3.1-8b --context 1024 --cold \
      --cache-dir /tmp/bench-models --json "$OUT/engine-q4km.json" 2>&1 | tee "$OUT/engine-q4km.txt"
    ;;
esac
