from __future__ import annotations

from kvchat.engine.model.decoder import Attend, KVCache, Transformer
from kvchat.engine.policies.base import KVPolicy


class FullKV(KVPolicy):
    """The whole KV cache: every earlier round at every layer (the reference every other policy is scored against)."""

    name = "full"

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return None
