"""Where a prefill's and a decode step's GPU time goes, kernel by kernel (issue 41): the 8B-shape model kept in its
GGUF blocks against dequantized at load, same file, same tokens, one process.

    python3 docs/probes/quant_profile.py --shape llama-3.1-8b --qtype Q4_K_M --cache-dir /tmp/bench-models \
        --context 8192 --weights quantized,dequantized > profile.json

For each path: one prefill of `--context` random tokens and 8 decode steps replayed from the CUDA graph after a
prefill of the same length, under torch.profiler (CUPTI sees the kernels inside a graph). Printed per path and
phase: wall time, the sum of kernel times (busy), the share of the span with no kernel running (gaps: launches,
host syncs), and the kernels grouped by name with count, total and mean. One JSON object a path on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvchat.app.bench.engine_speed import model_file
from kvchat.engine.engine import Engine
from kvchat.engine.model.cuda_graph import decoder_step


def kernels(prof) -> list[dict]:
    """The profile's GPU kernels (name, start, duration in µs), from its Chrome trace."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    return [{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel"]


def summary(events: list[dict], wall_ms: float, top: int = 25) -> dict:
    if not events:
        return {"wall_ms": wall_ms, "kernels": 0}
    events.sort(key=lambda e: e["ts"])
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    busy, end = 0.0, events[0]["ts"]
    for e in events:  # the union of kernel intervals (one stream: they do not overlap, but be safe)
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            busy += stop - start
            end = stop
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e["name"][:90]].append(e["dur"])
    groups = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"wall_ms": round(wall_ms, 3), "kernels": len(events), "span_ms": round(span / 1e3, 3),
            "busy_ms": round(busy / 1e3, 3), "gap_share": round(1 - busy / span, 4),
            "by_name": [{"name": n, "count": len(d), "total_ms": round(sum(d) / 1e3, 3),
                         "mean_us": round(sum(d) / len(d), 2)} for n, d in groups[:top]]}


@torch.inference_mode()
def profile_path(path: Path, quantized: bool, context: int, steps: int) -> dict:
    engine = Engine(path, device="cuda", quantized=quantized)
    model = engine.model
    tokens = torch.randint(0, engine.config.vocab_size, (context,), generator=torch.Generator().manual_seed(context))

    def prefill():
        cache = model.new_cache(context + steps + 1)
        h = model.run_layers(model.embed(tokens), torch.arange(context), cache, 0)
        model.head(h[-1:])
        return cache

    prefill()  # warm-up: kernels compiled, allocator grown
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prefill()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    out = {"quantized": quantized, "context": context, "prefill": summary(kernels(prof), wall)}

    cache = model.new_cache(context + 2 * steps + 2)
    model(tokens, cache)
    step = decoder_step(model, cache, context + 2 * steps + 2, True)
    for _ in range(steps):  # capture and warm-up
        step(1)
    cache.truncate(context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            int(torch.argmax(step(1)))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    out["decode"] = summary(kernels(prof), wall)
    out["decode"]["steps"] = steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--qtype", default="Q4_K_M")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench-models"))
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--weights", default="quantized,dequantized")
    args = parser.parse_args()
    path = model_file(args.cache_dir, args.shape, args.qtype)
    for weights in args.weights.split(","):
        result = profile_path(path, weights == "quantized", args.context, args.steps)
        gc.collect()  # the model, its cache and captured graph, before the next path loads
        torch.cuda.empty_cache()
        print(json.dumps(result), flush=True)
        for phase in ("prefill", "decode"):
            s = result[phase]
            print(f"{weights} {phase}: wall {s['wall_ms']} ms, busy {s.get('busy_ms')} ms, gaps {s.get('gap_share')}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
