#!/usr/bin/env bash
# Issue 18's GPU figures on the real gemma-3-270m file, run from the repository root on a CUDA machine whose image
# has torch, triton and numpy, with the other wheels in .whl/ (../shared/gpu/prepare-wheels.sh).
#
# The 253 MB model is larger than what one call may carry (64 MiB with the tree), so it travels in pieces: split
# it here into .gemNN/ folders (git-ignored: /.gem*/ in .git/info/exclude), carry one per call, and `stage`
# appends the carried pieces on the machine (which must stay warm between the calls: 30 s);
# `assemble` checks the sha256 and puts the file where `--model gemma-3-270m` finds it.
#
#   f=$KVCHAT_HOME/models/gemma-3-270m-q4_k_m.gguf                      # here, once (the first piece smaller:
#   head -c 38000000 $f > .gem00/00; tail -c +38000001 $f | split -b 46000000 -d -a 2 --numeric-suffixes=1 - p
#   for i in 01 02 03 04 05; do mkdir -p .gem$i; mv p$i .gem$i/$i; done    #  it travels with the wheels)
#   bash docs/gpu/real-model.sh stage tests        # carry .whl and .gem00: install, append, the GPU tests
#   bash docs/gpu/real-model.sh stage              # carry .gem01, then .gem02, ... one call each
#   bash docs/gpu/real-model.sh stage assemble fidelity bytes   # the last piece; verify; the figures
#   bash docs/gpu/real-model.sh bench              # kvchat bench --models gemma-3-270m, 2k and 8k
#   bash docs/gpu/real-model.sh rings              # kvchat bench engine --model gemma-3-270m: rings or not
#   bash docs/gpu/real-model.sh fidelity-krul bench-merge   # issue 19: merged layers (r_l 0.25 and 0.5, checked
#                                                  # and unchecked) against the full cache; kv-merge's bytes and time
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/pkg /tmp/gem && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
MODEL=gemma-3-270m-q4_k_m.gguf
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
kvchat() { python3 -m kvchat.app.cli "$@"; }
for part in "${@:-stage}"; do
  case "$part" in
    stage)  # pieces are named by their order; each is appended once
      for piece in .gem[0-9]*/*; do
        name=$(basename "$piece")
        [ -e "/tmp/gem/done-$name" ] || { cat "$piece" >> /tmp/gem/partial && touch "/tmp/gem/done-$name"; }
      done
      ls /tmp/gem; du -b /tmp/gem/partial ;;
    assemble)
      echo "$SHA  /tmp/gem/partial" | sha256sum -c - || exit 1
      mkdir -p "$KVCHAT_HOME/models" && mv /tmp/gem/partial "$KVCHAT_HOME/models/$MODEL" ;;
    tests)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u;
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
        > "$OUT/machine.txt"
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_attention.py tests/test_gpu.py tests/test_sliding_windows.py \
        tests/test_tiered_kv.py 2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt" ;;
    rings)  # sliding-window layers in rings against a cache of every slot: memory, prefill, decode; three runs
      for run in 1 2 3; do
        kvchat bench engine --model gemma-3-270m --context 2048,8192,30000 --device cuda \
          --json "$OUT/engine-gemma-rings-h100-run$run.json" 2>&1 | tee "$OUT/engine-gemma-rings-h100-run$run.log"
      done ;;
    fidelity)
      kvchat eval --text --model gemma-3-270m --device cuda --lengths 2000,8000,24000 --chats 2 --positions 256 \
        --json > "$OUT/fidelity-gemma-h100.json" 2> "$OUT/fidelity-gemma-h100.log"
      echo "fidelity: exit status $?" ;;
    bytes)  # a ~30k-token chat stored with every layer and trimmed (sliding-window layers)
      python3 docs/probes/window_bytes.py gemma-3-270m 30000 cuda > "$OUT/window-bytes-gemma-h100.json" \
        2> "$OUT/window-bytes.log"; echo "bytes: exit status $?"; cat "$OUT/window-bytes-gemma-h100.json" ;;
    bench)
      timeout 400 python3 -m kvchat.app.cli bench --models gemma-3-270m --workloads 2k,8k --device cuda \
        --repeats 3 --work-dir /tmp/bench-gemma --llama-cpp-budget 0 --json "$OUT/bench-gemma-h100.json" \
        --markdown "$OUT/bench-gemma-h100.md" 2> "$OUT/bench-gemma-h100.log"
      echo "bench: exit status $?"; rm -rf /tmp/bench-gemma ;;
    fidelity-krul)
      for r in 0.25 0.5; do
        for check in checked unchecked; do
          kvchat eval --text --model gemma-3-270m --device cuda --lengths 2000,8000,24000 --chats 2 --positions 256 \
            --kv-policy krul --r-l $r $([ $check = unchecked ] && echo --unchecked) --json \
            > "$OUT/fidelity-krul-$r-$check.json" 2> "$OUT/fidelity-krul-$r-$check.log"
          echo "fidelity krul r_l $r $check: exit status $?"
        done
      done
      cp "$KVCHAT_HOME"/calibrations/*.merges.json "$OUT/" 2>/dev/null ;;
    bench-merge)
      timeout 400 python3 -m kvchat.app.cli bench --models gemma-3-270m --workloads 2k,8k --device cuda \
        --methods prefill,kv-load,kv-merge --repeats 3 --work-dir /tmp/bench-gemma --llama-cpp-budget 0 \
        --json "$OUT/bench-merge-gemma-h100.json" --markdown "$OUT/bench-merge-gemma-h100.md" \
        2> "$OUT/bench-merge-gemma-h100.log"
      echo "bench-merge: exit status $?"; rm -rf /tmp/bench-gemma ;;
    *) echo "usage: $0 [stage|assemble|tests|fidelity|bytes|bench|fidelity-krul|bench-merge]..." >&2; exit 2 ;;
  esac
done
