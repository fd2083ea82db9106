"""Probe: how fast the host queues a restore's recompute, by how many threads decode segments beside it (GPU).

On each chat stored by `kvchat bench` (its --work-dir), the first half of its rounds recomputed alone, everything
loaded (kv-load), and the split restore with 16, 12, 8, 6, 4 and 2 decoding threads (each the median of 5 after a
warm-up). JSON lines; `launch_ms` is how long the restoring thread took to queue the recompute.

    python docs/probes/restore_threads.py --home WORK/llama-3.1-8b/home --model MODEL.gguf
(with the package importable as kvchat, as docs/gpu/bench-resume.sh sets it up)
"""

from __future__ import annotations

import argparse
import json
import sys

from restore_streams import bench_chat_runs, bench_chats, median_of  # beside this file

from kvchat.storage.prefetch import SegmentPrefetcher

THREADS = (16, 12, 8, 6, 4, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    engine, store, chats = bench_chats(args.home, args.model, "cuda")
    for info in chats:
        rounds = store.rounds(info["id"])
        k = len(rounds) // 2
        alone, restore = bench_chat_runs(engine, store, info)
        restore(None), restore(k), alone(k)  # warm-up
        out = {"tokens": rounds[-1].token_end, "k": k, "k_tokens": rounds[k - 1].token_end,
               "alone": median_of(args.runs, lambda: alone(k)), "kv_load": median_of(args.runs, lambda: restore(None))}
        for t in THREADS:
            SegmentPrefetcher.decode_threads_beside_compute = staticmethod(lambda t=t: t)
            restore(k)
            out[f"t{t}"] = median_of(args.runs, lambda: restore(k))
        print(json.dumps(out))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
