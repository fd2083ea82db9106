#!/usr/bin/env bash
# Issue 17's GPU figures (decode attention kernel, graphed decode): run from the repository root on a CUDA machine
# whose image has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
#
#   bash docs/gpu/decode-kernel.sh tests     # the GPU tests of the kernel and of graphed decode
#   bash docs/gpu/decode-kernel.sh tiles     # the kernel's tiles and splits against SDPA (probe)
#   bash docs/gpu/decode-kernel.sh engine    # kvchat bench engine, 8B shape, 1k..64k, 3 runs; a profile of one step
#   bash docs/gpu/decode-kernel.sh round     # kvchat bench --methods kv-load,policy:round@4 at 32k
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.txt"
kvchat() { python3 -m kvchat.app.cli "$@"; }
model8b() {  # the random 8B-shape BF16 file, built once per machine
  [ -f /tmp/bench-models/llama-3.1-8b-BF16.gguf ] || python3 -c "
from pathlib import Path; from kvchat.app.bench.engine_speed import model_file; model_file(Path('/tmp/bench-models'), 'llama-3.1-8b')"
}
for part in "${@:-tests}"; do
  case "$part" in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_attention.py tests/test_decode_kernels.py tests/test_gpu.py \
        tests/test_tiered_kv.py 2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt" ;;
    tiles)
      python3 docs/probes/decode_tiles.py tiles > "$OUT/decode-tiles.jsonl" 2> "$OUT/decode-tiles.log" ;;
    engine)  # three runs of the bench (each the median of 3), then a kernel profile of one step
      model8b
      for run in 1 2 3; do
        kvchat bench engine --shape llama-3.1-8b --context 1024,8192,32768,65536 --cache-dir /tmp/bench-models \
          --json "$OUT/engine-decode-run$run.json" 2>&1 | tee "$OUT/engine-decode-run$run.txt"
      done
      python3 docs/probes/decode_tiles.py profile /tmp/bench-models/llama-3.1-8b-BF16.gguf 1024 32768 \
        > "$OUT/decode-profile.jsonl" 2> "$OUT/decode-profile.log" ;;
    round)
      timeout 560 python3 -m kvchat.app.cli bench --models llama-3.1-8b --workloads 32k --device cuda \
        --methods kv-load,policy:round@4 --repeats 3 --cache-dir /tmp/bench-models --work-dir /tmp/bench-round \
        --llama-cpp-budget 0 --json "$OUT/round-32k.json" --markdown "$OUT/round-32k.md" 2> "$OUT/round-32k.log"
      echo "round: exit status $?"; rm -rf /tmp/bench-round ;;
    *) echo "usage: $0 [tests|tiles|engine|round]..." >&2; exit 2 ;;
  esac
done
