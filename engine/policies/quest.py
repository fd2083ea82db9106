"""`quest`: Quest's page selection as a baseline for LouisKV in the same harness (engine.policies.unit_retrieval):
the same sinks, buffer and budget, units that are pages of consecutive slots instead of clusters, and a choice after
every token instead of at boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.units import Units, page_units
from kvchat.engine.policies.unit_retrieval import UnitRetrievalPolicy, span_keys


@dataclass(eq=False)
class QuestPages(UnitRetrievalPolicy):
    """`quest` (Quest's baseline, in the same harness): pages of `unit_tokens` consecutive slots summarized by their
    keys' per-dimension minimum and maximum (engine.kv.units.page_units), ranked by the bound no key of the page
    exceeds, chosen again after every token, as Quest does."""

    name = "quest"

    def units(self, cache: KVCache, layers: list[int], start: int, end: int) -> Units:
        return page_units(span_keys(cache, layers, start, end), start, self.unit_tokens)

    def boundary(self, previous: Tensor, current: Tensor, layer: int | None = None) -> Tensor:
        return torch.ones(current.shape[0], dtype=torch.bool, device=current.device)
