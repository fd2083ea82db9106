"""The full KV cache: the policy every other is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.policies.base import KVPolicy


@dataclass(eq=False)
class FullKV(KVPolicy):
    """The whole KV cache: every earlier round at every layer (the reference every other policy is scored against)."""

    name = "full"

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return None
