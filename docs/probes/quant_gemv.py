"""Probe: one-token products with GGUF-quantized matrices of the 8B shape (kernels/quant_gemv.py) over a few tiles,
beside the bf16 GEMV (kernels/gemv.py) of the same matrix; and the prefill's band dequantizer over a few tiles.
Prints JSON lines: microseconds (triton's do_bench median) and TB/s of the bytes each reads (the quantized blocks,
or bf16) or, for the dequantizer, of the bf16 it writes.

    python3 docs/probes/quant_gemv.py [TYPE ...]      (default: the six types with a kernel)
(on a CUDA machine, with the package importable as kvchat, as docs/gpu/quant-weights.sh sets it up)
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from triton.testing import do_bench

from kvchat.kernels.gemv import gemv
from kvchat.kernels.quant_gemv import QUANT_GEMV_TYPES, dequantize_rows, quant_gemv, repack

MATRICES = [("q", 4096, 4096), ("kv", 1024, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
            ("output", 128256, 4096)]
# (BLOCK_N, BLOCK_B, num_warps); BLOCK_B counts 256-weight blocks, so the 32-weight types take eight times more.
TILES = [(1, 4, 2), (1, 8, 2), (2, 4, 2), (2, 8, 2), (4, 4, 2), (8, 2, 2), (2, 2, 4), (4, 2, 4), (4, 4, 4),
         (8, 1, 4), (8, 2, 4), (8, 4, 4), (16, 1, 4), (16, 2, 8)]
DEQUANT_TILES = [(4, 1, 4), (8, 1, 4), (16, 1, 4), (16, 2, 4), (32, 1, 4), (32, 2, 8), (64, 1, 8), (8, 4, 4)]
FP16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
BLOCK32 = {T.Q8_0, T.Q4_0, T.Q5_0}


def random_blocks(qtype, n_out: int, n_in: int):
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[:, :, at:at + 2] = (rng.uniform(0.5, 2.0, (n_out, n_in // block)) / 64).astype(np.float16)[..., None].view(
            np.uint8)
    return repack(torch.from_numpy(raw.reshape(n_out, -1)).cuda(), qtype, n_in)


def bf16_microseconds(x: torch.Tensor, n_out: int) -> float:
    """The bf16 GEMV of the same shape (its weight freed before the quantized ones are made)."""
    w = torch.randn(n_out, x.shape[1], device="cuda", dtype=torch.bfloat16)
    return 1000 * do_bench(lambda: gemv(x, w), warmup=25, rep=100)


def main() -> None:
    types = [T[name] for name in sys.argv[1:]] or sorted(QUANT_GEMV_TYPES, key=lambda t: t.name)
    for name, n_out, n_in in MATRICES:
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        us = bf16_microseconds(x, n_out)
        print(json.dumps({"matrix": name, "kind": "bf16 gemv", "us": round(us, 1),
                          "TB/s": round(n_out * n_in * 2 / us / 1e6, 3)}), flush=True)
        for qtype in types:
            w = random_blocks(qtype, n_out, n_in)
            for tiles in TILES:
                if qtype in BLOCK32:
                    tiles = (tiles[0], tiles[1] * 8, tiles[2])
                us = 1000 * do_bench(lambda: quant_gemv(x, w, tiles=tiles), warmup=25, rep=100)
                print(json.dumps({"matrix": name, "kind": qtype.name, "tiles": tiles, "us": round(us, 1),
                                  "TB/s": round(w.nbytes / us / 1e6, 3)}), flush=True)
            if name in ("gate_up", "down"):  # a prefill band: 2^24 weights (engine/model/quantized.py)
                band = w.row_slice(0, (1 << 24) // n_in)
                out = torch.empty(band.n_out, n_in, device="cuda", dtype=torch.bfloat16)
                for tiles in DEQUANT_TILES:
                    if qtype in BLOCK32:
                        tiles = (tiles[0], tiles[1] * 8, tiles[2])
                    us = 1000 * do_bench(lambda: dequantize_rows(band, torch.bfloat16, out=out, tiles=tiles),
                                         warmup=25, rep=100)
                    print(json.dumps({"matrix": name, "kind": f"{qtype.name} dequantize band", "tiles": tiles,
                                      "us": round(us, 1), "TB/s written": round(out.numel() * 2 / us / 1e6, 3)}),
                          flush=True)


if __name__ == "__main__":
    main()
