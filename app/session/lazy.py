"""A lazy resume (LouisKV, issue 44): a reopened louiskv chat answers its next message before its K/V is in.

Opening reads the rounds' stored units (centroids and members, app/session/units.py) and nothing of the K/V: the
cache is as long as the chat and empty. The message's prefill reads units (engine.policies.units_prefill): each
global layer chooses from its queries, and `StoredRows.ensure` brings in, from the store, the rounds holding the
rows it chose (the sinks and the buffer are rows it reads too). After the first token, `complete` reads the rounds
not brought in yet (or, where one cannot be read, runs the session's whole restore into the same cache, which
recomputes it), and the engine computes the message again over all of it: the reply and every K/V stored are those
of a fully restored chat.

What this does not do yet: read less than a round. The store keeps a round's K/V as one compressed segment per
group of layers, so a round is brought in whole for any row of it; on a long chat the first choice alone touches
42–96% of the rounds (docs/benchmarks.md, "What a lazy resume would have to read"). A layout in units' order is the
step that makes the first token cheap; this is the path it plugs into.

Only chats whose every round has its units stored and its K/V in plain segments (no merged pairs), on a cache
without sliding-window rings, are opened lazily; any other is restored whole, said in the restore's notes. A round
that cannot be read when it is asked for stops the lazy answer (`LazyResumeFailed`, before any token is out): the
session restores the chat whole and answers again.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from kvchat.app.session.units import READ_THREADS
from kvchat.errors import KvchatError
from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store
from kvchat.storage.segments import read_segment


class LazyResumeFailed(KvchatError):
    """A round a lazily resumed chat's message needed could not be read: restore the chat whole and answer again."""


def lazily_loadable(segments: list[dict], rounds: list[RoundRow], n_layers: int) -> str | None:
    """None where every round can be brought in alone (its K/V in plain segments covering every layer, its span as
    stored), given the chat's segment rows; else why not, for the restore's notes."""
    by_round: dict[int, list[dict]] = {}
    for seg in segments:
        if seg["kind"] in (SEGMENT_KV, SEGMENT_MERGED):  # (key bounds, units: indexes of the K/V, not K/V)
            by_round.setdefault(seg["round_idx"], []).append(seg)
    for row in rounds:
        segs = by_round.get(row.idx, [])
        if not segs or any(s["kind"] != SEGMENT_KV for s in segs):
            return f"round {row.idx} is not stored as plain K/V segments"
        if not _tiles(segs, n_layers):
            return f"round {row.idx} does not hold every layer"
        if any((s["token_start"], s["token_end"]) != (row.token_start, row.token_end) for s in segs):
            return f"round {row.idx}'s segments hold other tokens"
    return None


def _tiles(segs: list[dict], n_layers: int) -> bool:
    """Whether the segments' layer ranges tile [0, n_layers) end to end."""
    at = 0
    for a, b in sorted((s["layer_start"], s["layer_end"]) for s in segs):
        if a != at:
            return False
        at = b
    return at == n_layers


class StoredRows:
    """engine.policies.units_prefill.LazyChat over a chat's store: a round is brought in whole (every layer) the
    first time any row of it is asked for; `complete` brings in the rest, or runs `restore_whole` (the session's
    whole restore into the same cache) where a round cannot be read."""

    def __init__(self, store: Store, segments: list[dict], fingerprint: str, rounds: list[RoundRow], cache, stats,
                 restore_whole: Callable[[], None]):
        """`segments`: the chat's segment rows; `stats`: the session's RestoreStats of this open, which the
        completion fills in."""
        self.store, self.fingerprint, self.cache, self.stats = store, fingerprint, cache, stats
        self.rounds = rounds
        self.starts = [r.token_start for r in rounds]
        self.segments: dict[int, list[dict]] = {}
        for seg in segments:
            if seg["kind"] == SEGMENT_KV:
                self.segments.setdefault(seg["round_idx"], []).append(seg)
        self._complete = restore_whole
        # the chat's K/V on disk: what a whole restore reads (the share read before the first token is the figure)
        self.chat_bytes = sum(seg["byte_size"] for segs in self.segments.values() for seg in segs)
        self.loaded: set[int] = set()
        self.bytes_read = 0  # compressed bytes read from the store, one round at a time
        self.read_s = 0.0
        self.completed = False
        self.whole_restore_because: str | None = None  # why the completion became the session's whole restore
        self.complete_s = 0.0
        self.read_before_first_token: set[int] = set()  # the rounds the message's layers brought in
        self.bytes_before_first_token = 0

    def _round_of(self, slot: int) -> int:
        return bisect.bisect_right(self.starts, slot) - 1

    def ensure(self, layer: int, slots: Tensor) -> None:
        if self.completed:
            return
        wanted = {self._round_of(s) for s in slots.flatten().unique().tolist()}
        for i in sorted(wanted - self.loaded):
            self._load(i)

    def ensure_span(self, start: int, end: int) -> None:
        if self.completed:
            return
        first, last = self._round_of(start), self._round_of(end - 1)
        for i in range(first, last + 1):
            if i not in self.loaded:
                self._load(i)

    def complete(self) -> None:
        """The rounds not brought in yet, read on several threads (hashing and zstd release the GIL) and placed in
        order; a round that cannot be read makes it the session's whole restore instead (which recomputes it)."""
        self.completed = True
        self.read_before_first_token, self.bytes_before_first_token = set(self.loaded), self.bytes_read
        rest = [i for i in range(len(self.rounds)) if i not in self.loaded]
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(rest)))) as pool:
                reads = [(i, pool.submit(self._read, i)) for i in rest]
                for i, read in reads:
                    self._place(i, read.result())
        except LazyResumeFailed as exc:
            self.whole_restore_because = str(exc)
            self._complete()
        self.complete_s = time.perf_counter() - t0
        after = (f"the rest read after it ({self.complete_s * 1000:.0f} ms)" if self.whole_restore_because is None
                 else f"then restored whole ({self.whole_restore_because})")
        self.stats.notes.append(f"opened lazily: {self.rounds_before_first_token} of {len(self.rounds)} rounds "
                                f"({self.bytes_before_first_token:,} bytes) read before the first token, {after}")
        if self.whole_restore_because is None:
            self.stats.tokens_loaded = self.rounds[-1].token_end if self.rounds else 0

    @property
    def rounds_before_first_token(self) -> int:
        return len(self.read_before_first_token)

    def _load(self, i: int) -> None:
        t0 = time.perf_counter()
        self._place(i, self._read(i))
        self.read_s += time.perf_counter() - t0
        self.bytes_read += sum(seg["byte_size"] for seg in self.segments.get(i, []))

    def _read(self, i: int) -> list[tuple[range, Tensor]]:
        """Round i's K/V from its segments, verified: [(layers, K/V [layers, 2, Hkv, tokens, D])]."""
        if not 0 <= i < len(self.rounds):
            raise LazyResumeFailed(f"slot outside the chat's rounds (round {i})")
        row = self.rounds[i]
        out = []
        for seg in sorted(self.segments.get(i, []), key=lambda s: s["layer_start"]):
            try:
                _, kv = read_segment(Path(self.store.kv_dir / seg["file"]), fingerprint=self.fingerprint)
            except StorageError as exc:
                raise LazyResumeFailed(f"round {i}: {exc}") from None
            if kv.shape[3] != row.token_end - row.token_start:
                raise LazyResumeFailed(f"round {i}: its segment holds {kv.shape[3]} tokens, not "
                                       f"{row.token_end - row.token_start}")
            out.append((range(seg["layer_start"], seg["layer_end"]), kv))
        return out

    @torch.inference_mode()
    def _place(self, i: int, parts: list[tuple[range, Tensor]]) -> None:
        for layers, kv in parts:
            self.cache.write(layers, self.rounds[i].token_start, kv)
        self.loaded.add(i)
