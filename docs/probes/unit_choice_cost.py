"""Where one louiskv choice's time goes on the GPU (engine.kv.units: unit_scores, slots_of_best_units, then the
lists), at the 8B shape's sizes at 32k (32 global layers, 8 KV heads of 4 query heads, head size 128, ~2,070 units
and ~32,500 retrievable slots per layer and KV head, 1,024 chosen), each part timed alone over many runs queued
back to back (the GPU's time, launches hidden), and ways of ranking the slots beside the one the policy uses: the
torch path (kernels.unit_choice.slots_of_best_units_ref, its parts above it) and the fused Triton kernel that
slots_of_best_units runs on CUDA (issue 44), whose lists are checked to be the torch path's.

    python docs/probes/unit_choice_cost.py [--slots 32500] [--units 2070] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kvchat.engine.kv.units import slots_of_best_units, unit_scores
from kvchat.kernels.unit_choice import slots_of_best_units_ref


def gpu_ms(fn, runs: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32500)
    ap.add_argument("--units", type=int, default=2070)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pool", type=int, default=7)
    args = ap.parse_args()
    g, hkv, h, d, n, u, k, pool = 32, 8, 32, 128, args.slots, args.units, args.tokens, args.pool
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(g, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
    summary = torch.randn(g, hkv, u, 1, d, device=dev, generator=gen)
    member = torch.randint(0, u, (g, hkv, n), device=dev, generator=gen)
    slots = torch.arange(n, device=dev) + 4
    scale = d ** -0.5
    scores = unit_scores(q, summary, scale)
    per_slot = scores.gather(2, member)
    pooled = F.max_pool1d(per_slot.reshape(g * hkv, 1, n), pool, stride=1, padding=pool // 2).view(g, hkv, n)
    bits = pooled.view(torch.int32).long()
    position = torch.arange(n - 1, -1, -1, device=dev)
    key64 = (bits << 32) | position
    key32 = ((pooled.view(torch.int32) >> 16) << 16) | position.to(torch.int32)
    order = torch.topk(key64, k, dim=2, sorted=False).indices
    best = slots[order].sort(dim=2).values.to(torch.int32)
    always = torch.arange(260, device=dev, dtype=torch.int32).expand(g, hkv, -1)
    chosen = torch.zeros(g, hkv, 2048, dtype=torch.int32, device=dev)
    at = torch.arange(g, device=dev)
    redo = torch.ones(g, dtype=torch.bool, device=dev)

    def write():
        lists = torch.cat([always, best], 2).sort(dim=2).values
        m = lists.shape[2]
        chosen[at, :, :m] = torch.where(redo[:, None, None], lists, chosen[at, :, :m])

    grouped = q.float().view(g * hkv, h // hkv, d)
    summary_t = summary[:, :, :, 0].transpose(2, 3).contiguous().view(g * hkv, d, u)  # [G*Hkv, D, U]
    summary_tb = summary_t.to(torch.bfloat16)

    parts = {
        "unit_scores": lambda: unit_scores(q, summary, scale),
        "  its products alone": lambda: q.float().view(g, hkv, h // hkv, d) @ summary[:, :, :, 0].transpose(2, 3),
        "  products, summaries transposed": lambda: torch.bmm(grouped, summary_t),
        "  products in bf16, transposed": lambda: torch.bmm(grouped.to(torch.bfloat16), summary_tb),
        "  softmax and mean": lambda: torch.softmax(torch.bmm(grouped, summary_t) * scale, -1).mean(1),
        "gather per slot": lambda: scores.gather(2, member),
        "max_pool1d": lambda: F.max_pool1d(per_slot.reshape(g * hkv, 1, n), pool, stride=1, padding=pool // 2),
        "int64 keys": lambda: (pooled.view(torch.int32).long() << 32) | position,
        "topk of int64 keys": lambda: torch.topk(key64, k, dim=2, sorted=False),
        "topk of int32 keys": lambda: torch.topk(key32, k, dim=2, sorted=False),
        "topk of the floats": lambda: torch.topk(pooled, k, dim=2, sorted=False),
        "stable sort of the floats": lambda: torch.sort(pooled, dim=2, descending=True, stable=True),
        "slots of the order, sorted": lambda: slots[order].sort(dim=2).values.to(torch.int32),
        "lists written": write,
        "slots_of_best_units, torch (all)": lambda: slots_of_best_units_ref(scores, member, slots, k, pool),
        "  its top-n of the floats": lambda: torch.topk(pooled, k, dim=2, sorted=False).values.amin(2, keepdim=True),
        "slots_of_best_units, fused kernel": lambda: slots_of_best_units(scores, member, slots, k, pool),
    }
    fused, torch_path = slots_of_best_units(scores, member, slots, k, pool), best
    assert torch.equal(fused, torch_path), f"the fused kernel's lists differ in {(fused != torch_path).sum()} places"
    out = {name: gpu_ms(fn) for name, fn in parts.items()}
    for name, ms in out.items():
        print(f"{name:<34} {ms * 1e3:8.1f} us", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "slots": n, "units": u, "tokens": k,
                      "ms": out}))


if __name__ == "__main__":
    main()
