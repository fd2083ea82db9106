"""Probe: why a restore's recompute stream runs slower beside the load stream than alone (GPU), from the kernels'
timeline.

On each chat stored by `kvchat bench` (its --work-dir), the first `--share` of its rounds is recomputed alone, then
recomputed while the rest is loaded (a fixed plan), and everything is loaded (kv-load), each once as a warm-up and
once under the CUDA profiler (CUPTI only: the host is not slowed). Per CUDA stream: its kernels' summed time, the
span from its first start to its last end, the idle time inside that span, and its matrix products' mean time. If
the matrix products take longer beside the loads, the device is shared (SMs, memory, clocks); if the span grows
with the same kernel time, the stream waited (for the host, or for a synchronization). JSON lines.

    python docs/probes/restore_trace.py --home WORK/llama-3.1-8b/home --model MODEL.gguf
(with the package importable as kvchat, as docs/gpu/bench-resume.sh sets it up)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from restore_streams import bench_chat_runs, bench_chats  # beside this file

from kvchat.storage.prefetch import SegmentPrefetcher

GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "sm90")


def device_events(fn) -> tuple[list[dict], object]:
    """Run fn under the CUDA profiler: its kernels, copies and sets from the chrome trace, and fn's result."""
    if not torch.cuda.is_available():
        return [], fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], result


def per_stream(events: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for e in events:
        s = out.setdefault(str(e.get("args", {}).get("stream")), {"events": 0, "busy_ms": 0.0, "copy_ms": 0.0,
                                                                   "gemm_n": 0, "gemm_ms": 0.0, "spans": []})
        dur = e["dur"] / 1000
        s["events"] += 1
        s["busy_ms"] += dur
        if e["cat"] == "gpu_memcpy":
            s["copy_ms"] += dur
        if e["cat"] == "kernel" and any(n in e["name"].lower() for n in GEMM_NAMES):
            s["gemm_n"] += 1
            s["gemm_ms"] += dur
        s["spans"].append((e["ts"] / 1000, e["ts"] / 1000 + dur))
    for s in out.values():
        spans = sorted(s.pop("spans"))
        covered, end = 0.0, spans[0][0]
        for a, b in spans:
            covered += max(0.0, b - max(a, end))
            end = max(end, b)
        s["span_ms"] = end - spans[0][0]
        s["idle_ms"] = s["span_ms"] - covered
        s["gemm_mean_us"] = 1000 * s["gemm_ms"] / s["gemm_n"] if s["gemm_n"] else None
        s["first_ms"] = spans[0][0]
    first = min(s["first_ms"] for s in out.values()) if out else 0.0
    for s in out.values():
        s["first_ms"] -= first  # when each stream started, from the first event of the run
    return out


@contextlib.contextmanager
def variant(spec: str):
    """`switch=S` (the interpreter's GIL switch interval, seconds) and/or `decoders=N` (segment decoding threads),
    comma-separated; `base` changes nothing."""
    switch, decoders = sys.getswitchinterval(), SegmentPrefetcher.__dict__["decode_threads"]  # the staticmethod
    try:
        for part in spec.split(","):
            key, _, value = part.partition("=")
            if key == "switch":
                sys.setswitchinterval(float(value))
            elif key == "decoders":
                SegmentPrefetcher.decode_threads = staticmethod(lambda n=int(value): n)
        yield
    finally:
        sys.setswitchinterval(switch)
        SegmentPrefetcher.decode_threads = decoders


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--share", type=float, default=0.5, help="the share of the rounds recomputed")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the steps (no kernel timeline)")
    parser.add_argument("--variants", default="", help="also the split under these settings (see `variant`), "
                                                      "separated by spaces, e.g. 'switch=0.0002 decoders=4'")
    args = parser.parse_args()
    engine, store, chats = bench_chats(args.home, args.model, args.device)
    for info in chats:
        rounds = store.rounds(info["id"])
        k = max(1, int(len(rounds) * args.share))
        recompute_k, restore = bench_chat_runs(engine, store, info)
        row = {"tokens": rounds[-1].token_end, "rounds": len(rounds), "k": k, "k_tokens": rounds[k - 1].token_end}
        for name, fn in (("alone", lambda: recompute_k(k)), ("split", lambda: restore(k)),
                         ("kv_load", lambda: restore(None))):
            fn()  # warm-up: allocations, page cache
            events, stats = device_events(fn)
            row[name] = {"stats": stats, "streams": per_stream(events)}
        for spec in args.variants.split():
            with variant(spec):
                restore(k)
                events, stats = device_events(lambda: restore(k))
            row[f"split {spec}"] = {"stats": stats, "streams": per_stream(events)}
        print(json.dumps(row))
        sys.stdout.flush()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
