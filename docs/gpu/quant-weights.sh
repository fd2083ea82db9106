#!/usr/bin/env bash
# Issue 41's GPU figures (weights kept in their GGUF blocks): run from the repository root on a CUDA machine whose
# image has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
#
#   bash docs/gpu/quant-weights.sh tests     # the GPU tests of the quantized GEMVs and of quantized models
#   bash docs/gpu/quant-weights.sh probe     # each kernel's tiles against the bf16 GEMV, 8B-shape matrices
#   bash docs/gpu/quant-weights.sh engine    # kvchat bench engine, 8B shape Q4_K_M, both weight kinds, 1k/8k/32k
#   bash docs/gpu/quant-weights.sh tests probe engine engine engine   # all of it, the bench three times
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.txt"
kvchat() { python3 -m kvchat.app.cli "$@"; }
for part in "${@:-tests}"; do
  case "$part" in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_gemv.py tests/test_decode_kernels.py \
        2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt" ;;
    probe)
      python3 docs/probes/quant_gemv.py > "$OUT/quant-gemv.jsonl" 2> "$OUT/quant-gemv.log"; tail -3 "$OUT/quant-gemv.log" ;;
    engine)  # one run of the bench (each figure the median of 3); repeat the word for more runs
      run=$(( ${run:-0} + 1 ))
      kvchat bench engine --shape llama-3.1-8b --qtype Q4_K_M --weights both --context 1024,8192,32768 \
        --cache-dir /tmp/bench-models --json "$OUT/engine-q4km-run$run.json" 2>&1 | tee "$OUT/engine-q4km-run$run.txt" ;;
  esac
done
