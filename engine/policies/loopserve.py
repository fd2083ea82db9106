"""LoopServe (../shared/papers/loopserve-sparse-prefill-progressive-decode.txt): the new message's prefill attends
along the vertical and slash lines its sampled rows choose (engine.policies.sparse_prefill), and the reply decodes over
the input slots its own recent tokens choose (with their neighbours: `pool`), chosen again every `interval` tokens
(engine.policies.progressive_decode).

`loopserve+round` composes it with Round Attention: the round policy decides which rounds a message's upper
layers see, LoopServe which of their tokens the reply reads (and the prefill of layers that see every slot is
sparse); its watershed layer is handed in as Round Attention's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.progressive_decode import ProgressiveDecode
from kvchat.engine.policies.round_attention import RoundAttention
from kvchat.engine.policies.sparse_prefill import SparsePrefill
from kvchat.errors import KvchatError

# Each chosen slot's mass is the largest within 3 slots of it (engine.policies.progressive_decode); 1 is the paper's
# choice.
POOL = 7


@dataclass(eq=False)  # identity equality and hashing, as before policies were dataclasses
class LoopServe(KVPolicy):
    name = "loopserve"

    alpha: float = 0.955
    budget: int = 1024
    interval: int = 16
    warmup: int = 16
    # 0: every message's prefill is sparse (what quality runs measure); the engine's own default
    # (engine.policies.sparse_prefill.DEFAULT_MIN_KEYS) is where sparse starts to be faster.
    min_keys: int = 0
    sparse: bool = True
    progressive: bool = True
    pool: int = POOL  # 1: the paper's top-B of single slots
    # the latest message's sparse prefill (its stats) and progressive decode: state, not parameters
    sparse_prefill: SparsePrefill | None = field(default=None, init=False, repr=False)
    last_decode: ProgressiveDecode | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise KvchatError(f"alpha is the attention mass the prefill's lines keep, in (0, 1], not {self.alpha}")
        if self.budget < 1 or self.interval < 1 or self.warmup < 1 or self.pool < 1:
            raise KvchatError("budget, interval, warmup and pool are counts of tokens, at least 1")

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


@dataclass(eq=False)
class LoopServeRound(LoopServe):
    name = "loopserve+round"

    watershed: int | None = None  # Round Attention's, handed in as there
    k: float = 0.1
    rounds: RoundAttention = field(init=False, repr=False)  # the round choice, built from watershed and k

    def __post_init__(self):
        super().__post_init__()
        self.rounds = RoundAttention(watershed=self.watershed, k=self.k)

    def calibration_needed(self) -> tuple[str, ...]:
        return self.rounds.calibration_needed()

    def check_model(self, model: Transformer) -> None:
        self.rounds.check_model(model)

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        return self.rounds.visible_slots(cache, round_starts, new_tokens, model=model)
