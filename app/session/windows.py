"""Sliding-window layers (Gemma 3): which of a round's K/V a chat can still read there, and so what is stored.

A token at position t is in the window of position p iff p - window < t: once a chat has moved on, a round's early
tokens are never read again in those layers, and are stored as zeros (they compress to almost nothing). What a
round was stored with moves as the chat grows, and back on a retraction or a fork; WindowTrim remembers it.

Separate from the session because the rule is needed alike by saving a round (what to zero), by a restore (which
stored segments still hold what the chat's end reads) and by a benchmark that stores a chat as the app does.
"""

from __future__ import annotations

from typing import Iterator

import torch

from kvchat.engine.model.decoder import KVCache
from kvchat.storage.db import SEGMENT_MERGED, RoundRow


def window_live_from(cfg, start: int, end: int, chat_end: int) -> int:
    """The first token of a round [start, end) whose K/V in sliding-window layers a chat ending at `chat_end` can
    still read: a token at position t is in the window of position p iff p - window < t, and no later token comes
    before the chat's end. The round's earlier tokens need not be stored in those layers."""
    if not cfg.sliding_window:
        return start
    return min(end, max(start, chat_end - cfg.sliding_window + 1))


def zero_unread_windows(kv: torch.Tensor, layers: range, cfg, start: int, live_from: int) -> torch.Tensor:
    """Zero (in place) the K/V [len(layers), 2, Hkv, n, D] of tokens before `live_from` in sliding-window layers:
    zeros compress to almost nothing, and the segment keeps its shape (every reader takes it as it is)."""
    windowed = [j for j, layer in enumerate(layers) if cfg.window(layer)]
    if windowed and live_from > start:
        kv[windowed, :, :, : live_from - start] = 0
    return kv


class WindowTrim:
    """One chat's sliding-window bookkeeping: where each stored layer group's live K/V begins, and below which
    position the cache itself may hold zeros (restored from trimmed segments)."""

    def __init__(self, config, trim: bool = True):
        """`config`: the model's (sliding_window, window(layer)); `trim` off: every layer of every token is stored
        (the bench's comparison)."""
        self.config, self.trim = config, trim
        # (round, first layer of the group) -> live_from of what is stored (or on its way to disk) there
        self.stored_live: dict[tuple[int, int], int] = {}
        # Sliding-window K/V of positions below this may be zeros in the cache (restored from trimmed segments):
        # it cannot be stored again as live.
        self.valid_from = 0

    def live_from(self, rounds: list[RoundRow], i: int) -> int:
        """Where round i's stored sliding-window K/V begins (window_live_from at the chat's end; never below
        what the cache itself holds, after a restore from trimmed segments)."""
        row = rounds[i]
        if not self.config.sliding_window or not self.trim:
            return row.token_start
        live = window_live_from(self.config, row.token_start, row.token_end, rounds[-1].token_end)
        return max(live, min(row.token_end, self.valid_from))

    def group_live(self, rounds: list[RoundRow], i: int, layers: range) -> int:
        """live_from for a group holding a sliding-window layer, else the round's start (stored whole)."""
        cfg = self.config
        return self.live_from(rounds, i) if any(cfg.window(layer) for layer in layers) else rounds[i].token_start

    def trimmed(self, cache, rounds: list[RoundRow], i: int, layers: range, live: int | None = None) -> torch.Tensor:
        """Round i's K/V of `layers` from `cache` as stored: zeros before `live_from` in sliding-window layers."""
        row = rounds[i]
        kv = cache.read(layers, row.token_start, row.token_end)
        live = self.group_live(rounds, i, layers) if live is None else live
        return zero_unread_windows(kv, layers, self.config, row.token_start, live)

    def windowed(self, seg: dict) -> bool:
        """Whether a segment holds sliding-window layers (a merged pair: its two layers)."""
        held = (seg["layer_start"], seg["layer_end"] - 1) if seg["kind"] == SEGMENT_MERGED else \
            range(seg["layer_start"], seg["layer_end"])
        return any(self.config.window(j) for j in held)

    def readable(self, seg: dict, end: int) -> bool:
        """Whether a stored K/V segment holds every sliding-window K/V a chat ending at `end` reads."""
        if not self.windowed(seg):
            return True
        return seg["live_from"] <= max(seg["token_start"], end - self.config.sliding_window + 1)

    def restored_from(self, by_round: dict[int, list[dict]]) -> None:
        """A restore loads these segment rows: what is stored is theirs, and the cache holds zeros below the
        highest live_from of a trimmed sliding-window segment."""
        self.stored_live = {(i, seg["layer_start"]): seg["live_from"] for i, segs in by_round.items()
                            for seg in segs}
        self.valid_from = max((seg["live_from"] for segs in by_round.values() for seg in segs
                               if self.windowed(seg) and seg["live_from"] > seg["token_start"]), default=0)

    def forget(self, i: int, groups: tuple[range, ...]) -> None:
        """Round i is gone (retracted): nothing is stored for it any more."""
        for layers in groups:
            self.stored_live.pop((i, layers.start), None)

    def moved(self, rounds: list[RoundRow], groups: tuple[range, ...]) -> Iterator[tuple[int, range]]:
        """The (round, layer group)s whose sliding-window tail the chat's new end has moved past (or, after a
        retraction, back into reach): stored with another live_from than they would be now."""
        cfg = self.config
        for i in range(len(rounds)):
            for layers in groups:
                stored = self.stored_live.get((i, layers.start))
                if stored is not None and any(cfg.window(j) for j in layers) and stored != self.live_from(rounds, i):
                    yield i, layers

    def held(self, rounds: list[RoundRow], i: int, valid_rounds: int, recomputed: set[int]) -> bool:
        """Whether the cache holds every sliding-window K/V that round i's first token reads: recomputed (rounds
        below `valid_rounds`, or in `recomputed`) or loaded from segments stored with it."""
        window = self.config.sliding_window
        if not window:
            return True
        need = rounds[i].token_start - window + 1
        for j in range(i - 1, -1, -1):
            row = rounds[j]
            if row.token_end <= need:
                return True
            if j < valid_rounds or j in recomputed:
                continue
            held = [live for (r, _), live in self.stored_live.items() if r == j]
            if not held or max(held) > max(row.token_start, need):
                return False
        return True

    def gone(self, cache, end: int) -> bool:
        """Whether a chat cut back to `end` would read sliding-window K/V `cache` holds as zeros, or that its
        rings no longer hold."""
        window = self.config.sliding_window
        if not window or not cache.length:
            return False
        if max(0, end - window + 1) < self.valid_from:  # a chat shorter than its window reads from position 0
            return True
        return isinstance(cache, KVCache) and not cache.holds_window(end)  # a tiered cache has no rings
