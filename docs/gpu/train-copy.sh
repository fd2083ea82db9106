#!/usr/bin/env bash
# Issue 45 on a CUDA machine (H100): the demo model trained on to copy values whatever they look like (the `--mix copy`
# chats, docs/embedded-model.md "Training data for exact copying"), from the shipped model's weights with Q's recipe.
# Run from the repository root with the wheels in .whl/ (as docs/gpu/bench-resume.sh); one part per 10-minute command:
#
#   bash docs/gpu/train-copy.sh kernel      # first, issue 44's fused choice kernel: its gpu tests and timing
#   STEPS=3500 DIALOGUES=100000 SEED=5 bash docs/gpu/train-copy.sh train
#   TALK=0.7 ... bash docs/gpu/train-copy.sh train   # small talk written by engine/data/small_talk.py's grammar too
#   REQUESTS=0.7 ... bash docs/gpu/train-copy.sh train   # requests written by its request grammar too
#   SUBJECTS=0.4 ... bash docs/gpu/train-copy.sh train   # a share of the copy mix's facts about anything (open_facts.py)
#   WORDS=0.5 ... bash docs/gpu/train-copy.sh train   # a share of its random strings lower-case words or several words
#   LR=0.0003 ... bash docs/gpu/train-copy.sh train   # the peak learning rate (default 0.001, every run's before)
#   EVAL=1 ... bash docs/gpu/train-copy.sh train   # then the development evals below, on the CPU cores beside
#                                           # (GATE=1: and held-out sets 0-3, the gate before the report sets)
#   bash docs/gpu/train-copy.sh eval A.gguf B.gguf  # each model's development evals, all at once on the CPU cores
#   bash docs/gpu/train-copy.sh report MODEL.gguf   # the chosen model's report figures, once (and the shipped one's
#                                           # random strings on the report sets), all at once; results in report.tgz
#   bash docs/gpu/train-copy.sh ship MODEL.gguf     # and, before it ships, its trained phrasings on the report sets
#                                           # and 1,000 sampled replies (loops, the cap); results in ship.tgz
#   BLEND_MODELS="C4.gguf C2.gguf Q.gguf" bash docs/gpu/train-copy.sh blends 3:0:1 4:1:1  # weight averages: each
#                                           # model taken as many times as its count; each blend's development evals
#                                           # (GATE=1: and held-out sets 0-3, the gate before the report sets)
#
# The exported model and the log go to $OUT; runs are chosen by `kvchat eval --phrasing dev --values random` and
# `--phrasing dev` (seed 0, 20 chats, as the app answers, on the CPU, one thread each: the figures of
# docs/embedded-model.md), never by the written set.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
dev_evals() {  # MODEL NAME: the two development evals, in the background
  for set in random heldout; do
    values=$([ $set = random ] && echo "--values random")
    OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT:-400}" python3 -m kvchat.app.cli eval --model "$1" --phrasing dev $values \
      --mode app --chats 20 --device cpu --json > "$OUT/$2-dev-$set.json" 2> "$OUT/$2-dev-$set.log" &
  done
}
gate_evals() {  # MODEL NAME: held-out sets 0-3 (the gate before the report sets), in the background
  for seed in 0 1 2 3; do
    OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT:-400}" python3 -m kvchat.app.cli eval --model "$1" --seed $seed \
      --mode app --chats 20 --device cpu --json > "$OUT/$2-heldout-seed$seed.json" 2> "$OUT/$2-heldout-seed$seed.log" &
  done
}
summary() {  # [DIR [PATTERN]]: one line per eval's JSON (default: $OUT's development evals)
  python3 - "${1:-$OUT}" "${2:-*-dev-*.json}" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob(sys.argv[2])):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        print(f.stem, "no result:", f.with_suffix(".log").read_text().strip().splitlines()[-1:])
        continue
    print(f.stem, f"recall {d['correct']}/{d['questions']}", f"exact copy {d['exact_copy']['correct']}",
          f"polite {d['out_of_scope']['polite_rate']:.3f}", f"longest reply {d['longest_reply']}")
PY
}
archive_evals() {  # $OUT's eval files (and blends' logs) in one archive: the device hands back at most 8 files a call
  (cd "$OUT" && shopt -s nullglob && files=(*-dev-* *-heldout-seed* *-average.log) \
    && if [ ${#files[@]} -gt 0 ]; then tar czf evals.tgz -- "${files[@]}" && rm -f -- "${files[@]}"; fi)
}
case "${1:-train}" in
  kernel)
    timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" -m gpu tests/test_unit_choice_kernel.py 2>&1 | tail -15 \
      | tee "$OUT/pytest-unit-choice-gpu.txt"
    timeout "${PROBE_LIMIT:-90}" python3 docs/probes/unit_choice_cost.py > "$OUT/unit-choice-cost.txt" 2> "$OUT/unit-choice-cost.log"
    echo "unit choice probe: exit status $?"; tail -25 "$OUT/unit-choice-cost.txt" ;;
  train)
    LONG="--set noise=6 --set never_told=50 --set lr=${LR:-0.001} --set steps=${STEPS:-3500} --set n_dialogues=${DIALOGUES:-100000}
          --set compile=1 --set wide=1 --set user_lm=1.0 --set min_rounds=32 --set max_rounds=60 --set talk=${TALK:-0} --set requests=${REQUESTS:-0}
          --set subjects=${SUBJECTS:-0} --set words=${WORDS:-0}"
    timeout "${LIMIT:-430}" python3 -m kvchat.engine.train.trainer --out /tmp/copy-run --init "${INIT:-assets/kvchat-memory-demo.gguf}" \
      --workers 15 --seed "${SEED:-5}" --minutes "${MINUTES:-6.3}" $LONG --mix copy --mix-share "${SHARE:-0.5}" \
      2>&1 | tee "$OUT/train-copy.log" | grep -v "^step [0-9]*[1-9]00/" | tail -8
    # (the trainer stopped by LIMIT before it saved: LIMIT covers making the chats too, 71-99 s of 100,000 on the
    # H200 hosts of 2026-11-29, and their speed varied 1.2-1.7M tokens a second; one such run wrote no model)
    cp /tmp/copy-run/kvchat-memory-demo.gguf "$OUT/" || { echo "no model: the trainer did not finish within LIMIT=${LIMIT:-430} s" >&2; exit 1; }
    if [ -n "${EVAL:-}" ]; then dev_evals /tmp/copy-run/kvchat-memory-demo.gguf trained
      if [ -n "${GATE:-}" ]; then gate_evals /tmp/copy-run/kvchat-memory-demo.gguf trained; fi
      wait; summary; summary "$OUT" "*-heldout-seed*.json"
      archive_evals; fi ;;
  eval)
    shift; for model in "$@"; do dev_evals "$model" "$(basename "$model" .gguf)"; done; wait; summary ;;
  report)  # held-out phrasings on each report set (40 chats, as 2026-11-26's figures), random strings on each (10
           # chats) for MODEL and the shipped model, and the written set once; one thread each, all at once
    model=$2; shipped=assets/kvchat-memory-demo.gguf; dir=/tmp/report; mkdir -p $dir
    one() {  # NAME ARGS...: one eval in the background
      local name=$1; shift
      OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT:-420}" python3 -m kvchat.app.cli eval --mode app --device cpu --json "$@" \
        > "$dir/$name.json" 2> "$dir/$name.log" &
    }
    for seed in 53296 87351 387785 874335; do
      one "model-heldout-$seed" --model "$model" --seed $seed --chats 40
      one "model-random-$seed" --model "$model" --seed $seed --chats 10 --values random
      one "shipped-random-$seed" --model "$shipped" --seed $seed --chats 10 --values random
    done
    one model-written --model "$model" --phrasing written
    wait
    tar czf "$OUT/report.tgz" -C $dir .
    summary $dir "*.json"
    ;;
  ship)  # what a model to be shipped is measured on besides the report sets: trained phrasings on each report set
         # (40 chats, as 2026-11-26's figures) and 1,000 replies sampled at 0.8 with the guard off; all at once
    model=$2; dir=/tmp/ship; mkdir -p $dir
    for seed in 53296 87351 387785 874335; do
      OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT:-420}" python3 -m kvchat.app.cli eval --mode app --device cpu --json \
        --model "$model" --seed $seed --chats 40 --phrasing train > "$dir/trained-$seed.json" 2> "$dir/trained-$seed.log" &
    done
    OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT:-420}" python3 -m kvchat.app.cli eval --mode app --device cpu --json \
      --model "$model" --seed 0 --chats 10 --samples 1000 > "$dir/samples.json" 2> "$dir/samples.log" &
    wait
    tar czf "$OUT/ship.tgz" -C $dir .
    summary $dir "*.json"
    ;;
  blends)
    shift; read -ra models <<< "${BLEND_MODELS:?the models to average, in the order of the counts}"
    for spec in "$@"; do
      IFS=: read -ra counts <<< "$spec"; files=()
      for i in "${!models[@]}"; do for _ in $(seq 1 "${counts[$i]:-0}"); do files+=("${models[$i]}"); done; done
      name="blend-${spec//:/-}"
      python3 -m kvchat.engine.train.trainer --out "/tmp/$name" --average "${files[@]}" > "$OUT/$name-average.log" \
        && dev_evals "/tmp/$name/kvchat-memory-demo.gguf" "$name" \
        && if [ -n "${GATE:-}" ]; then gate_evals "/tmp/$name/kvchat-memory-demo.gguf" "$name"; fi
    done; wait; summary; summary "$OUT" "*-heldout-seed*.json"
    archive_evals ;;
  *) echo "usage: $0 kernel|train|eval MODEL...|blends COUNTS...|report MODEL|ship MODEL" >&2; exit 2 ;;
esac
