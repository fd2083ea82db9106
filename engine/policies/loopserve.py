"""LoopServe (../shared/papers/loopserve-sparse-prefill-progressive-decode.txt): the new message's prefill attends
along the vertical and slash lines its sampled rows choose (engine.sparse_prefill), and the reply decodes over the
input slots its own recent tokens choose (with their neighbours: `pool`), chosen again every `interval` tokens
(engine.progressive_decode).

`loopserve+round` composes it with Round Attention: the round policy decides which rounds a message's upper
layers see, LoopServe which of their tokens the reply reads (and the prefill of layers that see every slot is
sparse)."""

from __future__ import annotations

from typing import Callable

from kvchat.engine.model.decoder import Attend, KVCache, Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.round_attention import RoundAttention
from kvchat.engine.policies.progressive_decode import ProgressiveDecode
from kvchat.engine.policies.sparse_prefill import SparsePrefill
from kvchat.errors import KvchatError


# Each chosen slot's mass is the largest within 3 slots of it (engine.progressive_decode); 1 is the paper's choice.
POOL = 7


class LoopServe(KVPolicy):
    name = "loopserve"

    def __init__(self, alpha: float = 0.955, budget: int = 1024, interval: int = 16, warmup: int = 16,
                 min_keys: int = 0, sparse: bool = True, progressive: bool = True, pool: int = POOL):
        if not 0 < alpha <= 1:
            raise KvchatError(f"alpha is the attention mass the prefill's lines keep, in (0, 1], not {alpha}")
        if budget < 1 or interval < 1 or warmup < 1 or pool < 1:
            raise KvchatError("budget, interval, warmup and pool are counts of tokens, at least 1")
        self.alpha, self.budget, self.interval, self.warmup = alpha, budget, interval, warmup
        self.pool = pool  # 1: the paper's top-B of single slots
        # min_keys 0: every message's prefill is sparse (what quality runs measure); the engine's own default
        # (engine.sparse_prefill.DEFAULT_MIN_KEYS) is where sparse starts to be faster.
        self.min_keys, self.sparse, self.progressive = min_keys, sparse, progressive
        self.sparse_prefill: SparsePrefill | None = None  # the latest message's (its stats)
        self.last_decode: ProgressiveDecode | None = None

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return None

    def prepare(self, model: Transformer, cache: KVCache, round_starts: list[int],
                history: list[int]) -> Callable[[], None] | None:
        if not self.sparse:
            return None
        before = model.sparse_prefill
        self.sparse_prefill = model.sparse_prefill = SparsePrefill(self.alpha, min_keys=self.min_keys)

        def undo() -> None:
            model.sparse_prefill = before

        return undo

    def decode_step(self, model: Transformer, cache: KVCache, prompt_start: int, attend: Attend,
                    capacity: int, cuda_graph: bool | None):
        if not self.progressive:
            return None
        self.last_decode = ProgressiveDecode(model, cache, prompt_start, capacity, self.budget, self.interval,
                                             self.warmup, attend, cuda_graph, self.pool)
        return self.last_decode


class LoopServeRound(LoopServe):
    name = "loopserve+round"

    def __init__(self, watershed: int | None = None, k: float = 0.1, alpha: float = 0.955, budget: int = 1024,
                 interval: int = 16, warmup: int = 16, min_keys: int = 0, sparse: bool = True,
                 progressive: bool = True, pool: int = POOL):
        super().__init__(alpha, budget, interval, warmup, min_keys, sparse, progressive, pool)
        self.rounds = RoundAttention(watershed=watershed, k=k)

    @classmethod
    def create(cls, engine=None, progress=None, **options) -> "LoopServeRound":
        policy = cls.construct(**options)
        policy.rounds = RoundAttention.create(engine, progress, watershed=policy.rounds.watershed,
                                              k=policy.rounds.k)
        return policy

    @property
    def watershed(self) -> int | None:
        return self.rounds.watershed

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return self.rounds.visible_slots(cache, round_starts, new_tokens, model=model)
