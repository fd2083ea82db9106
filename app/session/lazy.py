"""A lazy resume (LouisKV, issue 44): a reopened louiskv chat answers its next message before its K/V is in.

Opening reads the rounds' stored units (centroids and members, app/session/units.py) and nothing of the K/V: the
cache is as long as the chat and empty. The message's prefill reads units (engine.policies.units_prefill): each
global layer chooses from its queries, and `StoredRows.ensure` brings in, from the store, the rounds holding the
rows it chose (the sinks and the buffer are rows it reads too). After the first token, `complete` reads the rounds
not brought in yet (or, where one cannot be read, runs the session's whole restore into the same cache, which
recomputes it), and the engine computes the message again over all of it: the reply and every K/V stored are those
of a fully restored chat.

Reading less than a round: the store keeps a round's K/V as one compressed segment per group of layers, so any row
of it costs the whole round, and on a long chat the first choice alone touches 42–100% of the rounds (docs/
benchmarks.md, "What a lazy resume would have to read"). A chat opened with lazy resumes on stores each round a second
time in its units' order (storage.unit_frames, app/session/units.py `unit_rows`): each unit of each layer and KV
head a frame of its own, its rows as they are (version 2; version 1's zstd frames count as none: the round is read
whole, and the chat gets version 2's once it is whole). `ensure` reads only the frames of the units a layer's heads
chose (the sinks' and the buffer's rows are units too, read the same way), and a round without unit frames whole.

Only chats whose every round has its units stored and its K/V in plain segments (no merged pairs), on a cache
without sliding-window rings, are opened lazily; any other is restored whole, said in the restore's notes. A round
that cannot be read when it is asked for stops the lazy answer (`LazyResumeFailed`, before any token is out): the
session restores the chat whole and answers again.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvchat.app.session.units import READ_THREADS
from kvchat.errors import KvchatError
from kvchat.kernels._triton import triton_kernel_runs_on
from kvchat.kernels.frame_checksums import frame_checksums
from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, SEGMENT_UNITS, RoundRow, Store
from kvchat.storage.pagecache import disk_bytes_read
from kvchat.storage.segments import read_segment
from kvchat.storage.unit_frames import (FrameTable, UnitFramesFile, frame_rows, frame_sums, gather_table_frames,
                                        readable_frames)


# Threads reading the unit frames of a layer that are not in the page cache (storage.unit_frames.gather_table_frames),
# and opening the rounds' files: each read waits on the disk, so many more than the cores (a pread releases the GIL).
FRAME_READERS = min(32, 4 * (os.cpu_count() or 1))


_checksum_kernel_failed: str | None = None  # why the checksum kernel could not run here (then the torch way)


def _checksums(rows: Tensor, counts: Tensor, members: int) -> tuple[Tensor, Tensor]:
    """Frames' checksums (storage.unit_frames.frame_sums) of rows [2 * members, row bytes] uint8 holding frames of
    counts [F] members, where the rows are -> (each frame's first row [F], its sums [F, 2]). Where triton runs, one
    kernel (kernels/frame_checksums.py) instead of ~14 small ones; if it cannot be compiled here (a triton or a
    driver it never ran on), the log says so once and the torch way gives the same sums."""
    global _checksum_kernel_failed
    per = 2 * counts  # each frame's rows
    if _checksum_kernel_failed is None and triton_kernel_runs_on(rows.device):
        try:
            first_row = torch.cumsum(per, 0) - per
            return first_row, frame_checksums(rows.view(torch.int16), first_row, per)
        except Exception as exc:  # (a compile error of this kernel only: the sums below are the same)
            _checksum_kernel_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logging.getLogger(__name__).warning("frame checksum kernel unavailable (%s): checksums by torch",
                                                _checksum_kernel_failed)
    first_row, row_frame, row_place = frame_rows(counts, total=2 * members)
    return first_row, frame_sums(rows, row_frame, row_place, len(counts))


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


class FrameFilesOpening:
    """A lazily opened chat's unit-frames files being opened on reader threads from the open's start, beside the read
    of its units: each open reads and hashes a header and an index (~260 KB at 32k on the 8B shape), and the
    message's first layer, which touched all 51 rounds of the bench's chat, waited ~42 ms for them on the H200 host
    (2026-11-29) after the units' ~78 ms. `StoredRows` takes each as its layers reach the round and checks it then
    against the round's units (known only once they are read); what it never takes is closed with it."""

    def __init__(self, store: Store, segments: list[dict], rounds: list[RoundRow], fingerprint: str,
                 dtype: torch.dtype):
        framed = readable_frames(segments, dtype)
        self.pool = ThreadPoolExecutor(max_workers=FRAME_READERS)
        self._opening: dict[int, Future] = {
            i: self.pool.submit(UnitFramesFile, store.kv_dir / framed[row.idx]["file"], fingerprint=fingerprint)
            for i, row in enumerate(rounds) if row.idx in framed}

    def take(self, i: int) -> Future | None:
        """Round i's file being opened (its result the open UnitFramesFile, or the StorageError that stopped it), or
        None where it was taken or the round has no frames of the cache's precision."""
        return self._opening.pop(i, None)

    def close(self) -> None:
        """The files nobody took closed, now or once their opens end."""
        for opening in self._opening.values():
            opening.add_done_callback(_close_opened)
        self._opening.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)  # (opens not begun are not begun)


def _close_opened(opening: Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


class StoredRows:
    """engine.policies.units_prefill.LazyChat over a chat's store: the rows a layer's heads choose brought in by their
    units' frames where the round has unit frames, else the round whole (every layer) the first time any row of it
    is asked for; `complete` brings in the rest, or runs `restore_whole` (the session's whole restore into the same
    cache) where a round cannot be read."""

    def __init__(self, store: Store, segments: list[dict], fingerprint: str, rounds: list[RoundRow], cache, stats,
                 restore_whole: Callable[[], None], members: dict[int, Tensor] | None = None,
                 global_layers: list[int] | None = None, after_complete: Callable[[], None] | None = None,
                 opening: FrameFilesOpening | None = None):
        """`segments`: the chat's segment rows; `stats`: the session's RestoreStats of this open, which the
        completion fills in; `members`: each round's units' members [G, Hkv, n] on the CPU, as read from its units
        segment, on the device the cache's units are (without them, or without `global_layers`, every round is
        read whole); `after_complete`: run once the cache holds the whole chat (the session stores the unit frames
        of rounds saved without them); `opening`: the rounds' unit-frames files being opened since the chat was
        opened (its reader threads become these rows'; closed with them)."""
        self.store, self.fingerprint, self.cache, self.stats = store, fingerprint, cache, stats
        self.rounds = rounds
        self.starts = [r.token_start for r in rounds]
        self.segments: dict[int, list[dict]] = {}
        self.frames = readable_frames(segments, cache.kv.dtype)  # round -> its unit-rows segment (else: read whole)
        units_bytes = 0
        for seg in segments:
            if seg["kind"] == SEGMENT_KV:
                self.segments.setdefault(seg["round_idx"], []).append(seg)
            elif seg["kind"] == SEGMENT_UNITS:
                units_bytes += seg["byte_size"]
        self._complete, self._after_complete = restore_whole, after_complete
        self._all_framed = all(row.idx in self.frames for row in rounds)
        # the chat's K/V on disk: what a whole restore reads (the share read before the first token is the figure)
        self.chat_bytes = sum(seg["byte_size"] for segs in self.segments.values() for seg in segs)
        self.units_bytes = units_bytes  # the units (centroids and members), read when the chat was opened
        self.loaded: set[int] = set()  # rounds brought in whole
        self._whole = torch.zeros(len(rounds), dtype=torch.bool)  # the same, as a mask
        # (on the device the chat's members are, kept beside it: a copy from pageable memory a layer waits for the
        # device's queue)
        self._whole_on: dict[torch.device, Tensor] = {}
        self._starts_on: dict[torch.device, Tensor] = {}
        # bytes of K/V read from the store so far: whole rounds' compressed segments, unit frames' indexes and rows
        # (the bytes between runs read across included)
        self.bytes_read = 0
        self.frames_read = 0
        self.read_s = 0.0
        # where read_s went, on the host's clock: the frames' indices (the copy to the host waits for the layer's
        # work queued before it), the rounds' files opened (by the first layer that touches them), their reads,
        # their checksums (the copy to the device and the sums, queued; looked at in `verify`, which adds its wait
        # here too), and the rows' writes (queued on a GPU)
        self.phase_s = {"index": 0.0, "files": 0.0, "io": 0.0, "check": 0.0, "place": 0.0}
        # the io phase's own parts (storage.unit_frames.gather_table_frames' `detail`): the plan, the reads tried
        # without waiting, the wait for the reader threads (s); the runs, the reads, those left to the threads
        # (refused or not tried), and the gaps between a file's runs by size
        self.io_detail: dict[str, float] = {}
        self.completed = False
        self.whole_restore_because: str | None = None  # why the completion became the session's whole restore
        self.complete_s = 0.0
        self.read_before_first_token: set[int] = set()  # the rounds the message's layers read (whole or in part)
        self.bytes_before_first_token = 0  # K/V read before the first token (as bytes_read), units not included
        # the process's bytes read from the disk so far (storage.pagecache.disk_bytes_read: pages and read-ahead
        # included), when the message's last layer had its rows; None where the OS does not count them
        self.disk_read_by_first_token: int | None = None
        self._touched: set[int] = set()  # rounds read in part (their unit frames)
        self._globals = {layer: g for g, layer in enumerate(global_layers or [])}
        self._members = members or {}
        self._files: dict[int, UnitFramesFile] = {}
        # the open files' indexes side by side (storage.unit_frames.FrameTable: a layer's frames of ~50 files
        # planned by a few numpy calls), and each round's place in it (-1: not opened)
        self._table = FrameTable([])
        self._table_of = np.full(len(rounds), -1, dtype=np.int64)
        self._opening = opening
        # cold unit frames, a share each
        self._pool = opening.pool if opening is not None else ThreadPoolExecutor(max_workers=FRAME_READERS)
        self._held: dict[int, Tensor] = {}  # global layer -> [rounds, Hkv, most units] bool: unit frames read
        # frames read whose checksums are not looked at yet: (each frame's mismatch [F] bool, where each round's
        # frames begin in it, the rounds, their files' names)
        self._unchecked: list[tuple[Tensor, np.ndarray, list[int], list[str]]] = []
        tiled = all(a.token_end == b.token_start for a, b in zip(rounds, rounds[1:])) and bool(rounds) and \
            rounds[0].token_start == 0
        self._chat_member, self._counts_np = None, None
        if tiled and all(r.idx in self._members for r in rounds):
            self._chat_units()

    def _round_of(self, slot: int) -> int:
        return bisect.bisect_right(self.starts, slot) - 1

    def ensure(self, layer: int, slots: Tensor) -> None:
        if self.completed:
            return
        by_frames = self._chat_member is not None and layer in self._globals
        wanted = slots.long().to(self._chat_member.device if by_frames else "cpu")  # [Hkv, n]
        rounds = torch.bucketize(wanted, self._starts(wanted.device), right=True) - 1
        if not by_frames or not self._all_framed:  # (every round framed: no wait for the device to list its rounds)
            touched = rounds.unique().tolist()
            if touched and (touched[0] < 0 or touched[-1] >= len(self.rounds)):
                raise LazyResumeFailed("slot outside the chat's rounds")
            for i in touched:  # rounds without unit frames: whole
                if i not in self.loaded and not (by_frames and self.rounds[i].idx in self.frames):
                    self._load(i)
        if by_frames:
            self._ensure_units(layer, wanted, rounds)

    def _starts(self, device) -> Tensor:
        device = torch.device(device)
        if device not in self._starts_on:
            self._starts_on[device] = torch.tensor(self.starts, device=device)
        return self._starts_on[device]

    def _whole_mask(self, device) -> Tensor:
        """`_whole` where the chat's members are (copied once, then kept up to date by `_place`)."""
        device = torch.device(device)
        if device not in self._whole_on:
            self._whole_on[device] = self._whole.to(device)
        return self._whole_on[device]

    @torch.inference_mode()
    def _ensure_units(self, layer: int, wanted: Tensor, rounds: Tensor) -> None:
        """The unit frames of `wanted` [Hkv, n] (in `rounds`; both where the chat's members are) that no earlier
        read brought in, written into the cache's rows of their members: the rounds' frames read into one host
        buffer (`gather_frames`: from the page cache on this thread, from the disk on reader threads), then one copy
        to the cache's device, where each frame is checked against its checksum and the rows are placed."""
        g = self._globals[layer]
        n_heads, most, on = wanted.shape[0], self._most_units, wanted.device
        heads = torch.arange(n_heads, device=on)[:, None].expand_as(wanted)
        total = self._chat_member.shape[2]
        outside = ((wanted < 0) | (wanted >= total)).any()  # (looked at below, after a wait there is anyway)
        units = self._chat_member[g].gather(1, wanted.clamp(0, total - 1))  # [Hkv, n]
        # ascending: by round, head, unit
        keys = ((rounds.clamp(0, len(self.rounds) - 1) * n_heads + heads) * most + units).unique()
        if bool(outside):
            raise LazyResumeFailed("slot outside the chat's rounds")
        held = self._held.setdefault(g, torch.zeros(len(self.rounds) * n_heads * most, dtype=torch.bool,
                                                    device=on))
        whole = self._whole_mask(on)  # rounds brought in whole
        keys = keys[~held[keys] & ~whole[keys // (n_heads * most)]]
        if not keys.numel():
            return
        held[keys] = True
        t0 = time.perf_counter()
        key_rounds, key_heads, key_units = keys // (n_heads * most), keys // most % n_heads, keys % most
        place = key_heads * self._unit_begin.shape[2] + key_rounds * most + key_units
        begin = self._unit_begin[g].view(-1)[place]
        counts = self._unit_begin[g].view(-1)[place + 1] - begin  # [F] each frame's members
        # the frames' indices on the host, in one copy; from here on the per-frame work is numpy's (storage.
        # unit_frames.gather_table_frames): Python work per frame is what a layer's ~1,000 frames cannot afford
        key_rounds_np, key_heads_np, key_units_np, counts_np = torch.stack(
            [key_rounds, key_heads, key_units, counts]).cpu().numpy()
        frames = (g * n_heads + key_heads_np) * self._n_units_np[key_rounds_np] + key_units_np
        touched_np, first = np.unique(key_rounds_np, return_index=True)  # keys are in round order
        touched = touched_np.tolist()
        t1 = time.perf_counter()
        self._open_files([i for i in touched if i not in self._files])
        files = [self._file(i) for i in touched]
        if bool((self._table_of[touched_np] < 0).any()):  # files opened since the table was made: a new one
            opened = sorted(self._files)
            self._table = FrameTable([self._files[i] for i in opened])
            self._table_of = np.full(len(self.rounds), -1, dtype=np.int64)
            self._table_of[opened] = np.arange(len(opened))
        which = self._table_of[key_rounds_np]  # [F] each frame's file in the table (ascending: keys are)
        tf = time.perf_counter()
        before = sum(file.bytes_read for file in files)
        device = self.cache.kv.device
        try:
            data, _, _ = gather_table_frames(self._table, which, frames, self._pool, FRAME_READERS,
                                             pin=device.type == "cuda", detail=self.io_detail)
        except StorageError as exc:
            culprit = next((i for i, file in zip(touched, files) if file.path.name in str(exc)), touched[0])
            raise LazyResumeFailed(f"round {self.rounds[culprit].idx}: {exc}") from None
        self.bytes_read += sum(file.bytes_read for file in files) - before
        expected = self._table.expected_sums(which, frames)
        t2 = time.perf_counter()
        self.frames_read += len(frames)
        self._touched.update(touched)
        stored = files[0].header.dtype
        members = int(counts_np.sum())
        rows = data.to(device, non_blocking=True)  # [2 * members, row bytes]: each frame's K rows, then its V rows
        counts, begin, key_heads = counts.to(device), begin.to(device), key_heads.to(device)
        # each frame checked where its rows landed (storage.unit_frames.frame_sums), queued: the message's layers
        # are checked together once its last layer has its rows (`verify`), one wait for the device a message
        # rather than one a layer (~40 ms of a 32k chat's first token on the H200, 2026-11-29)
        first_row, sums = _checksums(rows, counts, members)
        # (the expected sums pinned: a copy from pageable memory would wait for the device's queue to reach it)
        pinned = torch.empty(expected.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        pinned.numpy()[:] = expected
        bad = (sums != pinned.to(device, non_blocking=True)).any(1)  # [F]
        self._unchecked.append((bad, first, [self.rounds[i].idx for i in touched], [f.path.name for f in files]))
        t3 = time.perf_counter()
        values = rows.view(stored)  # [2 * members, D]
        frame = torch.repeat_interleave(torch.arange(len(counts), device=device), counts,
                                        output_size=members)  # each member's frame
        row = torch.arange(members, device=device) - (torch.cumsum(counts, 0) - counts)[frame]  # its place there
        k_at = first_row[frame] + row
        kv = torch.stack([values[k_at], values[k_at + counts[frame]]])  # [2, members, D]
        slots = self._sorted_slots[g].to(device)[key_heads[frame], begin[frame] + row]  # (where the members are)
        self.cache.write_rows(layer, key_heads[frame], slots, kv)
        t4 = time.perf_counter()
        for phase, took in zip(self.phase_s, (t1 - t0, tf - t1, t2 - tf, t3 - t2, t4 - t3)):
            self.phase_s[phase] += took
        self.read_s += t4 - t0

    def verify(self) -> None:
        """Every frame read so far against its checksum, one wait for the device: LazyResumeFailed naming the
        first round whose frame does not match. The message's prefill calls it once its last layer has its rows,
        before its first token is sampled; `complete` before it reads the rest."""
        if self.disk_read_by_first_token is None:  # (the message's last layer has its rows: all it reads is in)
            self.disk_read_by_first_token = disk_bytes_read()
        pending, self._unchecked = self._unchecked, []
        if not pending:
            return
        t0 = time.perf_counter()
        bad = torch.cat([mismatch for mismatch, _, _, _ in pending]).nonzero()
        self.phase_s["check"] += time.perf_counter() - t0
        self.read_s += time.perf_counter() - t0
        if not bad.numel():
            return
        at = int(bad[0, 0])
        for mismatch, first, rounds, names in pending:
            if at < len(mismatch):
                k = int(np.searchsorted(first, at, side="right")) - 1
                raise LazyResumeFailed(f"round {rounds[k]}: unit frames {names[k]} are corrupt: a frame does not "
                                       f"match its checksum")
            at -= len(mismatch)

    def _chat_units(self) -> None:
        """The chat's members side by side, where they are (on a GPU: the cache's device) [G, Hkv, T]; each global
        layer's and KV head's slots in unit-frame order, round after round [G, Hkv, T]; where each unit of each
        round begins in that order [G, Hkv, rounds * most units + 1]; each round's count of units. One sort for the
        whole chat: the key of a slot is its round's then its unit's place, a stable sort keeps the slots in order."""
        member = torch.cat([self._members[r.idx] for r in self.rounds], 2).long()  # [G, Hkv, T]
        g, h, total = member.shape
        lengths = torch.tensor([r.token_end - r.token_start for r in self.rounds], device=member.device)
        round_of = torch.repeat_interleave(torch.arange(len(self.rounds), device=member.device), lengths)  # [T]
        most_of_slot = member.amax(dim=(0, 1))  # [T]
        most = torch.zeros(len(self.rounds), dtype=torch.long, device=member.device).scatter_reduce(
            0, round_of, most_of_slot, "amax", include_self=True) + 1  # [R] units of each round
        self._n_units = most.tolist()
        self._n_units_np = np.asarray(self._n_units, dtype=np.int64)
        self._most_units = max(self._n_units)
        key = round_of * self._most_units + member  # [G, Hkv, T]
        self._sorted_slots = key.argsort(dim=2, stable=True)
        counts = torch.zeros(g, h, len(self.rounds) * self._most_units, dtype=torch.long, device=member.device)
        counts.scatter_add_(2, key, torch.ones_like(key))
        self._unit_begin = torch.cat([counts.new_zeros(g, h, 1), counts.cumsum(2)], 2)
        self._unit_counts, self._counts_np = counts, None  # [G, Hkv, rounds * most units]
        self._chat_member = member

    def _open_files(self, rounds: list[int]) -> None:
        """Rounds' unit-frames files opened side by side on the reader threads (`_open`): each open reads and
        hashes a header and an index (~260 KB at 32k on the 8B shape), and a message's first layer opens ~50. Those
        opening since the chat was opened (`FrameFilesOpening`) are waited for and checked on this thread."""
        early = {i: self._opening.take(i) for i in rounds} if self._opening is not None else {}
        early = {i: opening for i, opening in early.items() if opening is not None}
        rest = [i for i in rounds if i not in early]
        if not early and len(rest) < 2:
            return
        if self._counts_np is None:  # (on this thread: what each file's members are checked against)
            self._counts_np = self._unit_counts.cpu().numpy()
        opening = [self._pool.submit(self._open, i) for i in rest]
        failed: list[BaseException] = []
        try:
            for i, opened in early.items():
                try:
                    self._keep(i, self._open(i, opened))
                except LazyResumeFailed as exc:
                    failed.append(exc)
        except BaseException:  # (an interrupt: the early opens not waited for yet are closed once they end)
            for i, opened in early.items():
                if i not in self._files:
                    opened.add_done_callback(_close_opened)
            raise
        finally:
            wait(opening)  # every open done (or failed) before any error is raised: none outlives the lazy resume
            for i, task in zip(rest, opening):
                if task.exception() is None:
                    self._keep(i, task.result())  # (kept: closed with the rest)
        if failed:
            raise failed[0]
        for task in opening:
            task.result()

    def _file(self, i: int) -> UnitFramesFile:
        """Round i's unit frames, opened once (`_open`; the header and index counted as bytes read)."""
        if i not in self._files:
            self._keep(i, self._open(i, self._opening.take(i) if self._opening is not None else None))
        return self._files[i]

    def _keep(self, i: int, file: UnitFramesFile) -> None:
        self._files[i] = file
        self.bytes_read += file.header.size

    def _open(self, i: int, opened: Future | None = None) -> UnitFramesFile:
        """Round i's unit frames opened (or `opened`'s, being opened), its header and index read and checked
        against the round's units."""
        try:
            file = opened.result() if opened is not None else UnitFramesFile(
                self.store.kv_dir / self.frames[self.rounds[i].idx]["file"], fingerprint=self.fingerprint)
            try:
                file.frame_index(0, 0, 0, self._n_units[i])  # it holds a frame for each of this round's units
                if self._counts_np is None:  # (every round's members per unit, on the host: one copy)
                    self._counts_np = self._unit_counts.cpu().numpy()
                most = self._most_units
                file.check_members(self._counts_np[:, :, i * most : i * most + self._n_units[i]])
            except StorageError:
                file.close()
                raise
        except StorageError as exc:
            raise LazyResumeFailed(f"round {self.rounds[i].idx}: {exc}") from None
        return file

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
        # (run once: let go of them, which close over the session and its cache — held, they make a reference cycle
        # session -> these rows -> the session, and a closed chat's cache (4.3 GB at 32k on the 8B shape) stayed on
        # the device until Python's cycle collector ran: the lazy resume's peak of 19.1 GiB against kv-split's 10.4
        # in the bench, whose runs each opened the chat again beside the last ones' caches)
        restore_whole, after_complete = self._complete, self._after_complete
        self.read_before_first_token = self.loaded | self._touched
        self.bytes_before_first_token = self.bytes_read
        self.close()
        rest = [i for i in range(len(self.rounds)) if i not in self.loaded]  # (a round read in part: whole now)
        t0 = time.perf_counter()
        try:
            # frames not checked yet (the message's prefill checks its own before its first token: this only finds
            # any read outside it) are a round that cannot be read: the whole restore, which recomputes it
            self.verify()
            with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(rest)))) as pool:
                reads = [(i, pool.submit(self._read, i)) for i in rest]
                for i, read in reads:
                    self._place(i, read.result())
        except LazyResumeFailed as exc:
            if restore_whole is None:  # (closed before: nothing to fall back to)
                raise
            self.whole_restore_because = str(exc)
            restore_whole()
        self.complete_s = time.perf_counter() - t0
        after = (f"the rest read after it ({self.complete_s * 1000:.0f} ms)" if self.whole_restore_because is None
                 else f"then restored whole ({self.whole_restore_because})")
        frames = f", {self.frames_read:,} unit frames" if self.frames_read else ""
        self.stats.notes.append(f"opened lazily: {self.rounds_before_first_token} of {len(self.rounds)} rounds "
                                f"({self.bytes_before_first_token:,} bytes{frames}) read before the first token, "
                                f"{after}")
        if self.whole_restore_because is None:
            self.stats.tokens_loaded = self.rounds[-1].token_end if self.rounds else 0
        if after_complete is not None:
            after_complete()

    def close(self) -> None:
        """Let go of the unit-frames files, the reader threads and the callbacks into the session (once complete, or
        when the lazy answer stopped)."""
        self._complete = self._after_complete = None
        if self._opening is not None:
            self._opening.close()
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._pool.shutdown(wait=False)

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
        self._whole[i] = True
        for mask in self._whole_on.values():
            mask[i] = True
