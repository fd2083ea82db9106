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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.units import Units, cluster_units
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
    # Each round's clusters, kept for the later messages of the same chat: (cache, span, a checksum of its keys).
    _clusters: dict = field(default_factory=dict, init=False, repr=False)
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

    def calibration_needed(self) -> tuple[str, ...]:
        return ("tau",) if self.tau is None else ()

    def check_model(self, model) -> None:
        n_global = sum(1 for layer in model.layers if not layer.window)
        if isinstance(self.tau, tuple) and len(self.tau) != n_global:
            raise KvchatError(f"the louiskv policy has {len(self.tau)} thresholds (tau) for a model of {n_global} "
                              f"global layers")

    def units(self, cache: KVCache, layers: list[int], start: int, end: int) -> Units:
        # The first layer's keys' sum tells a span whose K/V changed (a retracted and regenerated round) from the one
        # clustered; every layer's keys are copied out only for a span not clustered yet.
        key = (id(cache), start, end, cache.layer(layers[0])[0, :, start:end].float().sum().item())
        if key not in self._clusters:
            if len(self._clusters) > 4096:  # another chat's, or rounds long gone
                self._clusters.clear()
            self._clusters[key] = cluster_units(span_keys(cache, layers, start, end), start, self.unit_tokens,
                                                self.iterations)
        return self._clusters[key]

    def boundary(self, previous: Tensor, current: Tensor) -> Tensor:
        tau = self.tau
        if isinstance(tau, tuple):  # on the queries' device once, not copied there at every token
            if self._tau_tensor is None or self._tau_tensor.device != current.device:
                self._tau_tensor = torch.tensor(tau, device=current.device)
            tau = self._tau_tensor
        return query_similarity(previous, current) < tau
