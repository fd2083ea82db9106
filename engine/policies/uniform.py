"""`uniform`: the same budget for every layer, each KV head keeping its top slots by the window's pooled attention
(SnapKV's selection, with engine.policies.budgets' scores and window): the baseline XKV's per-layer budgets are
measured against in the same harness."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvchat.engine.policies.budgets import LayerBudgetPolicy


@dataclass(eq=False)
class UniformBudget(LayerBudgetPolicy):
    name = "uniform"

    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        g, n = scores.shape
        share, extra = divmod(min(total, g * n), g)
        return [min(n, share + (1 if j < extra else 0)) for j in range(g)]
