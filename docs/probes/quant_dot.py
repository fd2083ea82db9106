"""Probe: one-token products with GGUF-quantized matrices of the 8B shape through the integer kernels
(kernels/quant_dot.py: x quantized to int8, dp4a) over a few tiles, beside the float GEMV (kernels/quant_gemv.py,
its default tiles) and the bf16 GEMV (kernels/gemv.py) of the same matrix; and x's quantization itself.
Prints JSON lines: microseconds (triton's do_bench median) and TB/s of the bytes each reads.

    python3 docs/probes/quant_dot.py [--best FILE] [TYPE ...]      (default: the five types with an integer kernel)

--best FILE: each type's tiles with the least summed time over the matrices, as JSON for KVCHAT_QUANT_DOT_TILES.
(on a CUDA machine, with the package importable as kvchat, as docs/gpu/quant-weights.sh sets it up)
"""

from __future__ import annotations

import json
import sys

import torch
from gguf import GGMLQuantizationType as T
from triton.testing import do_bench

from kvchat.kernels.gemv import gemv
from kvchat.kernels.quant_dot import QUANT_DOT_TYPES, quant_dot, quant_dot_ref, quantize_x
from kvchat.kernels.quant_gemv import quant_gemv

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_gemv import MATRICES, random_blocks  # noqa: E402  (the float probe's matrices and random blocks)

# (BLOCK_N, BLOCK_B, num_warps); BLOCK_B counts 256-weight blocks, so the 32-weight types take eight times more.
TILES = [(1, 4, 1), (1, 8, 2), (1, 16, 2), (2, 4, 2), (2, 8, 2), (2, 16, 4), (4, 2, 1), (4, 4, 2), (4, 8, 4),
         (8, 2, 2), (8, 4, 4), (16, 2, 4)]
BLOCK32 = {T.Q8_0, T.Q4_0}


def time_us(fn) -> float:
    return 1000 * do_bench(fn, warmup=25, rep=100)


def main() -> None:
    args = sys.argv[1:]
    best_file = None
    if args[:1] == ["--best"]:
        best_file, args = args[1], args[2:]
    types = [T[name] for name in args] or sorted(QUANT_DOT_TYPES, key=lambda t: t.name)
    summed: dict[tuple[str, tuple[int, int, int]], float] = {}
    for name, n_out, n_in in MATRICES:
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        w16 = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
        us = time_us(lambda: gemv(x, w16))
        print(json.dumps({"matrix": name, "kind": "bf16 gemv", "us": round(us, 1),
                          "TB/s": round(n_out * n_in * 2 / us / 1e6, 3)}), flush=True)
        us = time_us(lambda: quantize_x(x))
        print(json.dumps({"matrix": name, "kind": "quantize x", "us": round(us, 1)}), flush=True)
        xq = quantize_x(x)
        for qtype in types:
            w = random_blocks(qtype, n_out, n_in)
            out = torch.empty(1, n_out, device="cuda", dtype=torch.bfloat16)
            us = time_us(lambda: quant_gemv(x, w, out=out))
            print(json.dumps({"matrix": name, "kind": f"{qtype.name} float", "us": round(us, 1),
                              "TB/s": round(w.nbytes / us / 1e6, 3)}), flush=True)
            if name in ("q", "kv"):  # the kernel's answer against its reference (float64 on the CPU), once per matrix
                want = quant_dot_ref(xq, w)
                got = quant_dot(xq, w, out).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                print(json.dumps({"matrix": name, "kind": f"{qtype.name} int8 check", "max rel err": err}),
                      flush=True)
            for tiles in TILES:
                if qtype in BLOCK32:
                    tiles = (tiles[0], tiles[1] * 8, tiles[2])
                us = time_us(lambda: quant_dot(xq, w, out, tiles=tiles))
                summed[qtype.name, tiles] = summed.get((qtype.name, tiles), 0.0) + us
                print(json.dumps({"matrix": name, "kind": f"{qtype.name} int8", "tiles": tiles, "us": round(us, 1),
                                  "TB/s": round(w.nbytes / us / 1e6, 3)}), flush=True)
    report_best(summed, best_file)


def report_best(summed: dict[tuple[str, tuple[int, int, int]], float], best_file: str | None) -> None:
    """Per key (a type, or TYPE/CLASS) the tiles of least summed time: printed, and written to `best_file` as
    JSON for KVCHAT_QUANT_DOT_TILES."""
    best: dict[str, tuple[int, int, int]] = {}
    for (key, tiles), us in summed.items():
        if key not in best or us < summed[key, best[key]]:
            best[key] = tiles
    print(json.dumps({"best tiles": best, "summed us": {k: round(summed[k, t], 2) for k, t in best.items()}}),
          flush=True)
    if best_file:
        with open(best_file, "w") as f:
            json.dump(best, f)


if __name__ == "__main__":
    main()
