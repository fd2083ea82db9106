#!/usr/bin/env bash
# Issue 41's GPU figures (weights kept in their GGUF blocks): run from the repository root on a CUDA machine whose
# image has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
#
#   bash docs/gpu/quant-weights.sh tests     # the GPU tests of the quantized GEMVs, quantized models, layer budgets
#   bash docs/gpu/quant-weights.sh probe     # each float kernel's tiles against the bf16 GEMV, 8B-shape matrices
#   bash docs/gpu/quant-weights.sh dot-probe # each integer kernel's tiles (kernels/quant_dot.py); the best of each
#                                            # type go to /tmp/dot-tiles.json, which later parts use
#   bash docs/gpu/quant-weights.sh tile-probe # the integer kernels' tiles per matrix class, each in a CUDA graph
#                                            # (docs/probes/quant_dot_tiles.py); the best go to /tmp/dot-tiles.json
#   bash docs/gpu/quant-weights.sh profile   # kernel by kernel: an 8k prefill and decode steps, kept in blocks
#                                            # against dequantized at load (docs/probes/quant_profile.py)
#   bash docs/gpu/quant-weights.sh model     # only build the 8B-shape Q4_K_M file (llama.cpp's quantizer)
#   bash docs/gpu/quant-weights.sh engine    # kvchat bench engine, 8B shape Q4_K_M, 1k/8k/32k: dequantized at load,
#                                            # kept in blocks with float GEMVs, kept in blocks with integer ones
#   bash docs/gpu/quant-weights.sh agreement # the same answers? the 8B Q4_K_M file kept in its blocks against
#                                            # dequantized at load: 1,000 prefill positions, 200 decoded (JSON)
#   bash docs/gpu/quant-weights.sh floor     # both paths in bf16 against float32: bf16's own share of the above
#   bash docs/gpu/quant-weights.sh engine-types                # kvchat bench engine, 8B shape in Q5_K_M, Q6_K and
#   QTYPES=Q8_0 bash docs/gpu/quant-weights.sh engine-types    # Q8_0 (or those named), weights kept quantized only
#   bash docs/gpu/quant-weights.sh xkv       # kvchat bench xkv on the 8B Q4_K_M file at 32k, budgets 0.4/0.2/0.1
#                                            # (BUDGETS=...): slot lists, the working set, the host-resident chat
#   bash docs/gpu/quant-weights.sh tests probe engine engine engine   # all of it, the bench three times
# The random 8B models are kept in /tmp/bench-models (the BF16 source 16 GB, then each type: ~40 GB for all five);
# each is built on first use (llama.cpp's quantizer, a minute or two). One part per command keeps each under the
# runner's 10 minutes: engine-types with all three types may not be.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
# The integer kernels' tiles measured by dot-probe on this machine, once it has run.
[ -f /tmp/dot-tiles.json ] && export KVCHAT_QUANT_DOT_TILES=/tmp/dot-tiles.json
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.txt"
kvchat() { python3 -m kvchat.app.cli "$@"; }
for part in "${@:-tests}"; do
  case "$part" in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_dot.py tests/test_quant_gemv.py \
        tests/test_decode_kernels.py tests/test_quant_bench.py tests/test_layer_budgets.py \
        2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt" ;;
    probe)
      python3 docs/probes/quant_gemv.py > "$OUT/quant-gemv.jsonl" 2> "$OUT/quant-gemv.log"; tail -3 "$OUT/quant-gemv.log" ;;
    dot-probe)
      python3 docs/probes/quant_dot.py --best /tmp/dot-tiles.json > "$OUT/quant-dot.jsonl" 2> "$OUT/quant-dot.log"
      tail -3 "$OUT/quant-dot.log"; tail -1 "$OUT/quant-dot.jsonl"; cp /tmp/dot-tiles.json "$OUT/" 2>/dev/null
      [ -f /tmp/dot-tiles.json ] && export KVCHAT_QUANT_DOT_TILES=/tmp/dot-tiles.json ;;
    tile-probe)
      python3 docs/probes/quant_dot_tiles.py --best /tmp/dot-tiles.json > "$OUT/dot-tiles.jsonl" 2> "$OUT/dot-tiles.log"
      tail -1 "$OUT/dot-tiles.jsonl"; cp /tmp/dot-tiles.json "$OUT/" 2>/dev/null
      [ -f /tmp/dot-tiles.json ] && export KVCHAT_QUANT_DOT_TILES=/tmp/dot-tiles.json ;;
    profile)
      python3 docs/probes/quant_profile.py --context 8192 > "$OUT/profile-8k.jsonl" 2> "$OUT/profile-8k.log"
      grep -E "prefill|decode" "$OUT/profile-8k.log" ;;
    model)
      python3 -c "from pathlib import Path; from kvchat.app.bench.engine_speed import model_file; \
print(model_file(Path('/tmp/bench-models'), 'llama-3.1-8b', 'Q4_K_M'))" ;;
    engine)  # one run of the bench (each figure the median of 3); repeat the word for more runs
      run=$(( ${run:-0} + 1 ))
      kvchat bench engine --shape llama-3.1-8b --qtype Q4_K_M --weights "${WEIGHTS:-all}" --context 1024,8192,32768 \
        --cache-dir /tmp/bench-models --json "$OUT/engine-q4km-run$run.json" 2>&1 | tee "$OUT/engine-q4km-run$run.txt" ;;
    xkv)
      kvchat bench xkv --shape llama-3.1-8b --qtype Q4_K_M --context 32768 --budgets "${BUDGETS:-0.4,0.2,0.1}" \
        --cache-dir /tmp/bench-models --json "$OUT/xkv-32k.json" 2>&1 | tee "$OUT/xkv-32k.txt" ;;
    agreement)  # both models on the GPU one after the other (15 GiB dequantized, then 4.6 GiB in blocks)
      python3 docs/probes/quant_agreement.py --shape llama-3.1-8b --qtype Q4_K_M --cache-dir /tmp/bench-models \
        > "$OUT/quant-agreement-q4km.json" 2> "$OUT/quant-agreement-q4km.log"
      tail -3 "$OUT/quant-agreement-q4km.log"; cat "$OUT/quant-agreement-q4km.json" ;;
    floor)  # what bf16 itself costs: both paths in bf16 against the dequantized one in float32 (30 GiB), same tokens
      python3 -c "from pathlib import Path; from kvchat.app.bench.engine_speed import model_file; \
model_file(Path('/tmp/bench-models'), 'llama-3.1-8b', 'Q4_K_M')"
      python3 docs/probes/quant_agreement.py --shape llama-3.1-8b --qtype Q4_K_M --cache-dir /tmp/bench-models \
        --float32-floor > "$OUT/quant-agreement-floor.json" 2> "$OUT/quant-agreement-floor.log"
      tail -3 "$OUT/quant-agreement-floor.log" ;;
    engine-types)  # one run each (each figure the median of 3); per-context peak GPU memory in the table
      for q in ${QTYPES:-Q5_K_M Q6_K Q8_0}; do
        kvchat bench engine --shape llama-3.1-8b --qtype "$q" --weights quantized --context 1024,8192,32768 \
          --cache-dir /tmp/bench-models --json "$OUT/engine-$q.json" 2>&1 | tee "$OUT/engine-$q.txt"
      done ;;
    *) echo "unknown part $part (tests, probe, dot-probe, tile-probe, profile, model, engine, xkv, agreement, floor, engine-types)" >&2 ;;
  esac
done
