"""`louiskv` (../shared/papers/louiskv-kv-retrieval.txt, louiskv-design-notes.md): the reply retrieves k-means
clusters of the chat's keys (engine.kv.units.cluster_units: ~16 keys a cluster, per layer and KV head, each round's
once) by query . centroid, and retrieves again only at semantic boundaries: after a token whose queries turned away
from the last token's, r = mean over query heads of cos(q_prev, q) below `tau`, per layer. Between boundaries the
retrieved slots are reused. Everything else is engine.policies.unit_retrieval's.

`tau` is the model's, one per global layer (engine.calibrate.retrieval_trigger: LouisKV sets it once per model from
validation samples; 0.7 was reported for Qwen3-8B), handed in by whoever builds the policy; a single number applies
to every layer (`--option tau=0.7`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.units import Units, cluster_units, page_units, round_units, sliced, unit_bounds
from kvchat.engine.policies.unit_retrieval import UnitRetrievalPolicy, span_keys
from kvchat.errors import KvchatError


def query_similarity(previous: Tensor, current: Tensor) -> Tensor:
    """r per layer: queries [G, H, D] of two consecutive tokens -> [G], the mean over query heads of their cosine."""
    return F.cosine_similarity(previous.float(), current.float(), dim=-1).mean(-1)


@dataclass(eq=False)
class LouisKV(UnitRetrievalPolicy):
    name = "louiskv"

    tau: tuple[float, ...] | float | None = None  # per global layer: retrieve again when r falls below it
    # A chosen slot's neighbours come with it (engine.policies.unit_retrieval): a cluster gathers alike keys from
    # anywhere in its round, and copying a value needs the slots after the one attended to. On the embedded model's
    # development chats (20, compare mode, budget 1,024 of ~3,070 tokens): recall 26.5% without, 36.0% with 7,
    # 35.2% with 15; the full cache 41.1%, Quest's pages 37.2% (docs/benchmarks.md, "LouisKV").
    pool: int = 7
    iterations: int = 8  # k-means iterations per round
    # How the input's units are scored: "centroid", LouisKV's q . centroid; "bounds", each cluster's keys' min and
    # max as Quest bounds a page; "pages", Quest's pages of `unit_tokens` in place of the clusters (the trigger
    # kept). The last two are made from the keys each time (a lazy resume brings those slots in first). On the
    # embedded model's development chats at 1,024 slots: 147 / 151 / 150 answers of the full cache's 166, and with
    # `instep=1` 150 / 150 / 158 (docs/benchmarks.md, "LouisKV: the query a choice is made with").
    summary: str = "centroid"
    _tau_tensor: Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.tau, str):  # --option tau=0.7 or tau=0.61,0.74,... (one per global layer)
            try:
                parts = [float(t) for t in self.tau.split(",")]
            except ValueError:
                raise KvchatError(f"tau is a number, or one per global layer separated by commas, not "
                                  f"{self.tau!r}") from None
            self.tau = parts[0] if len(parts) == 1 else tuple(parts)
        if isinstance(self.tau, (int, float)):
            self.tau = float(self.tau)
        elif self.tau is not None:
            self.tau = tuple(float(t) for t in self.tau)
        taus = () if self.tau is None else (self.tau,) if isinstance(self.tau, float) else self.tau
        if not all(-1.0 <= t <= 1.0 for t in taus) or self.iterations < 1:
            raise KvchatError("tau is a cosine similarity in [-1, 1] and iterations at least 1")
        if self.summary not in ("centroid", "bounds", "pages"):
            raise KvchatError(f"the louiskv policy's units are scored by their centroid, bounds or pages, not "
                              f"{self.summary!r}")

    def calibration_needed(self) -> tuple[str, ...]:
        return ("tau",) if self.tau is None else ()

    def check_model(self, model) -> None:
        n_global = sum(1 for layer in model.layers if not layer.window)
        if isinstance(self.tau, tuple) and len(self.tau) != n_global:
            raise KvchatError(f"the louiskv policy has {len(self.tau)} thresholds (tau) for a model of {n_global} "
                              f"global layers")

    def units(self, cache: KVCache, layers: list[int], start: int, end: int) -> Units:
        if self.summary == "pages":  # Quest's pages in place of the clusters (the trigger kept)
            return page_units(span_keys(cache, layers, start, end), start, self.unit_tokens)
        got = self._units(cache, layers, start, end)
        if self.summary == "bounds":  # each unit's members' min and max keys (of the span's slots alone)
            return unit_bounds(span_keys(cache, layers, got.start, got.end), got)
        return got

    def _units(self, cache: KVCache, layers: list[int], start: int, end: int) -> Units:
        # A closed round's units are its whole round's (those stored with the chat, or those its save built), kept
        # in the cache (KVCache.units) and sliced to the span; a round without them (a chat from before, or saved
        # under another policy) is clustered whole, once. A span of the new message itself is clustered alone.
        closed = self._closed_round(start, end)
        if closed is None:
            return cluster_units(span_keys(cache, layers, start, end), start, self.unit_tokens, self.iterations)
        got = cache.units.get(closed)
        if got is None:
            got = cluster_units(span_keys(cache, layers, *closed), closed[0], self.unit_tokens, self.iterations)
            cache.units[closed] = got
        return sliced(got, start, end)

    def keys_for_units(self, cache: KVCache, start: int, end: int) -> tuple[int, int] | None:
        closed = self._closed_round(start, end)
        if closed is None or self.summary == "pages":
            return start, end
        if closed not in cache.units:
            return closed  # clustered whole first
        return (start, end) if self.summary == "bounds" else None  # bounds are made from the span's keys each time

    def _closed_round(self, start: int, end: int) -> tuple[int, int] | None:
        """The closed round [a, b) that slots [start, end) lie in, or None (the new message's own span)."""
        return next(((a, b) for a, b in itertools.pairwise(self._round_starts) if a <= start and end <= b), None)

    def round_units(self, cache: KVCache, layers: list[int], start: int, reply_at: int, end: int) -> Units:
        """The units a round [start, end) is stored with: its message (up to `reply_at`) in clusters, its reply in
        segments cut where the trigger fired while it was written (`reply_cuts`, the latest reply's: each global
        layer's own), or in segments of twice the clusters' size where no trigger was watched (a reply that read
        the whole chat)."""
        keys = span_keys(cache, layers, start, end)
        n_reply = max(end - max(reply_at, start), 0)
        cuts = None
        if self.reply_cuts and n_reply:
            recorded = torch.stack(self.reply_cuts[:n_reply], dim=1)  # [G, m]
            cuts = torch.zeros(len(layers), n_reply, dtype=torch.bool)
            cuts[:, : recorded.shape[1]] = recorded
        return round_units(keys, start, reply_at, cuts, self.unit_tokens, self.iterations)

    def boundary(self, previous: Tensor, current: Tensor, layer: int | None = None) -> Tensor:
        tau = self.tau
        if isinstance(tau, tuple):  # on the queries' device once, not copied there at every token
            if self._tau_tensor is None or self._tau_tensor.device != current.device:
                self._tau_tensor = torch.tensor(tau, device=current.device)
            tau = self._tau_tensor if layer is None else self._tau_tensor[layer : layer + 1]
        return query_similarity(previous, current) < tau
