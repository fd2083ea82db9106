"""Which layer pairs a chat's K/V is merged in (Krul Algorithm 1).

Algorithm 1 from a chat's `LayerStats`: layers whose late queries put less than `gamma` of their attention on the
first and last 10% of the chat are input-sensitive (non-I-R) and never merged; every two remaining layers are
ranked by the distance of their attention profiles, and pairs are taken in that order, each layer at most once,
until the merged layers reach `r_l` of the model's layers. Two layers are only paired when both are sliding-window
layers or both global (Gemma 3): a window layer's stored K/V is mostly its window.

Krul trusts the statistic; on the embedded model it picks a pair that costs recall (issue 19), so a chat's choice
can be limited to the pairs the model's check accepted (engine.calibrate.merge_check, handed in as `allowed`): a
chat then takes, in the order of its own statistics, the accepted pairs whose layers are I-R in it (`choose_pairs`).
"""

from __future__ import annotations

from kvchat.engine.kv.cross_layer import LayerPair
from kvchat.engine.policies.layer_stats import LayerStats

# A layer whose late queries give the chat's first and last 10% less than this share of their attention is
# input-sensitive. Uniform attention gives 0.2; the I-R layers of Krul's Figure 5 give well over half.
GAMMA = 0.5
RETAIN = 0.05  # share of a round's tokens kept unmerged in each pair (MiniCache's retention)


def candidate_pairs(stats: LayerStats, cfg, gamma: float = GAMMA) -> list[LayerPair]:
    """Every pair of I-R layers of one window kind, most similar attention first (Algorithm 1 lines 1-13)."""
    share, dist = stats.ir_share(), stats.mean_distance()
    ir = [i for i in range(cfg.n_layers) if share[i] >= gamma]
    pairs = [LayerPair(i, j) for n, i in enumerate(ir) for j in ir[n + 1:]
             if bool(cfg.window(i)) == bool(cfg.window(j))]
    return sorted(pairs, key=lambda p: (dist[p.low][p.high], p))


def greedy_pairs(ranked: list[LayerPair], n_layers: int, r_l: float) -> list[LayerPair]:
    """Disjoint pairs in rank order until they hold at least r_l of the layers (Algorithm 1 lines 14-22)."""
    chosen, used = [], set()
    for pair in ranked:
        if len(used) >= n_layers * r_l:
            break
        if pair.low in used or pair.high in used:
            continue
        chosen.append(pair)
        used |= {pair.low, pair.high}
    return chosen


def choose_pairs(stats: LayerStats, cfg, r_l: float, gamma: float = GAMMA,
                 allowed: list[LayerPair] | None = None) -> list[LayerPair]:
    """A chat's pairs: Algorithm 1 on its statistics, restricted to `allowed` (the model's checked pairs)."""
    if r_l <= 0 or stats.probes == 0:
        return []
    ranked = candidate_pairs(stats, cfg, gamma)
    if allowed is not None:
        ok = set(allowed)
        ranked = [p for p in ranked if p in ok]
    return greedy_pairs(ranked, cfg.n_layers, r_l)
