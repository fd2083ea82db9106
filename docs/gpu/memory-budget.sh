#!/usr/bin/env bash
# The GPU memory budget (issue 41) on a CUDA machine (H100): the resume benchmark on the Llama-3.1-8B shape in Q4_K_M
# at 32k under --gpu-memory 8GiB, 12GiB and no budget, each method's allocator peak beside what the plan predicted.
# Run from the repository root with the wheels in .whl/ (as docs/gpu/bench-resume.sh); each part fits one 10-minute
# command, run one after another on the same machine (the model is built into /tmp/bench-models by the first):
#
#   bash docs/gpu/memory-budget.sh 12gib       # builds the model (~4 min the first time), then the bench at 12 GiB
#   bash docs/gpu/memory-budget.sh 8gib        # the chat tiered at the watershed the 8B benchmarks use (@4)
#   bash docs/gpu/memory-budget.sh unlimited
#   bash docs/gpu/memory-budget.sh xkv         # issue 43: kv-split and policy:xkv without a budget, then policy:xkv
#                                              # at 8 GiB, where the chat's K/V stays in host memory (xkv:host)
#   KVCHAT_BENCH_MEMORY=$OUT METHODS=... bash docs/gpu/memory-budget.sh unlimited   # and one more run per method
#                                              # whose allocator history says what its peak is made of
#   RUNS="1 2" bash docs/gpu/memory-budget.sh xkv-runs   # kv-split and policy:xkv without a budget, a bench run each
#                                              # (cold, then 2 warm), to see whether xkv's first token holds in every run
#
# Results (JSON, markdown, the log) go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
part() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m kvchat.app.cli bench --models llama-3.1-8b --qtype Q4_K_M --workloads 32k \
    --device cuda --methods "${METHODS:-prefill,kv-load,policy:round@4}" --repeats "${REPEATS:-1}" \
    --cache-dir /tmp/bench-models --work-dir "/tmp/bench-memory-$name" --llama-cpp-budget 0 \
    --disk-probe-mib 256 --json "$OUT/memory-$name.json" --markdown "$OUT/memory-$name.md" "$@" \
    2> "$OUT/memory-$name.log"
  echo "part $name: exit status $? (124: stopped at the time limit; the JSON holds what finished)"
  # a failed method's child says why in full in its stderr.txt (the table keeps its last line, cut at 300 characters)
  find "/tmp/bench-memory-$name" -name stderr.txt -size +0 2>/dev/null | while read -r f; do
    # (a method's folder may be named policy:round@4: the copy's name keeps letters, digits, '.', '_' and '-')
    cp "$f" "$OUT/memory-$name-$(basename "$(dirname "$f")" | tr -c 'A-Za-z0-9._\n-' '_')-stderr.txt"; done
  rm -rf "/tmp/bench-memory-$name"
}
case "${1:-12gib}" in
  12gib)     part 12gib 560 --gpu-memory 12GiB ;;
  8gib)      part 8gib 560 --gpu-memory 8GiB ;;
  unlimited) part unlimited 560 ;;
  xkv)       METHODS=kv-split,policy:xkv part xkv-unlimited 300
             METHODS=policy:xkv part xkv-8gib 260 --gpu-memory 8GiB ;;
  xkv-runs)  for run in ${RUNS:-1 2 3}; do
               METHODS=kv-split,policy:xkv REPEATS=2 part "xkv-run$run" "${LIMIT:-240}"; done ;;
  *) echo "usage: $0 12gib|8gib|unlimited|xkv|xkv-runs" >&2; exit 2 ;;
esac
