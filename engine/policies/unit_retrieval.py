"""Retrieval of input units at decode time (the base of engine.policies.louiskv and .quest): the reply reads, in
each global layer, the chat's first slots (`sinks`), the input's last slots (`buffer`: the new message and what
came just before it), every token of the reply so far, and the `tokens` slots of the best-scoring units of the rest
— chosen again whenever the policy's `boundary` says the query has changed direction.

The retrievable region is [sinks, first - buffer) of the input, cut at the chat's round starts, so no unit spans two
rounds: a round's units are computed once (engine.kv.units) and reused by every later message (LouisKV: nothing is
clustered again). Sliding-window layers (Gemma 3) keep their window, outside the budget.

Decisions (LouisKV's open points, ../shared/papers/louiskv-design-notes.md), made here once and measured in
docs/benchmarks.md, "LouisKV":
* The new message's prefill reads the whole chat (the full cache's), as XKV's does; units are read only by the
  reply. With `prefill="units"` it reads units too, chosen layer by layer by its last token's queries
  (engine.policies.units_prefill): what a lazy resume needs, measured in docs/benchmarks.md.
* The first retrieval happens right after the prefill, with the last input token's queries (kept by the prefill:
  engine.model.decoder.QueryTap; else run again, its K/V rewritten as they were:
  engine.policies.budgets.window_queries); later ones after a decoded token whose queries trigger it, and
  serve the tokens after it (temporal locality: the next query is unknown when the slots are chosen); with
  `instep=1`, each layer's choice is made in the step with its token's own query and serves that token too.
* Sinks and the buffer are always read and do not count against `tokens`; a region no larger than `tokens` is read
  whole (the engine's own step: the full cache's tokens exactly).
* One choice per KV head (the softmax over units averaged over the heads sharing it), `tokens` slots per KV head.

The decode step is engine.policies.slot_lists' (per-layer, per-KV-head slot lists over the full cache); a choice
rewrites the lists between steps. On a CUDA graph the trigger runs inside the step and a choice is a second graph,
replayed before the next token when the trigger fired (UnitRetrievalDecode): no host round trip beyond the one the
decode loop makes for each token anyway.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.units import TOKENS_PER_CLUSTER, Units, joined, slots_of_best_units, unit_scores
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.cuda_graph import Replay
from kvchat.engine.model.decoder import QueryTap, Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.budgets import prefill_queries
from kvchat.engine.policies.slot_lists import SlotListDecode
from kvchat.engine.policies.units_prefill import LazyChat, UnitsPrefill
from kvchat.errors import KvchatError


@dataclass(eq=False)
class UnitRetrievalPolicy(KVPolicy):
    """Units of the input retrieved by the reply's queries (see the module docstring); subclasses make the units of
    a span (`units`) and say when a layer chooses again (`boundary`)."""

    tokens: int = 1024  # input slots of retrieved units each global layer and KV head reads (the budget)
    sinks: int = 4  # the chat's first slots, always read
    buffer: int = 256  # the input's last slots, always read
    unit_tokens: int = TOKENS_PER_CLUSTER  # slots per unit (a cluster's mean size; a page's size)
    # Beyond the papers: a slot ranked by the best unit within pool // 2 slots of it (odd; 1: its own unit alone), so
    # a chosen slot's neighbours come with it, as LoopServe pools (engine.policies.progressive_decode)
    pool: int = 1
    # Beyond the papers: the first choice (after the prefill) scores the units with the queries of the input's last
    # `window` tokens (each row's softmax over the units, averaged with the group's query heads), as XKV's window
    # scores slots; later choices, at boundaries, with the token that triggered them. 1: the last token alone (the
    # default: 8 and 32 lost 2 and 5 answers of 91 on the development chats, docs/benchmarks.md "LouisKV").
    window: int = 1
    # What the new message's prefill reads: "full", the whole chat (the reply alone reads units); "units", in each
    # global layer the sinks, the buffer and the best units of its last token's queries (engine.policies.
    # units_prefill: what a lazily reopened chat must have on the device before its first token; issue 44)
    prefill: str = "full"
    # Which query a choice uses: 0, the query of the token whose trigger fired, for the tokens after it (temporal
    # locality: the choice runs between steps); 1, each token's own (each global layer checks its trigger as its
    # query is formed and, where it fires, chooses before its own attention reads, as Quest chooses). With 1 every
    # global layer scores and ranks its units at every token, in the step (its CUDA graph too), and keeps its old
    # lists where the trigger did not fire. On the embedded model's development chats at 1,024 slots (20, compare
    # mode): Quest's pages 147 -> 165 answers of the full cache's 166; louiskv's clusters 147 -> 150
    # (docs/benchmarks.md, "LouisKV: the query a choice is made with").
    instep: int = 0
    # for the benchmarks and tests: choices made and tokens decoded under this policy so far (state, not parameters)
    selections: int = field(default=0, init=False, repr=False)
    decoded: int = field(default=0, init=False, repr=False)
    # the latest reply's boundaries: per decoded token, [G] bool, which global layers' trigger fired at it
    reply_cuts: list[Tensor] = field(default_factory=list, init=False, repr=False)
    _round_starts: list[int] = field(default_factory=list, init=False, repr=False)
    _window_tokens: list[int] = field(default_factory=list, init=False, repr=False)
    # the latest message's prefill over units (prefill="units"), what it read: UnitsPrefill.reads
    last_prefill: UnitsPrefill | None = field(default=None, init=False, repr=False)
    # A lazily resumed chat (engine.policies.units_prefill.LazyChat), set by whoever restored it for its next
    # message: that message reads units (whatever `prefill` says), brought in as each layer chooses them; after its
    # first token the rest of the chat is brought in and the message computed again over all of it, so its reply
    # and the K/V stored are a fully restored chat's. Cleared once used.
    lazy: LazyChat | None = field(default=None, init=False, repr=False)
    _message: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if self.tokens < 1 or self.sinks < 0 or self.buffer < 1 or self.unit_tokens < 1 or self.pool % 2 == 0:
            raise KvchatError(f"the {self.name} KV policy reads tokens >= 1 retrieved slots beside sinks >= 0 and a "
                              f"buffer >= 1 of the latest ones, in units of unit_tokens >= 1, pooled over an odd pool")
        if self.prefill not in ("full", "units"):
            raise KvchatError(f"the {self.name} KV policy's prefill reads the whole chat (full) or units (units), not "
                              f"{self.prefill!r}")
        if self.instep not in (0, 1):
            raise KvchatError(f"the {self.name} KV policy's instep is 0 (a choice serves the tokens after the one "
                              f"that fired it) or 1 (the token itself), not {self.instep}")
        if not 1 <= self.window <= self.buffer:
            raise KvchatError(f"the {self.name} KV policy's window is 1 to buffer ({self.buffer}) tokens, not "
                              f"{self.window}")

    @abstractmethod
    def units(self, cache: KVCache, layers: list[int], start: int, end: int) -> Units:
        """The units of slots [start, end) of `layers` (a span within one round)."""

    @abstractmethod
    def boundary(self, previous: Tensor, current: Tensor, layer: int | None = None) -> Tensor:
        """Which global layers choose again after a token: queries [G, H, D] of the token before and of this one ->
        [G] bool; with `layer`, the rows [1, H, D] are global layer `layer`'s alone."""

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        self._round_starts = [*round_starts, cache.length]  # the new message starts where the chat ends
        self._window_tokens = list(new_tokens[-self.window:])
        self.reply_cuts = []
        if model is not None:  # the prefill keeps its last tokens' queries, which choose first
            model.query_tap = QueryTap(self.window)
        self.last_prefill = None
        self._message = list(new_tokens)
        if (self.prefill == "units" or self.lazy is not None) and model is not None:
            # the message reads units as well, layer by layer (and, lazily resumed, brings them in)
            layers = [i for i, layer in enumerate(model.layers) if not layer.window]
            self.last_prefill = UnitsPrefill(self, cache, layers, cache.length, cache.length + len(new_tokens),
                                             self.lazy)
            model.sparse_prefill = self.last_prefill
        return None  # the message reads the whole chat (or, above, units of it); the reply reads units of it

    def prepare(self, model: Transformer, cache: KVCache, round_starts: list[int],
                history: list[int]):
        if self.prefill != "units" and self.lazy is None:
            return None
        before = model.sparse_prefill  # visible_slots puts the message's UnitsPrefill there: taken off after it

        def undo() -> None:
            model.sparse_prefill = before
            if self.last_prefill is not None:  # its reads stay (for stats and tests), not the chat's cache
                self.last_prefill.release()

        return undo

    def region(self, first: int, until: int | None = None) -> tuple[int, int]:
        """The retrievable slots [lo, hi) of an input of `first` slots: after the sinks, before the buffer (and
        before `until`, where given: a message's prefill retrieves only from before the message)."""
        lo = min(self.sinks, first)
        hi = max(first - self.buffer, lo)
        return lo, hi if until is None else max(min(hi, until), lo)

    def spans(self, first: int, until: int | None = None) -> list[tuple[int, int]]:
        """The retrievable region of an input of `first` slots, cut at round starts: [(start, end)]."""
        lo, hi = self.region(first, until)
        cuts = sorted({lo, hi, *(s for s in self._round_starts if lo < s < hi)})
        return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def always_read(self, first: int, device: torch.device) -> Tensor:
        """The sinks and the buffer of an input of `first` slots: [n] long."""
        lo = min(self.sinks, first)
        return torch.cat([torch.arange(lo, device=device), torch.arange(max(first - self.buffer, lo), first,
                                                                          device=device)])

    def keys_for_units(self, cache: KVCache, start: int, end: int) -> tuple[int, int] | None:
        """The slots whose keys the units of [start, end) are made from, or None where they are at hand without
        keys (a lazy resume brings those slots in first). Quest's pages are made from keys every time."""
        return start, end

    def decode_step(self, model: Transformer, cache: KVCache, prompt_start: int, attend: Attend, capacity: int,
                    cuda_graph: bool | None):
        if attend is not None or cache.slot_positions is not None:
            raise KvchatError(f"the {self.name} KV policy runs on the full cache of a chat, not a restricted view")
        if self.lazy is not None:
            self.finish_lazy_resume(model, cache, prompt_start)
        spans = self.spans(cache.length)
        if sum(b - a for a, b in spans) <= self.tokens or not self._window_tokens:
            return None  # every input slot is read anyway: the engine's own step, the full cache's tokens exactly
        return UnitRetrievalDecode(model, cache, prompt_start, capacity, self, spans, cuda_graph)

    @torch.inference_mode()
    def finish_lazy_resume(self, model: Transformer, cache: KVCache, prompt_start: int) -> None:
        """After a lazily resumed chat's first token: the rest of its K/V brought in, and the message's computed
        again over all of it (its first pass read units), with its queries kept for the reply's first choice, as
        a fully restored chat's message would have left them. The decode step does it; whoever ran a reply that
        ended at its first token (no step was made) does it after."""
        lazy, self.lazy = self.lazy, None
        end = cache.length
        before, model.sparse_prefill, model.query_tap = model.sparse_prefill, None, None
        try:
            lazy.complete()  # (a restore, which may recompute rounds and leave the length at the chat's end)
            cache.truncate(prompt_start)
            model.query_tap = QueryTap(self.window)
            model(torch.tensor(self._message), cache)
        finally:
            model.sparse_prefill = before
        if cache.length != end:
            raise KvchatError(f"the message was computed again to slot {cache.length}, not {end}")


def span_keys(cache: KVCache, layers: list[int], start: int, end: int) -> Tensor:
    """K of slots [start, end) of `layers`: [G, Hkv, end - start, D] (a copy)."""
    return torch.stack([cache.layer(layer)[0, :, start:end] for layer in layers])


class UnitRetrievalDecode(SlotListDecode):
    """The reply's step: each global layer's lists hold the sinks, the buffer and its retrieved units' slots (then
    the reply, as every slot list does), chosen after the prefill and again at each boundary.

    The trigger runs inside the step (in its CUDA graph): each token's r per global layer against the token before,
    the layers it flags ([G] bool) copied to the host without waiting. The choice they call for is made before the
    next token's step, when the host has already waited for this one (the decode loop reads each token): on a
    CUDA graph, one more replay that chooses for every global layer and keeps the unflagged layers' lists as they
    were (fixed shapes, no host round trip; ~1.5 ms of launches when chosen eagerly on the 8B shape at 32k, of a
    ~3.4 ms step: docs/benchmarks.md, "LouisKV"); without one, eagerly for the flagged layers alone. The lists are
    the same either way. With `instep`, the step itself chooses, layer by layer, as each query is formed
    (`choose_now`); no choice is left for between steps."""

    def __init__(self, model: Transformer, cache: KVCache, prompt_start: int, capacity: int,
                 policy: UnitRetrievalPolicy, spans: list[tuple[int, int]], capture: bool | None):
        cfg, device = model.cfg, model.device
        self.policy = policy
        self.layers = [i for i in range(cfg.n_layers) if not model.layers[i].window]
        self.global_index = torch.tensor(self.layers, device=device)
        self._global_of = {layer: g for g, layer in enumerate(self.layers)}  # model layer -> global layer
        # the input's last `window` tokens' queries, which choose first (the last token's are the "previous" of the
        # reply's first token): kept by the message's prefill, or run again over the cache; then each token's,
        # written by its step
        window = policy._window_tokens[-min(policy.window, cache.length):]
        window_queries = prefill_queries(model, cache, self.layers, window)[self.global_index]  # [G, T, H, D]
        first_queries = window_queries[:, -1]
        self.previous = first_queries.clone()
        self.redo = torch.zeros(len(self.layers), dtype=torch.bool, device=device)  # the step's trigger: [G]
        n_reply = capacity - cache.length
        # per reply token, the layers its trigger flagged, on the host (pinned: copied without waiting)
        self.cuts = torch.zeros(n_reply, len(self.layers), dtype=torch.bool,
                                pin_memory=device.type == "cuda")
        self.cuts_copied = torch.cuda.Event() if device.type == "cuda" else None
        # the units and the always-read slots (before the step is captured: an in-step choice reads them)
        units = [policy.units(cache, self.layers, a, b) for a, b in spans]
        self.summary, self.member, self.slots = joined(units)
        always = policy.always_read(cache.length, device).to(torch.int32)
        self.always = always.expand(len(self.layers), cfg.n_kv_heads, -1)
        self.n_sinks = min(policy.sinks, cache.length)  # the always-read slots before the retrievable region
        super().__init__(model, cache, prompt_start, capacity, None, capture)
        self.previous.copy_(first_queries)  # the captured step's warm-up runs wrote theirs
        self.redo.zero_()
        # each KV head's query heads and the window's rows side by side: [G, H * T, D], head-major
        g, t, h, d = window_queries.shape
        self.select(window_queries.permute(0, 2, 1, 3).reshape(g, h * t, d), torch.ones(g, dtype=torch.bool))
        # (in-step choices need no replay of their own: the step makes them)
        self._choice = None if policy.instep else Replay(self._choose_flagged, device, self._replay.graph is not None)

    watches_queries = True

    def query_list(self) -> list:
        return _ChoosingQueries(self, self._global_of) if self.policy.instep else []

    def watch(self, queries: Tensor) -> None:
        if self.policy.instep:  # each layer checked its trigger, and chose, as its query was formed
            return
        current = queries[self.global_index]  # [G, H, D]
        self.redo.copy_(self.policy.boundary(self.previous, current))
        self.previous.copy_(current)

    def choose_now(self, g: int, q: Tensor) -> None:
        """In-step (`instep`): global layer g's query q [H, D] was just formed; where its trigger fires, g's lists
        are chosen with it before its attention reads them."""
        fired = self.policy.boundary(self.previous[g : g + 1], q[None], g)  # [1] bool, on the device
        self.redo[g : g + 1].copy_(fired)
        self.previous[g].copy_(q)
        # chosen whether it fired or not, and kept where it did: no host round trip inside the step
        lists = self.lists(q[None], self.summary[g : g + 1], self.member[g : g + 1], self.always[g : g + 1])[0]
        n, layer = lists.shape[1], self.layers[g]
        self.chosen[layer, :, :n] = torch.where(fired, lists, self.chosen[layer, :, :n])

    def lists(self, q: Tensor, summary: Tensor, member: Tensor, always: Tensor) -> Tensor:
        """The input slots [G', Hkv, n] the queries q [G', H, D] read: the sinks and the buffer, and their best
        units' slots, ascending."""
        scores = unit_scores(q, summary, self.model.cfg.softmax_scale)
        best = slots_of_best_units(scores, member, self.slots, self.policy.tokens, self.policy.pool)
        sinks = self.n_sinks  # ascending already: the sinks, the retrievable region's slots, the buffer
        return torch.cat([always[:, :, :sinks], best, always[:, :, sinks:]], 2)

    @torch.inference_mode()
    def select(self, q: Tensor, layers: Tensor) -> None:
        """Write the lists of the global layers flagged in `layers` [G] bool (on the host) from queries q [G, H, D]:
        only those layers are scored and ranked (a boundary is usually a few layers': the rest keep their lists)."""
        flagged = layers.nonzero().flatten()
        if len(flagged) < len(layers):
            at = flagged.to(q.device)
            q, summary, member, always = q[at], self.summary[at], self.member[at], self.always[at]
        else:
            summary, member, always = self.summary, self.member, self.always
        lists = self.lists(q, summary, member, always)
        self.write_group(self.global_index[flagged.to(self.global_index.device)], lists)
        self.policy.selections += 1

    @torch.inference_mode()
    def _choose_flagged(self) -> None:
        """The choice the last step's trigger called for, as one fixed-shape pass (what the choice replay captures):
        every global layer's lists from the last token's queries, the unflagged layers' kept as they were."""
        lists = self.lists(self.previous, self.summary, self.member, self.always)
        n = lists.shape[2]
        old = self.chosen[self.global_index, :, :n]
        self.chosen[self.global_index, :, :n] = torch.where(self.redo[:, None, None], lists, old)

    def before_token(self) -> None:
        if self.n_out == 0:
            return
        if self.cuts_copied is not None:
            self.cuts_copied.synchronize()  # done already where the decode loop read the last token
        flagged = self.cuts[self.n_out - 1]
        if not bool(flagged.any()):
            return
        if self.policy.instep:  # chosen in the step already
            self.policy.selections += 1
            return
        if self._choice.graph is not None:
            self._choice()
            self.policy.selections += 1
        else:
            self.select(self.previous, flagged)

    def after_token(self) -> None:
        row = self.cuts[self.n_out - 1]
        row.copy_(self.redo, non_blocking=True)
        if self.cuts_copied is not None:
            self.cuts_copied.record()
        self.policy.decoded += 1
        self.policy.reply_cuts.append(row)


class _ChoosingQueries(list):
    """The step's query list under `instep`: each global layer's query, as its layer appends it, goes to the
    decode's choice first (UnitRetrievalDecode.choose_now), so the layer reads lists chosen with its own query."""

    def __init__(self, decode: UnitRetrievalDecode, global_of: dict[int, int]):
        super().__init__()
        self.decode, self.global_of = decode, global_of

    def append(self, q: Tensor) -> None:
        g = self.global_of.get(len(self))
        if g is not None:
            self.decode.choose_now(g, q.reshape(q.shape[-2], q.shape[-1]))
        super().append(q)
