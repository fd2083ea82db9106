"""A message's prefill that reads units too (`--option prefill=units` of louiskv and quest; issue 44's lazy resume):
in each global layer the new message's tokens attend to the chat's first slots, the slots of the units that the
message's last token scores best there, the input's last slots before the message (the buffer), and the message
itself, causally — not to the whole chat. The choice is the one the reply's first step makes (the same queries, the
same units, the same budget per KV head), made layer by layer inside the prefill, since a layer's queries exist only
once the layers below it have run.

Why: a lazily reopened chat then needs on the device, before its first token, only its sinks, its buffer, the units'
summaries and the rows of the units chosen — not the whole chat's K/V — and the choice tells, layer by layer, which
rows to fetch. `reads` keeps, per global layer, the chat's slots each KV head read (what a fetch must bring).

What it costs: the message's K/V, and so the reply, are computed over part of the chat rather than all of it
(docs/benchmarks.md, "LouisKV: the message reading units too" measures it). A chat that stores such a round must
compute it again over the full cache before the store can call it exact (issue 44: the store is never lossy).

Shapes: T new tokens, H / Hkv query / KV heads, D head size, C cache slots, n slots read per KV head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.units import joined, slots_of_best_units, unit_scores
from kvchat.engine.model.attention import BottomRightCausal, bottom_right_causal_attention

if TYPE_CHECKING:
    from kvchat.engine.policies.unit_retrieval import UnitRetrievalPolicy


class LazyChat(Protocol):
    """A chat whose K/V are not all in the cache yet (a lazy resume): whoever restored it brings rows in on demand
    (the sinks and the buffer too, as rows the message reads); each round's stored units are in `KVCache.units`."""

    def ensure(self, layer: int, slots: Tensor) -> None:
        """Make the cache hold global `layer`'s K/V of `slots` ([Hkv, n]: each KV head's own; a row already held is
        not brought again)."""

    def ensure_span(self, start: int, end: int) -> None:
        """Make the cache hold every layer's K/V of slots [start, end) (a round whose units must be made from its
        keys)."""

    def verify(self) -> None:
        """Check every row brought in so far against what was stored (raising where one is not): called once the
        message's last layer has its rows, before its first token is sampled."""

    def complete(self) -> None:
        """Bring in everything not held yet: after the message's first token, so that its reply runs on the chat's
        whole K/V."""


class UnitsPrefill:
    """The prefill attention of one message (slots [message_start, end)) under a unit-retrieval policy; installed as
    the model's prefill override (Transformer.sparse_prefill) for that message only."""

    def __init__(self, policy: UnitRetrievalPolicy, cache: KVCache, layers: list[int], message_start: int,
                 end: int, lazy: LazyChat | None = None):
        self.policy, self.cache, self.layers, self.lazy = policy, cache, layers, lazy
        self.message_start, self.end = message_start, end
        # the retrievable region: the policy's (sinks to the buffer, cut at round starts), never into the message,
        # whose tokens are not all in the cache yet when its first layers run
        self.spans = policy.spans(end, until=message_start)
        self.region_end = policy.region(end, until=message_start)[1]
        self.n_sinks = min(policy.sinks, message_start)
        self.reads: dict[int, Tensor] = {}  # global layer -> [Hkv, n] the chat's slots its message read
        self._units: tuple[Tensor, Tensor, Tensor] | None = None
        if lazy is not None and self.everything_read:  # the message reads the whole chat: all of it brought in
            lazy.ensure_span(0, message_start)

    def release(self) -> None:
        """Let go of the chat (its cache, a lazy resume's reader, the units) once the message is answered: the
        policy keeps this object until its next message, by when a bench or an app may have opened the chat again
        into a new cache, and the old one must not stay on the device beside it (a 32k cache is 4.3 GB at the 8B
        shape; the lazy resume's peak of 19.1 GiB against kv-split's 10.4 came from another holder: a reference
        cycle through the session, app/session/lazy.StoredRows.complete)."""
        self.cache = self.lazy = self._units = None

    @property
    def everything_read(self) -> bool:
        """Whether the region is no larger than the budget: the message then reads the whole chat (dense)."""
        return sum(b - a for a, b in self.spans) <= self.policy.tokens

    def applies(self, n_new: int, n_keys: int) -> bool:
        return n_new >= 1 and not self.everything_read

    def units(self) -> tuple[Tensor, Tensor, Tensor]:
        """(summaries, members, slots) of the region, every global layer's: made at the first global layer, when
        the closed rounds' keys of every layer are in the cache already (a round's units are its stored ones)."""
        if self._units is None:
            if self.lazy is not None:  # a round without stored units is clustered from its keys: brought in first
                for need in {self.policy.keys_for_units(self.cache, a, b) for a, b in self.spans} - {None}:
                    self.lazy.ensure_span(*need)
            self._units = joined([self.policy.units(self.cache, self.layers, a, b) for a, b in self.spans])
        return self._units

    def attend(self, q: Tensor, kv: Tensor, start: int, scale: float, layer: int) -> Tensor | None:
        """Queries q [T, H, D] of tokens in slots [start, start + T) of global `layer`, whose cache kv [2, Hkv, C, D]
        holds their K/V already -> attention output [T, H * D]; None (dense) outside this message."""
        n_new, n_heads, head_dim = q.shape
        if not (self.message_start <= start and start + n_new <= self.end) or layer not in self.layers:
            return None
        g = self.layers.index(layer)
        summary, member, slots = self.units()
        window = q[-min(self.policy.window, n_new):]  # the chunk's last rows: each head's rows side by side
        rows = window.permute(1, 0, 2).reshape(1, n_heads * window.shape[0], head_dim)
        scores = unit_scores(rows, summary[g : g + 1], scale)  # [1, Hkv, U]
        # A lazy resume fetches whole units (a unit's rows are stored together), so its message chooses whole units:
        # pooled, a slot would come with neighbours of other units, each fetched whole (4x the frames at 32k on the
        # 8B shape, 2026-11-28). Only the first token is answered from this choice: the message is computed again
        # over the whole chat after it (UnitRetrievalPolicy.finish_lazy_resume).
        pool = 1 if self.lazy is not None else self.policy.pool
        best = slots_of_best_units(scores, member[g : g + 1], slots, self.policy.tokens, pool)[0]
        n_kv, device = kv.shape[1], kv.device
        sinks = torch.arange(self.n_sinks, device=device).expand(n_kv, -1)
        tail = torch.arange(self.region_end, start, device=device).expand(n_kv, -1)  # the buffer, earlier chunks
        chat = torch.cat([sinks, best.long().to(device), tail], 1)  # [Hkv, n]
        self.reads[layer] = chat[:, : chat.shape[1] - (start - self.message_start)]
        if self.lazy is not None:  # the rows this layer reads that a lazy resume has not brought in yet
            self.lazy.ensure(layer, self.reads[layer])
            if layer == self.layers[-1] and start + n_new == self.end:  # the message's last rows: all checked
                self.lazy.verify()
        index = torch.cat([chat, torch.arange(start, start + n_new, device=device).expand(n_kv, -1)], 1)
        gather = index[:, :, None].expand(-1, -1, head_dim)
        keys, values = kv[0].gather(1, gather), kv[1].gather(1, gather)  # [Hkv, S, D]
        out = bottom_right_causal_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                            BottomRightCausal(n_new, index.shape[1]), scale=scale,
                                            enable_gqa=n_heads != n_kv)  # [1, H, T, D]
        return out[0].transpose(0, 1).reshape(n_new, n_heads * head_dim)
