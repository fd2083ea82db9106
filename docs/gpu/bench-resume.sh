#!/usr/bin/env bash
# The resume benchmark of docs/benchmarks.md on a CUDA machine (H100): run from the repository root on a machine
# whose image has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
# Results (JSON, markdown, the log) go to $OUT. Each part fits one 10-minute command; run them one after another:
#
#   bash docs/gpu/bench-resume.sh small     # embedded, Qwen2.5-0.5B and Llama-3.2-1B shapes at 2k and 8k (~6 min)
#   bash docs/gpu/bench-resume.sh 8b        # Llama-3.1-8B shape at 2k and 8k (~6 min, ~2 of them making the model)
#   bash docs/gpu/bench-resume.sh 8b-32k    # Llama-3.1-8B shape at 32k (~6 min)
#
# Random models are generated on the machine into /tmp/bench-models (kept while the machine stays warm). llama.cpp
# is the CPU build of llama-cpp-python there: it gets LLAMA_BUDGET seconds per workload and is reported as skipped,
# with its estimate, beyond that. A part that runs out of time still leaves the models finished so far in $OUT
# (the JSON is rewritten after every workload). TINY=1 runs the same logic on the CPU in about a minute (a test).
# METHODS=prefill,kv-load,kv-split runs only those methods (the restore pipeline's comparison).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${TINY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
  export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
    python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt"
fi
PY=${PY:-python3}
kvchat() { "$PY" -m kvchat.app.cli "$@"; }
LLAMA_BUDGET=${LLAMA_BUDGET:-60}
DEVICE=${DEVICE:-cuda}
# One part: models, workloads, a name for its files, a time limit (seconds) that leaves room before the 10 minutes.
part() {
  local models=$1 workloads=$2 name=$3 limit=$4
  timeout "$limit" "$PY" -m kvchat.app.cli bench --models "$models" --workloads "$workloads" --device "$DEVICE" \
    ${METHODS:+--methods "$METHODS"} \
    --repeats "${REPEATS:-3}" --cache-dir /tmp/bench-models --work-dir "/tmp/bench-resume-$name" \
    --llama-cpp-budget "$LLAMA_BUDGET" --disk-probe-mib "${DISK_PROBE_MIB:-1024}" \
    --json "$OUT/resume-$name.json" --markdown "$OUT/resume-$name.md" 2> "$OUT/resume-$name.log"
  echo "part $name: exit status $? (124: stopped at the time limit; the JSON holds what finished)"
  rm -rf "/tmp/bench-resume-$name"  # chat stores and state files: gigabytes for the 8B shape
}
case "${1:-small}" in
  small)  part embedded,qwen2.5-0.5b,llama-3.2-1b 2k,8k small 530 ;;
  8b)     part llama-3.1-8b 2k,8k 8b 530 ;;
  8b-32k) part llama-3.1-8b 32k 8b-32k 530 ;;
  tiny)   part embedded 2k tiny 300 ;;
  *) echo "usage: $0 small|8b|8b-32k|tiny" >&2; exit 2 ;;
esac
