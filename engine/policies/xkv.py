"""XKV (../shared/papers/xkv-per-layer-kv-budgets.txt): each layer its own KV budget, chosen for each message from
how concentrated that layer's attention is. The paper's Alg. 1 gives one slot at a time to the layer whose next
slot adds most to the mean retention R_avg = mean_i R_i(n_i), R_i(n) the share of layer i's pooled window scores w_i
held by its n best slots. Each layer's gains sum(w_i)-normalized and sorted are decreasing, so the greedy is exactly
a global top-N over every layer's w_i / sum(w_i), then a count per layer (`allocate`; the greedy form,
`allocate_greedy`, is what a test checks it against — the paper's pseudocode indexes its lists inconsistently).
Everything else (scores, window, decode) is engine.policies.budgets'.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.engine.policies.budgets import LayerBudgetPolicy


def allocate_top_n(scores: Tensor, total: int) -> list[int]:
    """Slots per layer from a global top-`total` over normalized scores [G, N] (ties go to the lower layer, then the
    lower slot: a stable order)."""
    g, n = scores.shape
    total = min(total, g * n)
    if total <= 0:
        return [0] * g
    flat = scores.float().flatten()
    top = torch.topk(flat, total, sorted=False).indices
    return torch.bincount(top // n, minlength=g).tolist()


def allocate_greedy(scores: Tensor, total: int) -> list[int]:
    """Alg. 1 as written: repeatedly give one slot to the layer whose next-best normalized score is largest."""
    ordered = scores.float().sort(dim=1, descending=True).values.tolist()
    counts = [0] * len(ordered)
    heap = [(-row[0], layer) for layer, row in enumerate(ordered) if row]
    heapq.heapify(heap)
    for _ in range(min(total, sum(map(len, ordered)))):
        _, layer = heapq.heappop(heap)
        counts[layer] += 1
        if counts[layer] < len(ordered[layer]):
            heapq.heappush(heap, (-ordered[layer][counts[layer]], layer))
    return counts


@dataclass(eq=False)
class XKV(LayerBudgetPolicy):
    """Per-layer budgets from a global top-N over the layers' normalized window scores."""

    name = "xkv"

    def allocate(self, scores: Tensor, total: int) -> list[int]:
        return allocate_top_n(scores, total)
