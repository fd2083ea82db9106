"""Probe: one-token matrix products (GEMV) of the 8B shape: cuBLAS through F.linear and torch.mv against
kernels/gemv.py over a few tiles. Prints JSON lines: microseconds (triton's do_bench median, L2 flushed between
runs) and TB/s.

    python3 docs/probes/gemv.py
(on a CUDA machine, with the package importable as kvchat, as docs/gpu/decode-kernel.sh sets it up)
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvchat.kernels.gemv import gemv

MATRICES = [("qkv", 6144, 4096), ("wo", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
TILES = [(4, 512, 4, 2), (8, 512, 4, 2), (8, 256, 4, 3), (16, 256, 4, 3), (16, 512, 8, 2), (32, 256, 8, 3),
         (8, 1024, 8, 2), (4, 1024, 4, 3), (2, 1024, 4, 3), (16, 128, 4, 4)]


def main() -> None:
    for name, n_out, n_in in MATRICES:
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        gigabytes = n_out * n_in * 2 / 1e9

        def report(how: str, fn) -> None:
            us = do_bench(fn, warmup=50, rep=300) * 1e3
            print(json.dumps(dict(matrix=name, how=how, us=round(us, 2), tb_s=round(gigabytes / us * 1e3, 2))),
                  flush=True)

        report("F.linear", lambda: F.linear(x, w))
        report("torch.mv", lambda: torch.mv(w, x[0]))
        for tiles in TILES:
            report(f"triton {tiles[0]}x{tiles[1]} w{tiles[2]} s{tiles[3]}", lambda t=tiles: gemv(x, w, tiles=t))


if __name__ == "__main__":
    main()
