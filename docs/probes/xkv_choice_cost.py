"""Where one xkv choice's time goes on the GPU (issue 43: the decode's setup took 144 ms against kv-split's 81 at 32k
on the 8B Q4_K_M shape with the window of 32, 2026-11-27), at that shape's sizes: 32 global layers, 32 query heads
on 8 KV heads of 128, a 32k-slot input; each part timed alone from a synchronized start to a synchronized end (the
choice reads counts and retentions back to the host, so its parts are timed as it runs them), median of 20 runs:

    slot_mass        the window's attention summed per slot (kernels/slot_mass.py, all layers in one launch),
                     for a window of 8 and of 32 query rows
    pooled           the best of 15 neighbours' scores, ties by their mean (LayerBudgetPolicy.pooled)
    choice           LayerBudgetPolicy.choice_from_scores whole: the per-layer normalization, the global top-N
                     (allocate_top_n), the retentions (a sort of every layer's scores), each layer's top n_i slots
      allocate       allocate_top_n alone
      retention      the sort and cumulative sum alone
      lists          each layer's topk, sort and the window's slots appended, alone (the choice's way before
                     2026-11-28, 14.9 ms of its 15.9 on an H100)
      lists, one sort  the same lists from one descending sort of every layer's scores, each layer's first n_i
                     sorted (6.7 ms: the choice's way since)
      lists, one topk  the same lists from one topk of max(n_i) of every row, the places past each layer's n_i
                     set past every slot, one sort (not timed on a GPU yet)

    python docs/probes/xkv_choice_cost.py [--slots 32768] [--budget 0.2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from kvchat.engine.policies.xkv import XKV, allocate_top_n
from kvchat.kernels.slot_mass import slot_mass


def wall_ms(fn, runs: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32768)
    ap.add_argument("--budget", type=float, default=0.2)
    args = ap.parse_args()
    g, h, hkv, d, s = 32, 32, 8, 128, args.slots
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(g, hkv, s, d, device=dev, dtype=torch.bfloat16, generator=gen)
    cfg = SimpleNamespace(n_layers=g, n_kv_heads=hkv, global_layers=list(range(g)), window=lambda layer: 0)
    policy = XKV(budget=args.budget)
    ms: dict[str, float] = {}
    for rows in (8, 32):
        q = torch.randn(g, rows, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
        ms[f"slot_mass, window {rows}"] = wall_ms(lambda: slot_mass(q, keys, s - rows, None, d ** -0.5))
    rows = policy.window
    mass = slot_mass(q, keys, s - rows, None, d ** -0.5)
    ms["pooled"] = wall_ms(lambda: policy.pooled(mass))
    scores = policy.pooled(mass)
    ms["choice"] = wall_ms(lambda: policy.choice_from_scores(cfg, scores, s, rows))
    per_layer = scores.sum(1)
    per_layer = per_layer / per_layer.sum(1, keepdim=True)
    total = g * (policy.kept_per_layer(s) - rows)
    ms["  allocate"] = wall_ms(lambda: allocate_top_n(per_layer, total))
    counts = allocate_top_n(per_layer, total)
    ms["  retention"] = wall_ms(lambda: [float(x) for x in per_layer.sort(dim=1, descending=True).values.cumsum(1)
                                         .gather(1, torch.tensor(counts, device=dev).clamp_min(1)[:, None] - 1)])
    window_slots = torch.arange(s - rows, s, device=dev)

    def lists():
        for j in range(g):
            top = scores[j].topk(counts[j], dim=1).indices
            torch.cat([top.sort(dim=1).values, window_slots.expand(hkv, -1)], dim=1).to(torch.int32)
    ms["  lists"] = wall_ms(lists)

    def lists_one_sort():
        order = scores.argsort(dim=2, descending=True)
        for j in range(g):
            top = order[j, :, : counts[j]]
            torch.cat([top.sort(dim=1).values, window_slots.expand(hkv, -1)], dim=1).to(torch.int32)
    ms["  lists, one sort"] = wall_ms(lists_one_sort)
    counts_on_device = torch.tensor(counts, device=dev)[:, None, None]

    def lists_one_topk():
        most = max(counts)
        top = scores.topk(most, dim=2, sorted=True).indices
        top = torch.where(torch.arange(most, device=dev) >= counts_on_device, s - rows, top).sort(dim=2).values
        for j in range(g):
            torch.cat([top[j, :, : counts[j]], window_slots.expand(hkv, -1)], dim=1).to(torch.int32)
    ms["  lists, one topk"] = wall_ms(lists_one_topk)
    for name, value in ms.items():
        print(f"{name:<28}{value:8.2f} ms")
    print(json.dumps({"device": torch.cuda.get_device_name(), "slots": s, "budget": args.budget, "counts": counts,
                      "ms": ms}))


if __name__ == "__main__":
    main()
