#!/usr/bin/env bash
# Issue 20's GPU figures (LoopServe), run from the repository root on a CUDA machine whose image has torch, triton
# and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh). The gemma-3-270m parts need the
# model staged first (docs/gpu/real-model.sh stage ... assemble).
#   bash docs/gpu/loopserve.sh tests 8b        # the GPU tests; the 8B shape at 8k, 32k and 64k (random weights)
#   bash docs/gpu/loopserve.sh gemma           # the real model: prefill/decode figures and real-text fidelity
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || exit 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
kvchat() { python3 -m kvchat.app.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"; date -u >> "$OUT/machine.txt"
for part in "$@"; do
  case "$part" in
    tests)
      python3 -m pytest -q -rA -p no:cacheprovider tests/test_sparse_prefill.py tests/test_progressive_decode.py \
        tests/test_slot_mass.py \
        -k "gpu" 2>&1 | tail -25 | tee "$OUT/pytest-loopserve-gpu.txt" ;;
    8b)
      kvchat bench loopserve --shape llama-3.1-8b --context 8192,32768,65536 --cache-dir /tmp/bench-models \
        --json "$OUT/loopserve-8b-h100.json" 2>&1 | tee "$OUT/loopserve-8b-h100.txt" ;;
    gemma)
      kvchat bench loopserve --model gemma-3-270m --context 8192,24576 --json "$OUT/loopserve-gemma-270m-h100.json" \
        2>&1 | tee "$OUT/loopserve-gemma-270m-h100.txt"
      kvchat eval --text --model gemma-3-270m --kv-policy loopserve --device cuda \
        --json > "$OUT/fidelity-loopserve-gemma-270m-h100.json" 2> "$OUT/fidelity-loopserve.err"
      tail -3 "$OUT/fidelity-loopserve.err" ;;
  esac
done
