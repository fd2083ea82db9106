#!/usr/bin/env bash
# Round Attention figures of docs/benchmarks.md on a CUDA machine (H100), in parts that each fit a 10-minute command:
#
#   bash docs/gpu/bench-round.sh 8b-32k   # Llama-3.1-8B shape at 32k: full cache (kv-load) against policy:round@4
#   bash docs/gpu/bench-round.sh 8b-8k    # the same at 8k
#   bash docs/gpu/bench-round.sh recall   # recall per strategy on the embedded model (GPU)
#
# The 8B shape has random weights, so its watershed is not calibrated: @4 is the paper's L_w = 5 for Llama-3 8B
# (counted from 1), the rounds it picks are arbitrary, and only its speed and memory figures mean something.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
part() {
  local workloads=$1 name=$2 limit=$3
  timeout "$limit" python3 -m kvchat.app.cli bench --models llama-3.1-8b --workloads "$workloads" --device cuda \
    --methods kv-load,policy:round@4 --repeats 2 --cache-dir /tmp/bench-models --work-dir "/tmp/bench-round-$name" \
    --llama-cpp-budget 0 --json "$OUT/round-$name.json" --markdown "$OUT/round-$name.md" 2> "$OUT/round-$name.log"
  echo "part $name: exit status $?"
  rm -rf "/tmp/bench-round-$name"
}
recall() {
  for policy in full round-topk round-threshold round-adaptive; do
    timeout 150 python3 -m kvchat.app.cli eval --kv-policy "$policy" --chats 10 --device cuda --json \
      > "$OUT/eval-embedded-$policy-h100-10chats.json" 2>> "$OUT/eval.log"
    echo "eval $policy: exit status $?"
  done
}
case "${1:-8b-32k}" in
  8b-32k) part 32k 8b-32k 560 ;;
  8b-8k)  part 8k 8b-8k 330 ;;
  recall) recall ;;
  *) echo "usage: $0 8b-32k|8b-8k|recall" >&2; exit 2 ;;
esac
