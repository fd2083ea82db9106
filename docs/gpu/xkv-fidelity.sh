#!/usr/bin/env bash
# Issue 43's fidelity target on many MT-Bench chats at once: gemma-3-270m, float32 over dequantized weights on one
# CUDA GPU (as the CPU computes it, without llama.cpp's rounding), one process a chat, several at a time (each
# decode step is a few ms of small kernels, so the GPU has room for many), then one table over all of them.
#
# The model travels in pieces (docs/gpu/real-model.sh: stage ... assemble); then, in the same or a later call:
#   SET=dev SEED=100 POLICIES="xkv,xkv:layer_weight=0.25,xkv:layer_weight=0.5,uniform,pyramid" \
#     bash docs/gpu/xkv-fidelity.sh smoke run    # the CUDA float32 path on the embedded model, then the chats
#   SET=test SEED=200 POLICIES=... bash docs/gpu/xkv-fidelity.sh run
#   SET=fresh SEED=500 POLICIES="xkv,xkv:costs=equal,uniform,pyramid" bash docs/gpu/xkv-fidelity.sh costs run
#                                                  # `costs`: the model's layer costs, measured once before the chats
# CHATS="24000:3 8000:6 2000:12" (length:count; chat i of a length has MT-Bench seed SEED + i), JOBS (12 at a time:
# 21 chats of five policies at three budgets took 312 s on an H200, 26 chats 16 at a time 378 s),
# LIMIT (seconds for the whole set). Every chat's JSON and log come back in $OUT/$SET.tgz; the table
# (docs/probes/xkv_fidelity_table.py) in $OUT/$SET-table.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then  # once a machine, as embedded-evals.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || exit 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
# 16 processes at once left one 24k chat out of memory on an H200's 140 GiB (each caching allocator held 8-9.5 GiB,
# 2026-11-29); 12 at a time did not. Expandable segments keep each process's cache less fragmented (not measured).
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome OMP_NUM_THREADS=1 \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SET=${SET:-dev}; SEED=${SEED:-100}; JOBS=${JOBS:-12}; LIMIT=${LIMIT:-540}
POLICIES=${POLICIES:-xkv,uniform,pyramid}; CHATS=${CHATS:-24000:3 8000:6 2000:12}
RES=/tmp/xkv-fidelity/$SET; export POLICIES RES
for part in "$@"; do
  case "$part" in
    smoke)  # the embedded model (in the tree): one 2k chat, every policy at one budget, float32 on CUDA
      (cd docs/probes && timeout 120 python3 xkv_fidelity.py --device cuda --fp32 --lengths 2000 --chats 1 \
        --budgets 0.2 --policies "$POLICIES") 2>&1 | tail -8 | tee "$OUT/smoke.txt" ;;
    costs)  # the model's layer costs, measured once here (as its first xkv would: build_policy) for every chat to read
      (cd docs/probes && python3 -c "
from xkv_fidelity import probe_engine
from kvchat.app.session.policies import ensure_layer_costs
from kvchat.engine.calibrate.layer_costs import cost_lines
from kvchat.storage.fingerprint import model_fingerprint
import time; t = time.time(); path, engine = probe_engine('gemma-3-270m', 'cuda', True)
cal = ensure_layer_costs(engine, model_fingerprint(path))
print(cal.spec(), cal.positions, 'positions', round(time.time() - t), 's'); print(*cost_lines(cal), sep=chr(10))
") 2>&1 | tee "$OUT/costs.txt" ;;
    run)
      mkdir -p "$RES"
      for spec in $CHATS; do
        length=${spec%%:*}; count=${spec##*:}
        for ((i = 0; i < count; i++)); do echo "$length $((SEED + i))"; done
      done > "$RES/jobs"
      started=$(date +%s)
      # shellcheck disable=SC2016
      timeout "$LIMIT" xargs -P "$JOBS" -L 1 bash -c 'cd docs/probes && python3 xkv_fidelity.py --model gemma-3-270m \
        --device cuda --fp32 --lengths "$0" --chats 1 --seed "$1" --policies "$POLICIES" \
        --json "$RES/$0-$1.json" > "$RES/$0-$1.txt" 2> "$RES/$0-$1.err"; echo "$0 $1 exit $?"' < "$RES/jobs"
      echo "$SET: $(ls "$RES"/*.json 2>/dev/null | wc -l) of $(wc -l < "$RES/jobs") chats in $(( $(date +%s) - started )) s"
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$RES/gpu.txt"; nproc --all >> "$RES/gpu.txt"
      tar -czf "$OUT/$SET.tgz" -C /tmp/xkv-fidelity "$SET"
      python3 docs/probes/xkv_fidelity_table.py "$RES"/*.json | tee "$OUT/$SET-table.txt" ;;
    *) echo "usage: $0 [smoke|costs|run]..." >&2; exit 2 ;;
  esac
done
