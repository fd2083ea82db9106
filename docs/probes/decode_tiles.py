"""Probe: the decode attention kernel's tiles and split counts against SDPA, for the 8B shape (32 query heads, 8 KV
heads, D = 128, bf16) on the current GPU; and where one captured decode step of a model spends its time.

    python docs/probes/decode_tiles.py tiles            # kernel microseconds per layer, per configuration
    python docs/probes/decode_tiles.py profile MODEL.gguf 1024 32768
(with the package importable as kvchat, as docs/gpu/decode-kernel.sh sets it up)

Prints JSON lines. Each configuration is timed by triton.testing.do_bench (median of its runs) inside one process,
so the rows compare with each other; the engine-level figures come from `kvchat bench engine`.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from kvchat.kernels import decode_attention as kernel


def tiles(lengths=(1024, 8192, 32768, 65536)) -> None:
    from triton.testing import do_bench

    n_heads, n_kv, d = 32, 8, 128
    for n in lengths:
        cap = n + 64
        q = torch.randn(n_heads, d, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(2, n_kv, cap, d, device="cuda", dtype=torch.bfloat16)
        length = torch.tensor([n], device="cuda")
        mask = (torch.arange(cap, device="cuda") < n)[None, None, None, :]
        grouped = q.view(n_kv, n_heads // n_kv, d)[None]
        sdpa = do_bench(lambda: F.scaled_dot_product_attention(grouped, kv[0][None], kv[1][None], attn_mask=mask))
        floor_us = 2 * n_kv * n * d * 2 / 3.35e12 * 1e6
        print(json.dumps(dict(length=n, sdpa_masked_us=round(sdpa * 1000, 1), floor_us=round(floor_us, 1))))
        original = kernel._tiles
        for block_n, warps, stages in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3),
                                       (64, 2, 3), (32, 2, 3)]:
            kernel._tiles = lambda *a, t=(block_n, warps, stages): t
            for splits in (None, 16, 32, 64, 128):
                try:
                    us = do_bench(lambda: kernel.decode_attention(q, kv[0], kv[1], length, n_splits=splits)) * 1000
                except Exception as error:  # a tile that does not compile
                    us = repr(error)[:80]
                print(json.dumps(dict(length=n, block_n=block_n, warps=warps, stages=stages,
                                      splits=splits or kernel.default_splits(n_kv, cap, q.device),
                                      us=us if isinstance(us, str) else round(us, 1))))
        kernel._tiles = original


def profile(path: str, *contexts: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from kvchat.engine.model.cuda_graph import GraphedDecode
    from kvchat.engine.engine import Engine

    engine = Engine(path, device="cuda")
    m = engine.model
    for ctx in map(int, contexts):
        cache = m.new_cache(ctx + 64)
        cache.length = ctx  # the K/V values do not change the time
        step = GraphedDecode(m, cache, ctx + 64)
        for _ in range(5):
            cache.length = ctx
            step(1)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                cache.length = ctx
                step(1)
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            if e.device_time_total > 0:
                rows.append((e.device_time_total / 10, e.count // 10, e.key[:90]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(json.dumps(dict(context=ctx, kernel_us_per_token=round(total, 1),
                              kernels_per_token=sum(r[1] for r in rows))))
        for us, count, name in rows[:25]:
            print(json.dumps(dict(context=ctx, us=round(us, 1), count=count, kernel=name)))
        del step, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1] == "tiles":
        tiles()
    else:
        profile(*sys.argv[2:])
