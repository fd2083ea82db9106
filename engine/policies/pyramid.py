"""`pyramid`: PyramidKV's fixed schedule, as kvpress has it (PyramidKVPress.get_layer_budget): budgets fall
linearly from the first layer to the last, the last getting 1/beta of the mean (beta = 20) and the first twice the
mean less that, so their mean is the policy's budget. Selection and scores as engine.policies.budgets'; a baseline
for XKV's budgets that follow each message's attention rather than a shape fixed in advance."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvchat.engine.policies.budgets import LayerBudgetPolicy
from kvchat.errors import KvchatError


def pyramid_counts(layers: int, mean: float, candidates: int, beta: float = 20.0) -> list[int]:
    """Slots per layer (first to last) on PyramidKV's line with the given mean, each in [0, candidates]; when the
    line would leave [0, candidates] (a budget near the whole input), every layer gets the mean, as kvpress falls
    back to SnapKV's uniform budget then."""
    low = mean / beta
    high = 2 * mean - low
    if layers == 1 or high > candidates:
        return [min(candidates, round(mean))] * layers
    step = (high - low) / (layers - 1)
    counts = [round(high - j * step) for j in range(layers)]
    # the rounding may leave the sum a few slots off the mean's total: settle it on the first layers
    gap = round(mean * layers) - sum(counts)
    j = 0
    while gap and j < 4 * layers:
        layer = j % layers
        if gap > 0 and counts[layer] < candidates:
            counts[layer] += 1
            gap -= 1
        elif gap < 0 and counts[layer] > 0:
            counts[layer] -= 1
            gap += 1
        j += 1
    return counts


@dataclass(eq=False)
class PyramidBudget(LayerBudgetPolicy):
    name = "pyramid"

    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise KvchatError(f"beta (the first layer's budget over the last's, kvpress's) is at least 1, not "
                              f"{self.beta}")

    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        g, n = scores.shape
        return pyramid_counts(g, min(total, g * n) / g, n, self.beta)
