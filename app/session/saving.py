"""Saving a chat's rounds: which segments a round's K/V becomes, handed to the background writer.

A round of the full cache is one segment per layer group, its sliding-window layers zeroed where the chat can no
longer read them, the layer pairs it is merged in as merged segments; a tiered chat's round is a lower and an
upper segment and the upper keys' bounds. The same path stores a round as it is answered, stores again what a
restore had to recompute, and re-stores whole chats (store_all, store_merged, store_tiers).

Separate from the session so that everything which stores rounds "as the app does" calls this one object (a
benchmark's stored chats included, with a cache it filled itself), instead of copying the rules.
"""

from __future__ import annotations

import torch

from kvchat.app.session.merges import ChatMerges, pairs_text
from kvchat.app.session.windows import WindowTrim
from kvchat.app.session.writer import KVWriter
from kvchat.engine.kv.cross_layer import LayerPair, merge_pair
from kvchat.errors import KvchatError
from kvchat.storage.db import CACHE_KINDS, SEGMENT_KEY_BOUNDS, SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store


class RoundSaver:
    """Stores one chat's rounds from a cache: every method takes the cache and the chat's rounds as they are now
    (the session replaces both as it goes)."""

    def __init__(self, store: Store, writer: KVWriter, sid: str, config, groups: tuple[range, ...],
                 windows: WindowTrim, split: int | None = None, merges: ChatMerges | None = None):
        """`config`: the model's; `groups`: the layer groups a round is stored as (layout.chat_groups);
        `windows`: the chat's sliding-window bookkeeping; `split`: a tiered chat's first upper layer (rounds are
        stored as tiers), None for the full cache; `merges`: the chat's cross-layer merging, or None."""
        self.store, self.writer, self.sid, self.config = store, writer, sid, config
        self.groups, self.windows, self.split, self.merges = groups, windows, split, merges
        self.round_pairs: dict[int, list[LayerPair]] = {}  # the pairs a round is stored merged in

    def save_round(self, cache, rounds: list[RoundRow], idx: int) -> None:
        """Hand a new round's K/V to the writer: a segment per layer group, or (tiered) a lower and an upper."""
        row = rounds[idx]
        tokens, n_layers = range(row.token_start, row.token_end), self.config.n_layers
        if self.split is None:
            for layers in self.groups:
                self.submit_kv(cache, rounds, idx, layers)
            self.retrim(cache, rounds)
            return
        split = self.split
        cache.close_round()
        lower, upper_layers = range(split), range(split, n_layers)
        self.writer.submit(self.sid, idx, cache.lower.read(lower, row.token_start, row.token_end), lower, tokens)
        upper = cache.round_upper(idx)  # a copy: the cache keeps the exact K/V
        pairs = [p for p in self.pairs_for(idx) if p.low >= split]
        for p in pairs:  # merged pair first, then the upper segment naming it (as submit_kv)
            merged = merge_pair(upper[p.low - split], upper[p.high - split], self.merges.retain)
            self.writer.submit(self.sid, idx, merged, range(p.low, p.high + 1), tokens, kind=SEGMENT_MERGED)
        for p in pairs:
            upper[[p.low - split, p.high - split]] = 0
        self.writer.submit(self.sid, idx, upper, upper_layers, tokens, merged=pairs_text(pairs))
        self.save_bounds(cache, idx, tokens)

    def submit_kv(self, cache, rounds: list[RoundRow], i: int, layers: range) -> None:
        """Store round i's K/V of `layers` (full cache), zeros before `live_from` in its sliding-window layers;
        layers the round is merged in as zeros, each pair with a layer here as a merged segment first (a crash
        between the two leaves the old K/V row, which names no such pair). A pair across two groups is written with
        each (the same bytes name the same file): a group stored again alone (a sliding window's new `live_from`)
        must not leave its pair as it was."""
        row = rounds[i]
        tokens = range(row.token_start, row.token_end)
        windows = self.windows
        live = windows.group_live(rounds, i, layers)
        kv = windows.trimmed(cache, rounds, i, layers, live)
        pairs = [p for p in self.pairs_for(i) if p.low in layers or p.high in layers]
        for p in pairs:
            both = torch.cat([windows.trimmed(cache, rounds, i, range(p.low, p.low + 1)),
                              windows.trimmed(cache, rounds, i, range(p.high, p.high + 1))])
            merged = merge_pair(both[0], both[1], self.merges.retain)
            self.writer.submit(self.sid, i, merged, range(p.low, p.high + 1), tokens, kind=SEGMENT_MERGED,
                               live_from=windows.group_live(rounds, i, range(p.low, p.low + 1)))
            for layer in (p.low, p.high):
                if layer in layers:
                    kv[layer - layers.start] = 0
        self.writer.submit(self.sid, i, kv, layers, tokens, live_from=live, merged=pairs_text(pairs))
        windows.stored_live[(i, layers.start)] = live

    def save_bounds(self, cache, idx: int, tokens: range) -> None:
        """Tiered: round idx's upper keys' bounds, which the next restore reads with the lower layers."""
        bounds = cache.round_bounds(idx)
        if bounds is not None:
            upper = range(self.split, self.config.n_layers)
            self.writer.submit(self.sid, idx, bounds, upper, tokens, kind=SEGMENT_KEY_BOUNDS)

    def save_upper(self, cache, idx: int, upper: torch.Tensor, tokens: range) -> None:
        """Tiered: round idx's upper K/V as one segment (a restore recomputed it by plan and keeps it), and its
        key bounds."""
        self.writer.submit(self.sid, idx, upper, range(self.split, self.config.n_layers), tokens)
        self.save_bounds(cache, idx, tokens)

    def pairs_for(self, i: int) -> list[LayerPair]:
        """The layer pairs round i is stored merged in: those it was first stored with, else the chat's choice now."""
        if self.merges is None:
            return []
        if i not in self.round_pairs:
            # a tiered chat merges within its upper tier: the lower one is read in full at every message
            within = range(self.split if self.split is not None else 0, self.config.n_layers)
            self.round_pairs[i] = self.merges.pairs(within)
        return self.round_pairs[i]

    def retrim(self, cache, rounds: list[RoundRow]) -> None:
        """Store again the rounds whose sliding-window tail the chat's new end has moved past (or, after a
        retraction, back into reach): only the last rounds before the end can change."""
        if not self.config.sliding_window or self.split is not None:
            return
        for i, layers in self.windows.moved(rounds, self.groups):
            self.submit_kv(cache, rounds, i, layers)

    def save_recomputed(self, cache, rounds: list[RoundRow], indices: list[int], only_absent: bool = False) -> None:
        """Store again the K/V of rounds (`indices`) recomputed because they could not be loaded, so the next open
        loads them (tiered: their lower layers; their upper layers are recomputed only if a message picks them,
        and not stored). What the plan recomputes is never stored: recomputing it is faster than loading it here.
        `only_absent`: only the layer groups nothing is stored for."""
        if not indices:
            return
        device_tier = cache if self.split is None else cache.lower
        stored: dict[int, list[dict]] = {}
        if only_absent:
            for seg in self.store.segments(self.sid):
                if seg["kind"] == SEGMENT_KV:
                    stored.setdefault(seg["round_idx"], []).append(seg)
        for i in indices:
            row = rounds[i]
            for layers in self.groups:
                if any(s["layer_start"] < layers.stop and layers.start < s["layer_end"] for s in stored.get(i, [])):
                    continue
                if self.split is None:
                    self.submit_kv(cache, rounds, i, layers)
                    continue
                kv = device_tier.read(layers, row.token_start, row.token_end)
                self.writer.submit(self.sid, i, kv, layers, range(row.token_start, row.token_end))

    def store_all(self, cache, rounds: list[RoundRow]) -> None:
        """Store every round's K/V from `cache` (which holds the whole chat), the way rounds are saved as a chat
        goes on (a chat imported or created as text; the bench's stored chats). Full cache only."""
        if self.split is not None:
            raise KvchatError("store_all stores the full cache's rounds; a tiered chat stores its tiers")
        for i in range(len(rounds)):
            for layers in self.groups:
                self.submit_kv(cache, rounds, i, layers)

    def store_merged(self, cache, rounds: list[RoundRow], tokens: list[int]) -> int:
        """Store every round again merged in the pairs the chat's statistics pick, after a probe at each round's
        end (`tokens`: the chat's); returns how many rounds hold merged pairs. A probe reads in a sliding-window
        layer what its rows' window reaches, which the cache holds only near the chat's end (its rings, the trimmed
        rounds a restore loaded): earlier rounds are probed on a replay of the chat's tokens."""
        with torch.inference_mode():
            self.merges.observe(cache, [(r.token_end, tokens[r.token_start:r.token_end]) for r in rounds],
                                tokens, self.windows.valid_from)
        self.round_pairs.clear()
        self.store_all(cache, rounds)
        return sum(bool(self.pairs_for(i)) for i in range(len(rounds)))

    def store_tiers(self, cache, rounds: list[RoundRow]) -> int:
        """Tiered: store again, as a lower and an upper segment, every round whose K/V came as one segment of all
        layers (a chat saved under the full cache), so the next open reads only the lower layers up front.
        Returns how many rounds were re-stored."""
        split, n_layers, done = self.split, self.config.n_layers, 0
        by_round: dict[int, list[dict]] = {}
        for seg in self.store.segments(self.sid):
            if seg["kind"] in CACHE_KINDS:  # not a round's retrieval units, which stay as they are
                by_round.setdefault(seg["round_idx"], []).append(seg)
        for i, row in enumerate(rounds):
            segs = by_round.get(i, [])
            if not any(s["layer_start"] < split < s["layer_end"] for s in segs):
                continue
            # The restore reads layers above the split in the background: wait for this round's, and its key bounds.
            cache.ensure_upper(i)
            upper = cache.round_upper(i)
            old = [s["file"] for s in segs]
            self.store.drop_segments(self.sid, i)  # a crash from here on costs a recompute, never text
            tokens = range(row.token_start, row.token_end)
            lower = cache.lower.read(range(split), row.token_start, row.token_end)
            self.writer.submit(self.sid, i, lower, range(split), tokens)
            self.writer.submit(self.sid, i, upper, range(split, n_layers), tokens)
            self.save_bounds(cache, i, tokens)
            self.writer.drain()
            self.store.unlink_files(self.store.unreferenced(old))
            done += 1
        return done
