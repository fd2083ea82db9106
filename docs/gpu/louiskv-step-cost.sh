#!/usr/bin/env bash
# What a louiskv decode step costs beyond its bytes (issue 44), on a CUDA machine (H100): the 8B Q4_K_M shape (built
# into /tmp/bench-models on first use, ~4 min, as docs/gpu/memory-budget.sh does) at 32k, budget 1,024 and 2,048:
# docs/probes/louiskv_step_cost.py. Run from the repository root with the wheels in .whl/; results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
MODEL=$(python3 -c "from pathlib import Path; from kvchat.app.bench.engine_speed import model_file
print(model_file(Path('/tmp/bench-models'), 'llama-3.1-8b', 'Q4_K_M'))") || exit 1
for tokens in ${TOKENS:-1024 2048}; do
  timeout "${LIMIT:-240}" python3 docs/probes/louiskv_step_cost.py "$MODEL" --context "${CONTEXT:-32768}" \
    --tokens "$tokens" > "$OUT/louiskv-step-$tokens.txt" 2> "$OUT/louiskv-step-$tokens.log"
  echo "budget $tokens: exit status $?"; tail -4 "$OUT/louiskv-step-$tokens.txt" | cut -c1-400
done
