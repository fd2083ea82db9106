"""A tiered chat's upper layers (Round Attention): read from disk into host memory in the background after a
restore, from where TieredKV copies a message's chosen rounds to the device.

Separate from the session and the restore because it lives between the two: a restore hands it the upper-layer
segments and starts it once the lower layers are in, and from then on the cache pulls rounds from it (and hurries
it) while the chat goes on, until the chat is restored again or put out of memory.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from kvchat.app.session.layout import hold_span, segment_files, unusable
from kvchat.engine.kv.cross_layer import unmerge_pair
from kvchat.engine.kv.tiered import host_layout
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.segments import tensor_on

log = logging.getLogger("kvchat.session")


class UpperReads:
    """One chat's background read of every round's upper-layer segments (layers [split, n_layers))."""

    def __init__(self, store: Store, engine, sid: str, fingerprint: str, split: int, ignore_merges: bool = False):
        self.store, self.engine, self.sid, self.fingerprint = store, engine, sid, fingerprint
        self.split, self.ignore_merges = split, ignore_merges
        self.fetcher: SegmentPrefetcher | None = None
        self.segments: dict[int, list[dict]] = {}  # each round's upper-layer segment rows

    def reset(self, segments: dict[int, list[dict]]) -> None:
        """A restore begins: these are the rounds' upper segments now; an earlier read stops."""
        self.segments = segments  # emptied if the restore finds the stored spans stale
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None

    def start(self, n_rounds: int) -> None:
        """Read every round's upper-layer segments into host memory in the background, starting now."""
        total = sum(seg["raw_size"] for segs in self.segments.values() for seg in segs)
        groups, sizes = segment_files(self.segments, n_rounds)
        self.fetcher = SegmentPrefetcher(self.store.kv_dir, self.fingerprint, groups, sizes, finish=self._to_host,
                                         window_bytes=total + 1)
        self.fetcher.start()

    def _to_host(self, header, raw) -> torch.Tensor:
        """In a reader thread: one upper segment, token-major in host memory, as TieredKV keeps it."""
        kv = tensor_on(header, raw, "cpu")
        return host_layout(kv, self.engine.model.dtype)

    def _unusable(self, segments: list[dict]) -> str | None:
        return unusable(segments, range(self.split, self.engine.config.n_layers), self.fingerprint,
                        self.ignore_merges)

    def hurry(self, rounds: list[int]) -> None:
        """A message picked these rounds and their upper layers are not in host memory yet: read them now, in
        parallel, ahead of the background read (TieredKV's upper_hint)."""
        usable = [i for i in rounds if self._unusable(self.segments.get(i, [])) is None]
        if self.fetcher is not None and usable:
            self.fetcher.hurry(usable)

    @contextlib.contextmanager
    def answering(self):
        """While the model answers, the background read starts nothing new: its threads would take the cores and
        the GIL from the decode loop. Rounds a message picks are still read at once (hurry)."""
        fetcher = self.fetcher
        if fetcher is not None:
            fetcher.pause()
        try:
            yield
        finally:
            if fetcher is not None:
                fetcher.resume()

    def wait(self) -> None:
        """Until the background read of every round's upper layers is done."""
        if self.fetcher is not None:
            self.fetcher.wait()

    def close(self) -> None:
        """No more disk or memory spent on the read (a chat put out of memory)."""
        if self.fetcher is not None:
            self.fetcher.close()

    def fetch(self, i: int, row: RoundRow, notes: list[str] | None) -> torch.Tensor | None:
        """Round i's upper layers, token-major [n, L - split, 2, Hkv, D], from the store, or None (saying why, in
        the log and `notes`) to recompute. `row`: the round as the chat holds it now."""
        segments = self.segments.get(i, [])
        reason = self._unusable(segments)
        if reason is None:
            loaded = self.fetcher.take(i)
            if isinstance(loaded, str):
                reason = loaded
            elif not hold_span(segments, loaded, row.token_start, row.token_end):
                reason = "upper-layer segment holds another token span"
            else:
                return self._host_upper(segments, loaded, row.token_end - row.token_start)
        note = f"round {i}: {reason}; its upper layers recomputed"
        log.info("%s (chat %s)", note, self.sid)
        if notes is not None:
            notes.append(note)
        return None

    def _host_upper(self, segments: list[dict], loaded: list[tuple], n: int) -> torch.Tensor:
        """Token-major upper K/V [n, L - split, 2, Hkv, D] from a round's upper segments, merged pairs unmerged."""
        kv = sorted(((s, t) for s, (_, t) in zip(segments, loaded) if s["kind"] == SEGMENT_KV),
                    key=lambda st: st[0]["layer_start"])
        host = kv[0][1] if len(kv) == 1 else torch.cat([t for _, t in kv], dim=1)
        for seg, (_, tensor) in zip(segments, loaded):
            if seg["kind"] == SEGMENT_MERGED:
                both = unmerge_pair(tensor.permute(1, 2, 3, 0, 4), n)  # back to [2, 2, Hkv, n + m, D] first
                for layer, layer_kv in zip((seg["layer_start"], seg["layer_end"] - 1), both):
                    host[:, layer - self.split] = layer_kv.permute(2, 0, 1, 3)
        return host


def assemble_upper(parts: list[tuple[range, torch.Tensor]], split: int, n_layers: int) -> torch.Tensor | None:
    """A tiered round's upper K/V [L - split, 2, Hkv, n, D] from the parts a restore placed, in order (a merged
    pair's layers over the zeros its segment held), or None unless they cover every upper layer."""
    covered: set[int] = set()
    for layers, _ in parts:
        covered |= set(layers)
    if not covered >= set(range(split, n_layers)):
        return None
    upper = parts[0][1].new_empty(n_layers - split, *parts[0][1].shape[1:])
    for layers, kv in parts:
        upper[layers.start - split : layers.stop - split] = kv
    return upper
