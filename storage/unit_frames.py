"""Unit-frame files: a round's K/V in its retrieval units' order, each unit's rows a zstd frame readable alone.

A lazily resumed chat (app/session/lazy.py, issue 44) reads, before its first token, only the rows of the units the
message's layers choose; a K/V segment (storage.segments) is one frame per round and group of layers, so any row of
it costs the whole round. This file holds the same K/V a second time, grouped so that a unit costs its own bytes:

    magic b"KVUF" | version u16 | fingerprint 32 bytes | dtype u8 | layers u16 | KV heads u16 | head size u16 |
    token_start u32 | token_end u32 | frames u32 | (frames + 1) x u64 offsets into the frames | index sha256 32 |
    frames ...

Frame f = (g * heads + h) * units + u holds unit u of global layer g and KV head h: its members' K rows then their
V rows ([2, members, head size], in slot order), split into byte planes and zstd-compressed (storage.codec), with
zstd's own content checksum. Which slots a unit has is the round's units segment's business (its members plane),
not this file's: the reader passes each frame's row count, and the frame must declare exactly those bytes.

Checks: the whole file hashes to its name (content-addressed, as segments; `verify_unit_frames` reads it all); a
partial read checks the header and offsets against their own sha256, and each frame against the size it must have
(zstd is handed it, so a frame declaring more is refused before anything past it is allocated) and its zstd
checksum, so damage shows up as a StorageError, never as plausible wrong floats. Reading: `read_frames_of` reads
frames of many files into one buffer (a run of consecutive frames in one read; what the page cache holds on the
calling thread, the rest on reader threads), and `decompress_frames` decompresses many frames, of any files, in one
call (python-zstandard's multi_decompress_to_buffer, on zstd's threads).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard

from kvchat.storage import codec as kvcodec
from kvchat.storage.codec import StorageError
from kvchat.storage.segments import (DTYPES, SUFFIX, SegmentCorrupt, SegmentMissing, SegmentRef, SegmentWrongModel,
                                     _reason, _whole_file_hash, place_content_addressed)

MAGIC = b"KVUF"
VERSION = 1
_FIXED = struct.Struct("<4sH32sBHHHIII")  # magic .. frames
_OFFSET = struct.Struct("<Q")
_MOST_FRAMES = 1 << 26  # a header naming more frames than this is damaged (a 128k-token round has ~2M at 8B)
_DECOMPRESSOR = zstandard.ZstdDecompressor()


@dataclass(frozen=True)
class UnitFramesHeader:
    fingerprint: str
    dtype: torch.dtype
    layers: int  # G: the global layers held
    heads: int  # Hkv
    head_dim: int
    token_start: int
    token_end: int
    offsets: np.ndarray  # frames + 1 (int64), into the frames (which start at `size`)
    size: int  # bytes before the first frame

    @property
    def frames(self) -> int:
        return len(self.offsets) - 1


def write_unit_frames(folder: Path, rows: torch.Tensor, counts: torch.Tensor, *, fingerprint: str,
                      tokens: range) -> SegmentRef:
    """Save a round's K/V in units' order: `rows` [G, Hkv, 2, n, D] (each layer's and KV head's slots sorted by
    unit, then by slot) and `counts` [G, Hkv, U] (the members of each unit; each row of it sums to n). Durable and
    content-addressed as storage.segments.write_segment: when this returns the file is on disk, and on StorageError
    nothing new is left in `folder`."""
    g, h, two, n, d = rows.shape
    if two != 2 or counts.shape[:2] != (g, h) or n != tokens.stop - tokens.start or \
            bool((counts.sum(2) != n).any()) or rows.dtype not in DTYPES:
        raise ValueError(f"unit rows {list(rows.shape)} of {rows.dtype} with counts {list(counts.shape)} do not "
                         f"make a round of {len(tokens)} tokens")
    rows = rows.detach().cpu().contiguous()
    size = rows.element_size()
    bounds = torch.cat([counts.new_zeros(g, h, 1), counts.cumsum(2)], 2).tolist()
    frames: list[bytes] = []
    for gi in range(g):
        for hi in range(h):
            head = rows[gi, hi]
            for a, b in zip(bounds[gi][hi], bounds[gi][hi][1:]):
                raw = head[:, a:b].contiguous().view(torch.uint8).numpy().tobytes()
                frames.append(kvcodec.encode(raw, size, "planes+zstd"))
    offsets = np.zeros(len(frames) + 1, dtype=np.uint64)
    np.cumsum([len(f) for f in frames], out=offsets[1:])
    fixed = _FIXED.pack(MAGIC, VERSION, bytes.fromhex(fingerprint), DTYPES.index(rows.dtype), g, h, d,
                        tokens.start, tokens.stop, len(frames))
    index = fixed + offsets.astype("<u8").tobytes()
    head_bytes = index + hashlib.sha256(index).digest()
    payload = b"".join(frames)
    name = place_content_addressed(Path(folder), (head_bytes, payload), "unit frames")
    return SegmentRef(file=name, byte_size=len(head_bytes) + len(payload), raw_size=rows.numel() * size,
                      checksum=hashlib.sha256(payload).hexdigest(), codec="planes+zstd")


class UnitFramesFile:
    """An open unit-frames file: its header read and checked once, frames read on demand (`read`)."""

    def __init__(self, path: Path, *, fingerprint: str):
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentMissing(f"unit frames {self.path.name} are missing.") from None
        except OSError as e:
            raise StorageError(f"cannot read unit frames {self.path.name}: {_reason(e)}.") from e
        try:
            self.header = self._read_header(fingerprint)
        except BaseException:
            self.close()
            raise
        self.bytes_read = self.header.size

    def __del__(self) -> None:  # a lazy resume dropped before it completed leaves no descriptor open
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> UnitFramesFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _corrupt(self, why: str) -> SegmentCorrupt:
        return SegmentCorrupt(f"unit frames {self.path.name} are corrupt: {why}.")

    def _pread(self, n: int, at: int) -> bytes:
        try:
            data = os.pread(self._fd, n, at)
        except OSError as e:
            raise StorageError(f"cannot read unit frames {self.path.name}: {_reason(e)}.") from e
        if len(data) != n:
            raise self._corrupt("the file is shorter than its index says")
        return data

    def _read_header(self, fingerprint: str) -> UnitFramesHeader:
        fixed = self._pread(_FIXED.size, 0)
        magic, version, fp, dtype_code, g, h, d, t0, t1, n_frames = _FIXED.unpack(fixed)
        if magic != MAGIC or version != VERSION:
            raise self._corrupt("it is not a unit-frames file of this version")
        if dtype_code >= len(DTYPES) or n_frames > _MOST_FRAMES or t0 > t1:
            raise self._corrupt("its header is damaged")
        rest = self._pread(_OFFSET.size * (n_frames + 1) + 32, _FIXED.size)
        index, digest = fixed + rest[:-32], rest[-32:]
        if hashlib.sha256(index).digest() != digest:
            raise self._corrupt("its index does not match its checksum")
        if fp.hex() != fingerprint.lower():
            raise SegmentWrongModel(f"unit frames {self.path.name} were computed by a different model.")
        offsets = np.frombuffer(rest[:-32], dtype="<u8").astype(np.int64)
        if bool((offsets[1:] < offsets[:-1]).any()) or offsets[0] != 0:
            raise self._corrupt("its frame offsets go backwards")
        return UnitFramesHeader(fp.hex(), DTYPES[dtype_code], g, h, d, t0, t1, offsets, _FIXED.size + len(rest))

    def frame_index(self, layer: int, head: int, unit: int, units: int) -> int:
        """The frame of unit `unit` of global layer `layer` (of the file's) and KV head `head`, a round whose units
        segment has `units` units per layer and KV head."""
        hd = self.header
        if hd.frames != hd.layers * hd.heads * units or not (0 <= layer < hd.layers and 0 <= head < hd.heads):
            raise self._corrupt(f"it holds {hd.frames} frames, not {hd.layers} x {hd.heads} x {units} units")
        return (layer * hd.heads + head) * units + unit

    def read_frames(self, frames: list[int]) -> tuple[bytearray, np.ndarray]:
        """Frames (indices, ascending) as read, still compressed: their bytes back to back, consecutive frames in
        one read, and each frame's (offset, length) in them [F, 2] uint64 (`read_frames_of`, of this file alone)."""
        return read_frames_of([self], [np.asarray(frames, dtype=np.int64)])

    def read_planes(self, frames: list[int], rows: list[int]) -> bytes:
        """The frames decompressed, still in byte planes, back to back (`decompress_frames`)."""
        try:
            return decompress_frames(*self.read_frames(frames),
                                     frame_sizes(rows, self.header.head_dim, self.header.dtype.itemsize))
        except StorageError as e:
            raise self._corrupt(str(e)) from None

    def read(self, frames: list[int], rows: list[int]) -> list[torch.Tensor]:
        """Frames (indices, ascending) as K/V rows [2, rows[i], head size] on the CPU (`read_planes`, merged)."""
        hd = self.header
        planes = np.frombuffer(self.read_planes(frames, rows), dtype=np.uint8)
        out, at = [], 0
        for n in rows:
            size = 2 * n * hd.head_dim * hd.dtype.itemsize
            if not size:
                out.append(torch.empty(2, 0, hd.head_dim, dtype=hd.dtype))
                continue
            values = kvcodec.from_planes(planes[at : at + size], hd.dtype.itemsize)
            out.append(torch.from_numpy(values).view(hd.dtype).view(2, n, hd.head_dim))
            at += size
        return out


def read_frames_of(files: list[UnitFramesFile], frames: list[np.ndarray], pool: Executor | None = None,
                   jobs: int = 1) -> tuple[bytearray, np.ndarray]:
    """Frames of several files read together, still compressed, into one buffer: files[i]'s frames `frames[i]`
    (ascending indices) back to back, file after file. Consecutive frames of a file come in one read. Returns the
    buffer and each frame's (offset, length) in it [F, 2] uint64 (`decompress_frames` checks them).

    A layer of a lazy resume reads ~1,000 frames of ~50 files. From the page cache one thread reads them fastest
    (~3-5 us a frame; more threads only hand the GIL around: 32 took ~10 us a frame on the H200 host, 2026-11-28);
    from the disk they must be waited for side by side. So each read is first tried without waiting
    (`RWF_NOWAIT`: the kernel answers only from the page cache, a short read where it holds only the start), on
    this thread; the ones refused or short are then announced to the kernel together (`POSIX_FADV_WILLNEED`, which
    starts them all) and read by `jobs` threads on `pool` (preads release the GIL). The per-frame work is numpy's
    and the kernel's: Python work per frame or per file is what made those reads cost ~35 us a frame before
    (docs/benchmarks.md)."""
    run_file, run_at, run_len, frame_len = [], [], [], []
    for k, (file, f) in enumerate(zip(files, frames)):
        hd = file.header
        f = np.asarray(f, dtype=np.int64)
        if not f.size:
            continue
        if bool((f[1:] <= f[:-1]).any()) or f[0] < 0 or f[-1] >= hd.frames:
            raise ValueError(f"frames {f[:4].tolist()}... are not ascending indices of {hd.frames} frames")
        first = np.flatnonzero(np.r_[True, f[1:] != f[:-1] + 1])  # each run of consecutive frames: one read
        last = np.r_[first[1:], f.size] - 1
        at = hd.offsets[f[first]]
        run_at.append(at + hd.size)
        run_len.append(hd.offsets[f[last] + 1] - at)
        run_file.append(np.full(first.size, k))
        frame_len.append(hd.offsets[f + 1] - hd.offsets[f])
    if not run_at:
        return bytearray(), np.zeros((0, 2), dtype=np.uint64)
    lengths = np.concatenate(run_len)
    dest = np.cumsum(lengths) - lengths
    buffer = bytearray(int(lengths.sum()))
    view = memoryview(buffer)
    which, at, length, dest = (np.concatenate(run_file).tolist(), np.concatenate(run_at).tolist(), lengths.tolist(),
                               dest.tolist())
    fds = [files[k]._fd for k in which]  # each read's

    def failed(j: int, e: OSError) -> StorageError:
        return StorageError(f"cannot read unit frames {files[which[j]].path.name}: {_reason(e)}.")

    waiting = []  # the reads the page cache could not answer at once
    nowait = getattr(os, "RWF_NOWAIT", 0)
    for j in range(len(which)):
        if not nowait:
            waiting.append(j)
            continue
        try:
            if os.preadv(fds[j], [view[dest[j] : dest[j] + length[j]]], at[j], nowait) == length[j]:
                continue
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise failed(j, e) from e
            nowait = 0  # (a kernel or file system without it: every read waits)
        waiting.append(j)  # (a short read too: the rest was not cached, or the file is short; the wait tells)
    if waiting and hasattr(os, "posix_fadvise"):
        try:
            for j in waiting:
                os.posix_fadvise(fds[j], at[j], length[j], os.POSIX_FADV_WILLNEED)
        except OSError:  # (advice only: the reads below wait either way)
            pass

    def read(part: list[int]) -> None:
        for j in part:
            try:
                got = os.preadv(fds[j], [view[dest[j] : dest[j] + length[j]]], at[j])
            except OSError as e:
                raise failed(j, e) from e
            if got != length[j]:
                raise files[which[j]]._corrupt("the file is shorter than its index says")

    parts = [part.tolist() for part in np.array_split(np.asarray(waiting, dtype=np.int64),
                                                      max(1, min(jobs, len(waiting))))]
    if pool is None or len(parts) == 1:
        read(waiting)
    else:
        reads = [pool.submit(read, p) for p in parts]
        wait(reads)  # every share done before any error is raised: no read outlives the call (or its descriptors)
        for part in reads:
            part.result()
    per_file = np.bincount(np.concatenate(run_file), weights=lengths, minlength=len(files))
    for file, n in zip(files, per_file.tolist()):
        file.bytes_read += int(n)
    frame_len = np.concatenate(frame_len).astype(np.uint64)
    return buffer, np.stack([np.cumsum(frame_len) - frame_len, frame_len], 1)


def frame_sizes(rows: list[int], head_dim: int, itemsize: int) -> list[int]:
    """The decompressed bytes of frames of rows[i] K/V rows each."""
    return [2 * n * head_dim * itemsize for n in rows]


def decompress_frames(data: bytes | bytearray, segments: np.ndarray, sizes: list[int], threads: int = 0) -> bytearray:
    """Frames (their bytes `data`, each frame's (offset, length) in them, any files') decompressed together, back to
    back, each checked against its zstd checksum and against the size it must have (`sizes`: zstd is given them, so
    a frame declaring more is refused without its size being allocated). zstd's `threads` (0: this one; more pay
    off only for hundreds of frames)."""
    if not len(sizes):
        return bytearray()
    try:
        out = _DECOMPRESSOR.multi_decompress_to_buffer(
            zstandard.BufferWithSegments(data, np.ascontiguousarray(segments, dtype=np.uint64).tobytes()),
            decompressed_sizes=np.asarray(sizes, dtype=np.uint64), threads=threads)
    except (zstandard.ZstdError, ValueError) as e:
        raise StorageError(f"a frame cannot be decoded ({e})") from None
    return bytearray().join(out[k] for k in range(len(out)))


def merge_planes(planes: torch.Tensor, values: torch.Tensor, itemsize: int, total: int | None = None) -> torch.Tensor:
    """Frames' bytes as `read_planes` gives them (uint8, on any device) -> their values' bytes [sum(values),
    itemsize] (uint8): frame i holds values[i] values, its j-th byte plane at j * values[i] within the frame. One
    gather on the device, whatever the number of frames."""
    total = int(values.sum()) if total is None else total  # (given: no wait for the device)
    frame = torch.repeat_interleave(torch.arange(len(values), device=values.device), values, output_size=total)
    first = torch.cumsum(values, 0) - values  # each frame's first value
    within = torch.arange(total, device=values.device) - first[frame]
    at = first[frame] * itemsize + within  # the value's byte in plane 0 (a frame: itemsize planes back to back)
    return torch.stack([planes[at + p * values[frame]] for p in range(itemsize)], 1)


def merge_planes_on_host(planes: bytes, values: list[int], itemsize: int) -> torch.Tensor:
    """`merge_planes` on the CPU: frame by frame (a strided copy a plane, storage.codec.from_planes), which there
    beats one gather of every byte by ~10x."""
    flat = np.frombuffer(planes, dtype=np.uint8)
    out = np.empty((sum(values), itemsize), dtype=np.uint8)
    at = row = 0
    for n in values:
        src = flat[at : at + n * itemsize].reshape(itemsize, n)
        for p in range(itemsize):
            out[row : row + n, p] = src[p]
        at, row = at + n * itemsize, row + n
    return torch.from_numpy(out)


def verify_unit_frames(path: Path) -> None:
    """The whole file against its content-addressed name (what a partial read cannot check)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SegmentMissing(f"unit frames {path.name} are missing.") from None
    if _whole_file_hash(data) + SUFFIX != path.name:
        raise SegmentCorrupt(f"unit frames {path.name} are corrupt: their content does not match their name.")
