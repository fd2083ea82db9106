"""Probe: the integer kernels' tiles (kernels/quant_dot.py) per matrix class, timed as a decode step runs them: one
CUDA graph launching the kernel over distinct copies of the matrix (as over the layers; no copy stays in L2),
replayed 20 times. Per-launch microseconds and TB/s of the bytes read, one JSON line per (matrix, type, tile).

    python3 docs/probes/quant_dot_tiles.py [--best FILE] [TYPE ...]     (default: Q4_K Q6_K, Q4_K_M's types)

--best FILE: per type and class (kernels.quant_dot.matrix_class) the tile with the least summed time over the
class's matrices, as JSON for KVCHAT_QUANT_DOT_TILES ("Q4_K/tall": [rows, blocks, warps], ...).
(on a CUDA machine, with the package importable as kvchat, as docs/gpu/quant-weights.sh sets it up)
"""

from __future__ import annotations

import json
import sys

import torch
from gguf import GGMLQuantizationType as T

from kvchat.kernels.quant_dot import matrix_class, quant_dot, quantize_x
from kvchat.kernels.quant_gemv import QuantBlocks

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_dot import report_best  # noqa: E402  (the least summed time per key, as the tiles file)
from quant_gemv import random_blocks  # noqa: E402  (random blocks of a type, repacked)

# The 8B shape's matrices (Llama-3.1-8B: q+k stacked, q+k+v where v shares their type, v alone, o, gate+up, down,
# the output matrix).
MATRICES = [("qk", 5120, 4096), ("qkv", 6144, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
            ("gate_up", 28672, 4096), ("down", 4096, 14336), ("output", 128256, 4096)]
# (BLOCK_N, BLOCK_B, num_warps): each 256-weight type's tile holds BLOCK_N · BLOCK_B · 16 words, at least 32 a warp.
TILES = [(1, 2, 1), (1, 4, 1), (1, 8, 1), (1, 4, 2), (1, 8, 2), (1, 16, 4),
         (2, 1, 1), (2, 2, 1), (2, 4, 1), (2, 4, 2), (2, 8, 2), (2, 8, 4),
         (4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 2, 2), (4, 4, 2), (4, 8, 4),
         (8, 1, 1), (8, 2, 1), (8, 2, 2), (8, 4, 4), (16, 1, 2), (16, 2, 4)]
REPLAYS = 20


def copies_of(w: QuantBlocks, total_bytes: int = 1 << 28) -> list[QuantBlocks]:
    """Enough distinct copies (2 to 32) that together they pass the L2 cache several times over."""
    n = max(2, min(32, total_bytes // w.nbytes))
    return [w] + [QuantBlocks(w.qtype, w.n_in, tuple(f.clone() for f in w.fields)) for _ in range(n - 1)]


def graph_us(xq, ws: list[QuantBlocks], outs: list[torch.Tensor], tiles) -> float:
    """Per launch: one graph of a launch per copy, replayed REPLAYS times, timed with events."""
    for w, out in zip(ws, outs):  # compile and warm outside the capture
        quant_dot(xq, w, out, tiles=tiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, out in zip(ws, outs):
            quant_dot(xq, w, out, tiles=tiles)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(stop) / (REPLAYS * len(ws))


def main() -> None:
    args = sys.argv[1:]
    best_file = None
    if args[:1] == ["--best"]:
        best_file, args = args[1], args[2:]
    types = [T[name] for name in args] or [T.Q4_K, T.Q6_K]
    summed: dict[tuple[str, tuple[int, int, int]], float] = {}
    for name, n_out, n_in in MATRICES:
        xq = quantize_x(torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16))
        kind = matrix_class(n_out, n_in)
        for qtype in types:
            ws = copies_of(random_blocks(qtype, n_out, n_in))
            outs = [torch.empty(1, n_out, device="cuda", dtype=torch.bfloat16) for _ in ws]
            for tiles in TILES:
                try:
                    us = graph_us(xq, ws, outs, tiles)
                except Exception as e:  # a tile the compiler refuses (registers, shared memory): skipped, said
                    print(json.dumps({"matrix": name, "kind": qtype.name, "tiles": tiles, "error": str(e)[:200]}))
                    continue
                key = (f"{qtype.name}/{kind}", tiles)
                summed[key] = summed.get(key, 0.0) + us
                print(json.dumps({"matrix": name, "class": kind, "kind": qtype.name, "tiles": tiles,
                                  "us": round(us, 2), "TB/s": round(ws[0].nbytes / us / 1e6, 3)}), flush=True)
            del ws, outs
            torch.cuda.empty_cache()
    report_best(summed, best_file)


if __name__ == "__main__":
    main()
