"""Krul's cross-layer merge (krul-cross-layer-kv-restoration.txt §4-5) as a KV policy: the closed rounds' K/V of
the chosen layer pairs is what a restore of them stored merged gives back (engine.kv.cross_layer); every round is
still visible at every layer.

The pairs are chosen per chat, when its history is about to be read (`prepare`): probes at the ends of its last
closed rounds give its `LayerStats`, and Algorithm 1 takes pairs in their order until `r_l` of the layers are merged
(engine.policies.merge_selection). `checked` (the default) limits them to the pairs the model's check accepted
(engine.calibrate.merge_check), handed in as `pairs` by whoever builds the policy (app/session/policies.py makes the
check on the model's first use, like the watershed calibration); unchecked is Krul as published.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.cross_layer import LayerPair, merge_in_cache, restore_in_cache
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.layer_stats import PROBE_ROWS, LayerStats
from kvchat.engine.policies.merge_selection import GAMMA, RETAIN, choose_pairs
from kvchat.errors import KvchatError

PROBED_ROUNDS = 8  # the chat's last closed rounds probed for its statistics


@dataclass(eq=False)  # identity equality and hashing, as before policies were dataclasses
class KrulMerge(KVPolicy):
    name = "krul"

    r_l: float = 0.5
    checked: bool = True
    retain: float = RETAIN
    gamma: float = GAMMA
    pairs: list[LayerPair] | None = None  # the model's checked pairs (None: any, when unchecked)
    # merged for the latest message (for stats and tests): state, not a parameter
    last_pairs: list[LayerPair] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.r_l <= 1:
            raise KvchatError(f"r_l is the share of layers merged, in [0, 1], not {self.r_l}")
        if not 0 <= self.retain <= 1:
            raise KvchatError(f"retain is the share of tokens kept unmerged, in [0, 1], not {self.retain}")

    def calibration_needed(self) -> tuple[str, ...]:
        return ("pairs",) if self.checked and self.pairs is None else ()

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return None

    def prepare(self, model: Transformer, cache: KVCache, round_starts: list[int],
                history: list[int]) -> Callable[[], None] | None:
        stats = LayerStats(model.cfg.n_layers)
        ends = (round_starts[1:] + [cache.length])[-PROBED_ROUNDS:] if round_starts else []
        stats.add_probes(model, cache, [(end, history[max(0, end - PROBE_ROWS):end]) for end in ends])
        self.last_pairs = choose_pairs(stats, model.cfg, self.r_l, self.gamma, self.pairs)
        if not self.last_pairs:
            return None
        pairs, length = self.last_pairs, cache.length
        saved = merge_in_cache(cache, pairs, 0, length, self.retain)
        return lambda: restore_in_cache(cache, pairs, 0, saved)
