#!/usr/bin/env bash
# Every recall figure that comes from the embedded model, measured on the CPU cores of the GPU machine (16 cores: the
# evals run side by side, 2 threads each, fp32 with llama.cpp numerics as on the 2-core CPU; only their seconds and
# tokens/s differ). For a new embedded model: bash docs/gpu/embedded-evals.sh MODEL.gguf PART... with the parts
#   base       the full cache on held-out (with 1,000 sampled replies) and trained phrasings
#   merges     the merge calibration checked Krul makes on first use (run it before krul)
#   krul       checked Krul on both phrasing sets
#   krul-unchecked  unchecked Krul (r_l 0.25, 0.5) on both phrasing sets
#   loopserve  LoopServe and its ablations on held-out phrasings
#   text       the policies' fidelity on MT-Bench text (`eval --text`)
#   round      the three Round Attention strategies on both phrasing sets
#   dev        the full cache on dev phrasings, four sets of 40 chats (seeds 0-3): for choosing between runs
#   heldout    the full cache on held-out sets 1-3 (set 0 is base's): where dev does not predict held-out recall
#   report     the full cache on held-out sets 4-7, which nothing is chosen on: the figures a shipped model reports
#   xkv        issue 43 (16 processes, one thread each): xkv with its default look-ahead at 0.2 and 0.1 as the app
#              answers (one process per report set: their sums are `eval --report --chats 10`'s), uniform and
#              pyramid at 0.4 and xkv at 0.2 / 0.1 from the window alone in comparison (`--report --chats 5`), and
#              the full cache, xkv looking ahead 16 and 32 as the app answers on 20 development chats (seed 1)
#   xkv-kept   issue 43, the look-ahead kept as the reply's start (the default since 2026-11-28, evening; 16
#              processes, one thread each): xkv at 0.4 / 0.2 / 0.1 as the app answers (one process per report set)
#              and in comparison, and the choice alone (keep_ahead=false) at 0.4 in comparison
#   xkv-costs  issue 43, the same 16 evals as xkv-kept under xkv's default since 2026-11-29 (the layers weighed by
#              the model's layer costs: for the embedded model those shipped with it; CALIBRATE=0 then saves minutes)
#   xkv-weighted issue 43, xkv's layers weighed by their attention's share of the residual stream (layer_weight
#              $LAYER_WEIGHT, 0.5 unless set): the same 16 evals as xkv-kept
# Results land in $OUT/embedded-evals.tgz (eval-*.json and .err, calibrate.json, the calibrations the evals made):
# the device tool brings back at most 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; RES=/tmp/embedded-evals; mkdir -p "$OUT" "$RES"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || exit 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=${KVCHAT_HOME:-/tmp/kvhome} OMP_NUM_THREADS=2
MODEL=$1; shift
ev() {  # name, then eval's options
  local name=$1; shift
  python3 -m kvchat.app.cli eval --model "$MODEL" --device cpu --json "$@" > "$RES/eval-$name.json" \
    2> "$RES/eval-$name.err" &
}
# The policies calibrate on first use; one process makes each calibration before the others read it (CALIBRATE=0:
# not, where the evals need only what is shipped with the embedded model: its watershed and its layer costs).
if [ "${CALIBRATE:-1}" = 1 ]; then
  python3 -m kvchat.app.cli calibrate --model "$MODEL" --device cpu --json > "$RES/calibrate.json" \
    2> "$RES/calibrate.err"
fi
for part in "$@"; do
  case "$part" in
    base)
      ev full-heldout --phrasing heldout --samples 1000
      ev full-train --phrasing train ;;
    merges)  # the merge calibration checked Krul makes on first use (its pairs and their agreement)
      python3 -m kvchat.app.cli eval --model "$MODEL" --device cpu --kv-policy krul --chats 1 > /dev/null 2>&1 ;;
    krul)
      for ph in heldout train; do ev krul-$ph --kv-policy krul --phrasing $ph; done ;;
    krul-unchecked)
      for ph in heldout train; do
        ev krul-unchecked-0.25-$ph --kv-policy krul --unchecked --r-l 0.25 --phrasing $ph
        ev krul-unchecked-0.5-$ph --kv-policy krul --unchecked --r-l 0.5 --phrasing $ph
      done ;;
    loopserve)
      ev loopserve-heldout --kv-policy loopserve --phrasing heldout
      ev loopserve-decode-only-heldout --kv-policy loopserve --option sparse=false --phrasing heldout
      ev loopserve-prefill-only-heldout --kv-policy loopserve --option progressive=false --phrasing heldout
      ev loopserve-pool1-heldout --kv-policy loopserve --option pool=1 --phrasing heldout
      ev loopserve-decode-only-pool1-heldout --kv-policy loopserve --option sparse=false --option pool=1 \
        --phrasing heldout ;;
    text)
      ev text --text --lengths 2000 --chats 2 ;;
    round)
      for pol in round-topk round-threshold round-adaptive; do
        for ph in heldout train; do ev $pol-$ph --kv-policy $pol --phrasing $ph; done
      done ;;
    dev)
      for seed in 0 1 2 3; do ev full-dev-seed$seed --phrasing dev --seed $seed; done ;;
    heldout)
      for seed in 1 2 3; do ev full-heldout-seed$seed --phrasing heldout --seed $seed; done ;;
    report)
      for seed in 4 5 6 7; do ev full-heldout-seed$seed --phrasing heldout --seed $seed; done ;;
    xkv)
      export OMP_NUM_THREADS=1
      for b in 0.2 0.1; do
        for set in 53296 87351 387785 874335; do  # app.bench.evaluate.REPORT_SEEDS
          ev xkv-$b-app-set$set --kv-policy xkv --kv-budget $b --mode app --seed $set --chats 10
        done
      done
      ev uniform-0.4-compare --kv-policy uniform --kv-budget 0.4 --mode compare --report --chats 5
      ev pyramid-0.4-compare --kv-policy pyramid --kv-budget 0.4 --mode compare --report --chats 5
      for b in 0.2 0.1; do
        ev xkv-$b-window-compare --kv-policy xkv --kv-budget $b --option lookahead=0 --mode compare --report --chats 5
      done
      ev full-dev1-app --mode app --phrasing heldout --seed 1 --chats 20
      for n in 16 32; do
        ev xkv-0.4-lookahead$n-dev1-app --kv-policy xkv --kv-budget 0.4 --option lookahead=$n --mode app --seed 1 \
          --chats 20
      done ;;
    xkv-kept|xkv-costs)
      export OMP_NUM_THREADS=1; tag=${part#xkv-}
      for b in 0.4 0.2 0.1; do
        for set in 53296 87351 387785 874335; do  # app.bench.evaluate.REPORT_SEEDS
          ev xkv-$b-$tag-app-set$set --kv-policy xkv --kv-budget $b --mode app --seed $set --chats 10
        done
        ev xkv-$b-$tag-compare --kv-policy xkv --kv-budget $b --mode compare --report --chats 5
      done
      ev xkv-0.4-$tag-choice-compare --kv-policy xkv --kv-budget 0.4 --option keep_ahead=false --mode compare \
        --report --chats 5 ;;
    xkv-weighted)
      export OMP_NUM_THREADS=1; W=${LAYER_WEIGHT:-0.5}
      for b in 0.4 0.2 0.1; do
        for set in 53296 87351 387785 874335; do  # app.bench.evaluate.REPORT_SEEDS
          ev xkv-$b-w$W-app-set$set --kv-policy xkv --kv-budget $b --option layer_weight=$W --mode app \
            --seed $set --chats 10
        done
        ev xkv-$b-w$W-compare --kv-policy xkv --kv-budget $b --option layer_weight=$W --mode compare --report \
          --chats 5
      done
      ev xkv-0.4-w$W-choice-compare --kv-policy xkv --kv-budget 0.4 --option layer_weight=$W \
        --option keep_ahead=false --mode compare --report --chats 5 ;;
  esac
done
wait
cp -r "$KVCHAT_HOME/calibrations" "$RES/" 2>/dev/null
tar czf "$OUT/embedded-evals.tgz" -C "$RES" .
for f in "$RES"/eval-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], d.get('accuracy'), \
(d.get('out_of_scope') or {}).get('polite_rate'), round(d.get('seconds', 0)))" "$f" 2>/dev/null || echo "$f: no result"
done
