"""Unit-frame files: a round's K/V in its retrieval units' order, each unit's rows readable alone, as they are.

A lazily resumed chat (app/session/lazy.py, issue 44) reads, before its first token, only the rows of the units the
message's layers choose; a K/V segment (storage.segments) is one frame per round and group of layers, so any row of
it costs the whole round. This file holds the same K/V a second time, grouped so that a unit costs its own bytes:

    magic b"KVUF" | version u16 | fingerprint 32 bytes | dtype u8 | layers u16 | KV heads u16 | head size u16 |
    token_start u32 | token_end u32 | frames u32 | frames x u32 members | frames x 2 i64 checksums |
    index sha256 32 | zeros to a multiple of 4,096 bytes | rows ...

Frame f = (g * heads + h) * units + u holds unit u of global layer g and KV head h: its members' K rows then their
V rows ([2, members, head size], in slot order), uncompressed, so frame f's rows begin at row 2 * (members of the
frames before it). Which slots a unit has is the round's units segment's business (its members plane); the file
names each frame's member count, and the reader checks them against the units it holds.

Why raw, where every other K/V file is compressed (version 1 held zstd frames): a lazy resume's first token waits on
~1,000 frames a layer, 32 layers one after another, and decompressing them and merging their byte planes took ~240
of the ~430 ms its reads took at 32k on the 8B shape (H200, 2026-11-28, docs/benchmarks.md). Raw, a frame is a run of
rows at a known place, read by one pread into the layer's buffer (`gather_frames`). The price: the copy takes ~1.6x
the disk of a compressed one (bfloat16 K/V compresses ~1.6x with planes+zstd), and what a lazy resume reads before
its first token grows by the same factor (still ~0.12x of what a whole restore reads at 32k on the 8B shape).

Checks: the whole file hashes to its name (content-addressed, as segments; `verify_unit_frames` reads it all); a
partial read checks the header and index against their own sha256, the file's size against the index, and each
frame read against its two checksums (`frame_sums`: the frame's 16-bit words weighted by their place, and by its
square; computed where the rows land, on the GPU for a GPU's cache), so damage to one or two words of a frame shows
up as a StorageError, never as plausible wrong floats (wider damage, unless it cancels in both sums).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import time
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_UNIT_ROWS
from kvchat.storage.segments import (DTYPES, SUFFIX, SegmentCorrupt, SegmentMissing, SegmentRef, SegmentWrongModel,
                                     _reason, _whole_file_hash, place_content_addressed)

MAGIC = b"KVUF"
VERSION = 2
CODEC = "raw"  # what a unit-rows segment row of this version names as its codec (version 1's: "planes+zstd")
_FIXED = struct.Struct("<4sH32sBHHHIII")  # magic .. frames
_ALIGN = 4096  # the rows begin on a page: a unit's rows span as few pages as they can
_MOST_FRAMES = 1 << 26  # a header naming more frames than this is damaged (a 128k-token round has ~2M at 8B)
# Runs of a file read together when at most this many bytes apart (`gather_frames`). At 32k on the 8B shape (H200
# host, 2026-11-29) a message read 25,140 runs, 3.2 us each from the page cache; 3,839 of them lay within 16 KiB of
# the file's run before (29 MB between them, 13% more than the frames' 226 MB) and 9,742 within 64 KiB (255 MB:
# twice the bytes, past what the first token may read). From the disk a random read costs ~16 us (~61k a second),
# what ~30 KB in sequence cost; from the page cache 16 KiB copy in ~2 us.
READ_ACROSS = 16 * 1024
_MOST_RUNS_A_READ = 512  # (IOV_MAX: 1,024 buffers a preadv, two a run)
_SUM_CHUNK = 1 << 16  # rows a checksum pass takes at once (int64 words: 8x the rows' bytes of bfloat16)


@dataclass(frozen=True)
class UnitFramesHeader:
    fingerprint: str
    dtype: torch.dtype
    layers: int  # G: the global layers held
    heads: int  # Hkv
    head_dim: int
    token_start: int
    token_end: int
    members: np.ndarray  # [frames] int64: each frame's member count (its rows: twice that)
    sums: np.ndarray  # [frames, 2] int64: each frame's checksums (`frame_sums`)
    first_row: np.ndarray  # [frames + 1] int64: where each frame's rows begin (the last: the rows in all)
    size: int  # bytes before the first row

    @property
    def frames(self) -> int:
        return len(self.members)

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.dtype.itemsize


def frame_sums(rows: torch.Tensor, frame: torch.Tensor, place: torch.Tensor, frames: int) -> torch.Tensor:
    """Each frame's two checksums: rows [R, B] uint8 (B even: whole 16-bit words), frame[r] row r's frame, place[r]
    its row within the frame -> [frames, 2] int64: over a frame's little-endian int16 words w_i (i the word's place
    in the frame), sum (i + 1) * w_i and sum (i + 1)^2 * w_i, modulo 2^64. A change to one word changes the first;
    changes to two words at places i != j cancel in both only if (i + 1) d_i = -(j + 1) d_j and (i + 1)^2 d_i =
    -(j + 1)^2 d_j modulo 2^64, which words of 16 bits at places below 2^23 cannot meet. Runs where the rows are (a
    lazy resume checks a layer's frames on the GPU in a few kernels)."""
    out = torch.zeros(frames, 2, dtype=torch.int64, device=rows.device)
    words = rows.shape[1] // 2
    # a row's plain and weighted sums in one product, exact in float64 (|sum| < 2^15 * words^3 << 2^53)
    d = torch.arange(1, words + 1, dtype=torch.float64, device=rows.device)
    weight = torch.stack([torch.ones_like(d), d, d * d], 1)  # [words, 3]
    for a in range(0, rows.shape[0], _SUM_CHUNK):
        plain, lin, sq = (rows[a : a + _SUM_CHUNK].view(torch.int16).to(torch.float64) @ weight).to(torch.int64).T
        offset = place[a : a + _SUM_CHUNK].to(torch.int64) * words  # the place of the row's first word
        # (offset + d)^2 = offset^2 + 2 offset d + d^2: int64 products wrap alike wherever they run
        per_row = torch.stack([offset * plain + lin, offset * offset * plain + 2 * offset * lin + sq], 1)
        out.index_add_(0, frame[a : a + _SUM_CHUNK].to(torch.int64), per_row)
    return out


def frame_rows(counts: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For frames of counts[f] members each (two rows a member: its K row, its V row), laid back to back: (each
    frame's first row [F], each row's frame [R], each row's place in its frame [R]). `total`: R where the caller
    knows it (on a GPU, working it out waits for the device)."""
    per = counts.to(torch.int64) * 2
    first = torch.cumsum(per, 0) - per
    total = int(per.sum()) if total is None else total
    frame = torch.repeat_interleave(torch.arange(len(per), device=per.device), per, output_size=total)
    return first, frame, torch.arange(total, device=per.device) - first[frame]


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
    flat_counts = counts.detach().cpu().reshape(-1).to(torch.int64)  # [F] frames in file order
    units = counts.shape[2]
    # each frame's rows: its members' K rows then their V rows, taken from rows[g, h] viewed [2n, D] (K: 0..n-1)
    _, frame, place = frame_rows(flat_counts)
    block = frame // units  # (g, h) of each row
    block_begin = torch.cumsum(flat_counts, 0) - flat_counts - (torch.arange(len(flat_counts)) // units) * n
    member = flat_counts[frame]
    is_v = place >= member
    source = block * 2 * n + is_v * n + block_begin[frame] + place - is_v * member
    flat = rows.detach().cpu().reshape(g * h * 2 * n, d)
    ordered = flat.index_select(0, source).contiguous().view(torch.uint8).view(len(source), -1)
    sums = frame_sums(ordered, frame, place, len(flat_counts))
    fixed = _FIXED.pack(MAGIC, VERSION, bytes.fromhex(fingerprint), DTYPES.index(rows.dtype), g, h, d,
                        tokens.start, tokens.stop, len(flat_counts))
    index = fixed + flat_counts.numpy().astype("<u4").tobytes() + sums.numpy().astype("<i8").tobytes()
    head = index + hashlib.sha256(index).digest()
    head += bytes(-len(head) % _ALIGN)
    payload = ordered.numpy().tobytes()
    name = place_content_addressed(Path(folder), (head, payload), "unit frames")
    return SegmentRef(file=name, byte_size=len(head) + len(payload), raw_size=len(payload),
                      checksum=hashlib.sha256(payload).hexdigest(), codec=CODEC)


def readable_into(segment: dict, dtype: torch.dtype) -> bool:
    """Whether a unit-rows segment row (storage.db) is a file this version reads, of a cache of `dtype`'s precision:
    version 1's zstd frames, or frames of another precision (a chat answered on a CPU in float32 and reopened on a GPU
    in bfloat16), are not (their rounds are read whole, and their frames written again)."""
    return segment.get("codec") == CODEC and segment.get("dtype") == str(dtype).removeprefix("torch.")


def readable_frames(segments: list[dict], dtype: torch.dtype) -> dict[int, dict]:
    """A chat's segment rows -> each round's unit-rows segment that a cache of `dtype` reads (`readable_into`)."""
    return {s["round_idx"]: s for s in segments if s["kind"] == SEGMENT_UNIT_ROWS and readable_into(s, dtype)}


class UnitFramesFile:
    """An open unit-frames file: its header read and checked once, frames read on demand (`gather_frames`)."""

    def __init__(self, path: Path, *, fingerprint: str):
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentMissing(f"unit frames {self.path.name} are missing.") from None
        except OSError as e:
            raise StorageError(f"cannot read unit frames {self.path.name}: {_reason(e)}.") from e
        if hasattr(os, "posix_fadvise"):
            # No read-ahead on this descriptor: a lazy resume reads a few KB here and there, in ascending order
            # within a layer, and the kernel took that for a sequential read, reading ahead up to the device's
            # read_ahead_kb (8 MB on both machines of 2026-11-29). At 32k on the 8B shape the disk gave the
            # process 1.95 GB before the first token for 0.36 GB of frames and units asked for (H200 host), 944 MB
            # for 241 MB in the probe (docs/probes/lazy_frames_cost.py --cold, 2-core CPU).
            try:
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:  # (advice only)
                pass
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
        if dtype_code >= len(DTYPES) or n_frames > _MOST_FRAMES or t0 > t1 or DTYPES[dtype_code].itemsize % 2:
            raise self._corrupt("its header is damaged")
        rest = self._pread(20 * n_frames + 32, _FIXED.size)
        index, digest = fixed + rest[:-32], rest[-32:]
        if hashlib.sha256(index).digest() != digest:
            raise self._corrupt("its index does not match its checksum")
        if fp.hex() != fingerprint.lower():
            raise SegmentWrongModel(f"unit frames {self.path.name} were computed by a different model.")
        members = np.frombuffer(rest, dtype="<u4", count=n_frames).astype(np.int64)
        sums = np.frombuffer(rest, dtype="<i8", count=2 * n_frames, offset=4 * n_frames).astype(np.int64)
        sums = sums.reshape(n_frames, 2)
        first_row = np.zeros(n_frames + 1, dtype=np.int64)
        np.cumsum(2 * members, out=first_row[1:])
        size = _FIXED.size + len(rest)
        size += -size % _ALIGN
        dtype = DTYPES[dtype_code]
        try:
            length = os.fstat(self._fd).st_size
        except OSError as e:
            raise StorageError(f"cannot read unit frames {self.path.name}: {_reason(e)}.") from e
        expected = size + int(first_row[-1]) * d * dtype.itemsize
        if length != expected:
            raise self._corrupt(f"the file is {'shorter' if length < expected else 'longer'} than its index says")
        return UnitFramesHeader(fp.hex(), dtype, g, h, d, t0, t1, members, sums, first_row, size)

    def frame_index(self, layer: int, head: int, unit: int, units: int) -> int:
        """The frame of unit `unit` of global layer `layer` (of the file's) and KV head `head`, a round whose units
        segment has `units` units per layer and KV head."""
        hd = self.header
        if hd.frames != hd.layers * hd.heads * units or not (0 <= layer < hd.layers and 0 <= head < hd.heads):
            raise self._corrupt(f"it holds {hd.frames} frames, not {hd.layers} x {hd.heads} x {units} units")
        return (layer * hd.heads + head) * units + unit

    def check_members(self, counts: np.ndarray) -> None:
        """That the file's frames have the member counts [frames] the round's units give them."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if counts.shape != self.header.members.shape or not np.array_equal(counts, self.header.members):
            raise self._corrupt("its frames do not hold the members the round's units name")

    def read(self, frames: list[int]) -> list[torch.Tensor]:
        """Frames (indices, ascending) as K/V rows [2, members, head size] on the CPU, each checked."""
        hd = self.header
        data, first, counts = gather_frames([self], [np.asarray(frames, dtype=np.int64)])
        _, frame, place = frame_rows(torch.from_numpy(counts))
        expected = torch.from_numpy(hd.sums[np.asarray(frames, dtype=np.int64)])
        bad = (frame_sums(data, frame, place, len(frames)) != expected).nonzero()
        if bad.numel():
            raise self._corrupt(f"frame {frames[int(bad[0, 0])]} does not match its checksum")
        return [data[a : a + 2 * n].view(hd.dtype).view(2, n, hd.head_dim)
                for a, n in zip(first.tolist(), counts.tolist())]


class FrameTable:
    """Open unit-frames files' indexes side by side, so that frames of any of them are looked up by a few numpy
    calls whatever their number of files (`gather_table_frames`): a lazy resume's layer reads frames of ~50 files,
    and a few numpy calls a file took ~0.35 ms a layer on the 2-core CPU, ~0.03 ms by one table (2026-11-29)."""

    def __init__(self, files: list[UnitFramesFile]):
        self.files = list(files)
        if len({f.header.row_bytes for f in self.files}) > 1:
            raise ValueError("unit frames of different row sizes cannot be gathered together")
        n = np.asarray([f.header.frames for f in self.files], dtype=np.int64)
        self.frames = n  # [files] each file's frames
        self.row_base = np.cumsum(n + 1) - (n + 1)  # [files] where a file's first rows begin in `first_row`
        self.sum_base = np.cumsum(n) - n  # [files] where its checksums begin in `sums`
        self.first_row = np.concatenate([f.header.first_row for f in self.files]) if self.files else \
            np.zeros(0, np.int64)
        self.sums = np.concatenate([f.header.sums for f in self.files]) if self.files else np.zeros((0, 2), np.int64)
        self.sizes = np.asarray([f.header.size for f in self.files], dtype=np.int64)  # [files] bytes before rows

    def place(self, which: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """Frames [F] of files `which` [F] (indices into `files`; ascending by file, then frame) -> where each
        frame's first row is in `first_row` [F]; ValueError where a frame is not in its file or out of order."""
        if frames.size and (frames.min() < 0 or bool((frames >= self.frames[which]).any())):
            raise ValueError("frames past their files' ends")
        at = self.row_base[which] + frames
        if at.size > 1 and bool((at[1:] <= at[:-1]).any()):
            raise ValueError("frames not in ascending order of file and frame")
        return at

    def expected_sums(self, which: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """The checksums [F, 2] the files' indexes give frames [F] of files `which` [F]."""
        return self.sums[self.sum_base[which] + frames]


def gather_frames(files: list[UnitFramesFile], frames: list[np.ndarray], pool: Executor | None = None,
                  jobs: int = 1, pin: bool = False, detail: dict[str, float] | None = None,
                  across: int | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Frames of several files read together into one host buffer: files[i]'s frames `frames[i]` (ascending
    indices), back to back, file after file (`gather_table_frames` over the files' own table)."""
    if len(files) != len(frames):
        raise ValueError("one frame list per file")
    frames = [np.asarray(f, dtype=np.int64).reshape(-1) for f in frames]  # (checked by the table's `place`)
    which = np.repeat(np.arange(len(files), dtype=np.int64), [f.size for f in frames])
    flat = np.concatenate(frames) if frames else np.zeros(0, np.int64)
    return gather_table_frames(FrameTable(files), which, flat, pool, jobs, pin, detail, across)


def gather_table_frames(table: FrameTable, which: np.ndarray, frames: np.ndarray, pool: Executor | None = None,
                        jobs: int = 1, pin: bool = False, detail: dict[str, float] | None = None,
                        across: int | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Frames [F] of the table's files `which` [F] (ascending by file, then frame) read together into one host
    buffer, back to back. Returns (their rows [R, row bytes] uint8, pinned with `pin`; each frame's first row in it
    [F]; each frame's member count [F], as the files' indexes give them). The rows are not checked here:
    `frame_sums` against the table's `expected_sums` checks them where they land.

    A layer of a lazy resume reads ~1,000 frames of ~50 files, a pread a run of consecutive frames. From the page
    cache one thread reads them fastest: more threads only hand the GIL around (32 took ~10 us a frame on the H200
    host where one took ~5, 2026-11-28), and gathering from memory mappings instead pays a page fault a page touched
    (on the 2-core CPU 4.9-8.1 ms a layer against 3.1-3.8 by preads, docs/probes/lazy_frames_cost.py --ways,
    2026-11-29). From the disk they must be waited for side by side. So each read is first tried on this thread
    without waiting (`RWF_NOWAIT`: the kernel answers only from the page cache, a short read where it holds only the
    start); once one read of a file is refused, the rest of that file's are not tried: a refused read has the
    kernel start it there and then, ~18 us on this thread (on the H200 host 21,303 refused reads took 385 ms of a
    cold first token, 2026-11-29), where the reader threads start and wait for them side by side. The refused and
    untried reads go to `jobs` threads on `pool` (a pread releases the GIL). `detail`, where given, adds up the
    plan's and the two passes' seconds, the runs, the reads and the reads left to the threads, and how far apart
    the runs lie.

    Runs of one file at most `across` bytes apart (default READ_ACROSS) are read by one preadv, the bytes between
    them into a scratch buffer: fewer reads, each costing more than a few KB of copying or of the disk's sequential
    rate. The bytes between count as read (`bytes_read`): they are, from the disk. (Where the page cache holds a
    read's frames but not the pages between them, as after a resume that chose other frames, the read is refused
    and those pages come from the disk.)"""
    began = time.perf_counter()
    files = table.files
    which, frames = np.asarray(which, dtype=np.int64), np.asarray(frames, dtype=np.int64)
    row_size = files[0].header.row_bytes if files else 0
    place = table.place(which, frames)
    at = table.first_row[place]  # [F] each frame's first row in its file
    rows = table.first_row[place + 1] - at  # [F] its rows (twice its members)
    counts = rows // 2
    first = np.cumsum(rows) - rows  # each frame's first row in the buffer
    total = int(rows.sum())
    out = torch.empty(total, row_size, dtype=torch.uint8, pin_memory=pin and total > 0)
    if not total:  # (no frames, or frames of no members only: no rows to read)
        return out, first, counts
    # runs of consecutive frames of one file: one read each
    breaks = np.ones(len(at), dtype=bool)
    breaks[1:] = (which[1:] != which[:-1]) | (at[1:] != at[:-1] + rows[:-1])
    run_first = np.flatnonzero(breaks)
    run_last = np.append(run_first[1:], len(at)) - 1
    run_file = which[run_first]
    run_start = table.sizes[run_file] + at[run_first] * row_size  # [runs] bytes into the file
    run_length = (at[run_last] + rows[run_last] - at[run_first]) * row_size
    run_gap = np.zeros(len(run_first), dtype=np.int64)  # [runs] bytes since the file's run before (0: a read's first)
    run_gap[1:] = run_start[1:] - run_start[:-1] - run_length[:-1]
    joins = np.zeros(len(run_first), dtype=bool)  # [runs] read with the run before, across the gap
    joins[1:] = (run_file[1:] == run_file[:-1]) & (run_gap[1:] <= (READ_ACROSS if across is None else across))
    joins[:: _MOST_RUNS_A_READ] = False  # (a preadv takes at most IOV_MAX buffers: two a run)
    run_gap[~joins] = 0
    per_file = np.bincount(which, weights=rows, minlength=len(files)) * row_size  # bytes read of each file
    per_file += np.bincount(run_file, weights=run_gap, minlength=len(files))
    for file, n in zip(files, per_file.tolist()):
        file.bytes_read += int(n)
    read_first = np.flatnonzero(~joins)  # each read's first run
    read_end = np.append(read_first[1:], len(run_first))
    scratch = memoryview(bytearray(int(run_gap.max()))) if joins.any() else None  # where the gaps' bytes go
    view = memoryview(out.numpy()).cast("B")
    fds = [file._fd for file in files]
    dests = (first[run_first] * row_size).tolist()
    lengths, gaps = run_length.tolist(), run_gap.tolist()
    t0 = time.perf_counter()
    nowait = getattr(os, "RWF_NOWAIT", 0)
    waiting = []  # (file, at, length, buffers): the reads the page cache could not answer at once
    refused = set()  # files with a read refused: the rest of theirs go to the reader threads untried
    for a, b, k, start in zip(read_first.tolist(), read_end.tolist(), run_file[read_first].tolist(),
                              run_start[read_first].tolist()):
        buffers = [view[dests[a] : dests[a] + lengths[a]]]  # (most reads: one run)
        length = lengths[a]
        for r in range(a + 1, b):
            buffers += [scratch[: gaps[r]], view[dests[r] : dests[r] + lengths[r]]]
            length += gaps[r] + lengths[r]
        if nowait and k not in refused:
            try:
                if os.preadv(fds[k], buffers, start, nowait) == length:
                    continue
                refused.add(k)
            except BlockingIOError:
                refused.add(k)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise StorageError(f"cannot read unit frames {files[k].path.name}: {_reason(e)}.") from e
                nowait = 0  # (a kernel or file system without it: every read waits)
        waiting.append((k, start, length, buffers))  # (a short read too: the rest was not cached, or the file is
    t1 = time.perf_counter()
    if pool is None or jobs <= 1 or len(waiting) <= 1:
        _preads(files, waiting)
    else:
        share = -(-len(waiting) // min(jobs, len(waiting)))
        tasks = [pool.submit(_preads, files, waiting[a : a + share]) for a in range(0, len(waiting), share)]
        wait(tasks)  # every share done before any error is raised: no read outlives the call (or its descriptors)
        for task in tasks:
            task.result()
    if detail is not None:  # where the reads' time went (the bench keeps it for the warm and the cold run)
        parts = [("plan_s", t0 - began), ("nowait_s", t1 - t0), ("wait_s", time.perf_counter() - t1),
                 ("runs", len(run_first)), ("reads", len(read_first)),
                 ("refused_reads", len(waiting))]
        # how far apart a file's runs lie: what reading across the gaps (fewer, longer reads) would cost in bytes
        apart = (run_start[1:] - run_start[:-1] - run_length[:-1])[run_file[1:] == run_file[:-1]]
        for limit in (4096, 16384, 65536):
            near = apart[apart <= limit]
            parts += [(f"gaps_within_{limit // 1024}k", near.size),
                      (f"gap_bytes_within_{limit // 1024}k", int(near.sum()))]
        for key, value in parts:
            detail[key] = detail.get(key, 0) + value
    return out, first, counts


def _preads(files: list[UnitFramesFile], reads) -> None:
    for k, start, length, buffers in reads:
        file = files[k]
        try:
            got = os.preadv(file._fd, buffers, start)
        except OSError as e:
            raise StorageError(f"cannot read unit frames {file.path.name}: {_reason(e)}.") from e
        if got != length:
            raise file._corrupt("the file is shorter than its index says")


def verify_unit_frames(path: Path) -> None:
    """The whole file against its content-addressed name (what a partial read cannot check)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SegmentMissing(f"unit frames {path.name} are missing.") from None
    if _whole_file_hash(data) + SUFFIX != path.name:
        raise SegmentCorrupt(f"unit frames {path.name} are corrupt: their content does not match their name.")
