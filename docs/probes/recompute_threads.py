"""Probe: how fast the recompute stream's pyramid runs by where it is queued from (GPU).

A random-weight model (the bench's cached file), random tokens, every layer recomputed for n tokens, as one layer
group and as four: on the main thread or a thread of its own, on the caller's stream or the recompute stream; and,
for reference, the model's own chunked prefill (generate.prefill). Host time to queue everything and total time,
median of 5 after a warm-up, as JSON lines.

    python docs/probes/recompute_threads.py MODEL.gguf
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch

from kvchat.engine.engine import Engine
from kvchat.engine.generate import prefill
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep


def main() -> None:
    engine = Engine(sys.argv[1], device="cuda")
    L, V = engine.config.n_layers, engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for n in (362, 1804, 4043, 7544, 16384):
        ids = torch.randint(0, V, (n,), generator=gen).tolist()
        row = {"tokens": n}

        def timed(run) -> dict:
            runs = []
            for _ in range(6):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                launched = run()
                torch.cuda.synchronize()
                runs.append((launched, time.perf_counter() - t0))
            runs = runs[1:]
            return {"launch_ms": 1000 * statistics.median(r[0] for r in runs),
                    "total_ms": 1000 * statistics.median(r[1] for r in runs)}

        def prefill_ref():
            cache = engine.new_cache(n + 8)
            t0 = time.perf_counter()
            prefill(engine.model, cache, ids)
            return time.perf_counter() - t0

        row["generate.prefill"] = timed(prefill_ref)
        for groups in (1, 4):
            for where in ("main", "thread"):
                for side in (False, True):
                    def pyramid():
                        cache = engine.new_cache(n + 8)
                        cuts = [round(i * L / groups) for i in range(groups + 1)]
                        steps = [PyramidStep(range(a, b), n, cache) for a, b in zip(cuts, cuts[1:])]
                        run = PrefixRecompute(engine.model, ids, steps, side_stream=side)
                        if where == "main":
                            run.run()
                        else:
                            worker = threading.Thread(target=run.run)
                            worker.start()
                            worker.join()
                        return run.launched_s
                    row[f"{groups}g-{where}-{'side' if side else 'default'}"] = timed(pyramid)
        print(json.dumps(row))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
