"""KV policies decide which cached tokens a new message's tokens attend to (kvpress-style: one policy per file,
one abstract method, a table of all of them in engine.policies)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

from kvchat.engine.model import KVCache


class KVPolicy(ABC):
    name: str = ""

    @abstractmethod
    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int]) -> Tensor | None:
        """Cache slots the next round's tokens may attend to, or None for all of them.

        `round_starts` holds the first slot of every round in the cache (the rounds end where the next begins and
        the last ends at cache.length)."""
