"""Probe: one-token products with GGUF-quantized matrices of the 8B shape (kernels/quant_gemv.py) over a few tiles,
beside the bf16 GEMV (kernels/gemv.py) of the same matrix. Prints JSON lines: microseconds (triton's do_bench
median, L2 flushed between runs) and TB/s of the bytes each reads (the quantized blocks, or bf16).

    python3 docs/probes/quant_gemv.py
(on a CUDA machine, with the package importable as kvchat, as docs/gpu/decode-kernel.sh sets it up)
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
from kvchat.kernels.quant_gemv import quant_gemv

MATRICES = [("q", 4096, 4096), ("wo", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
            ("output", 128256, 4096)]
TILES = [(1, 4, 4), (2, 4, 4), (2, 8, 4), (4, 4, 4), (4, 2, 4), (2, 4, 8), (4, 8, 8), (8, 2, 4), (16, 4, 4), (8, 16, 4)]
FP16_FIELDS = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype, n_out: int, n_in: int) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[:, :, at:at + 2] = (rng.uniform(0.5, 2.0, (n_out, n_in // block)) / 64).astype(np.float16)[..., None].view(
            np.uint8)
    return torch.from_numpy(raw.reshape(n_out, -1)).cuda()


def bf16_microseconds(x: torch.Tensor, n_out: int) -> float:
    """The bf16 GEMV of the same shape (its weight freed before the quantized ones are made)."""
    w = torch.randn(n_out, x.shape[1], device="cuda", dtype=torch.bfloat16)
    return 1000 * do_bench(lambda: gemv(x, w), warmup=25, rep=200)


def main() -> None:
    types = [T[name] for name in sys.argv[1:]] or [T.Q4_K, T.Q6_K, T.Q8_0]
    for name, n_out, n_in in MATRICES:
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        us = bf16_microseconds(x, n_out)
        print(json.dumps({"matrix": name, "kind": "bf16 gemv", "us": round(us, 1),
                          "TB/s": round(n_out * n_in * 2 / us / 1e6, 3)}), flush=True)
        for qtype in types:
            raw = random_blocks(qtype, n_out, n_in)
            for tiles in TILES:
                us = 1000 * do_bench(lambda: quant_gemv(x, raw, qtype, tiles=tiles), warmup=25, rep=200)
                print(json.dumps({"matrix": name, "kind": qtype.name, "tiles": tiles, "us": round(us, 1),
                                  "TB/s": round(raw.numel() / us / 1e6, 3)}), flush=True)


if __name__ == "__main__":
    main()
