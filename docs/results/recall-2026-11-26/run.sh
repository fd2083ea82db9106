#!/usr/bin/env bash
# The recall figures of 2026-11-26 (issue 39): `kvchat eval` on the report sets (evaluate.REPORT_SEEDS), one run
# per policy, mode, phrasing and set, each on one CPU thread (fp32), as many at once as there are cores less one.
# Usage: run.sh OUTDIR KVCHAT   (KVCHAT: the command that runs kvchat, e.g. ".venv/bin/kvchat"); ONLY=REGEX keeps the
# runs whose line ("PHRASING POLICY MODE SEED") matches, JOBS=N runs N at once.
set -uo pipefail
out=$1; kvchat=$2
mkdir -p "$out"
seeds=$(python3 -c "import ast,re;s=open('app/bench/evaluate.py').read();print(*ast.literal_eval(re.search(r'REPORT_SEEDS = (\(.*?\))',s).group(1)))")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The calibrations a round policy and checked Krul need, made once before the runs share them.
$kvchat eval --kv-policy round --chats 1 --min-tokens 0 --min-rounds 4 --max-rounds 5 --device cpu --json >/dev/null
$kvchat eval --kv-policy krul --chats 1 --min-tokens 0 --min-rounds 4 --max-rounds 5 --device cpu --json >/dev/null
jobs=()
for s in $seeds; do
  for m in app compare; do jobs+=("heldout full $m $s" "train full $m $s"); done
  for p in krul loopserve loopserve+round round round-adaptive round-threshold round-topk; do
    jobs+=("heldout $p app $s")
  done
done
printf '%s\n' "${jobs[@]}" | grep -E "${ONLY:-.}" | xargs -P "${JOBS:-$(( $(nproc) - 1 ))}" -L 1 bash -c '
  ph=$0 p=$1 m=$2 s=$3
  '"$kvchat"' eval --kv-policy "$p" --mode "$m" --seed "$s" --chats 40 --phrasing "$ph" --device cpu --json \
    > "'"$out"'/$ph-$p-$m-$s.json" 2> "'"$out"'/$ph-$p-$m-$s.err"; echo "$ph $p $m $s rc=$?"'
