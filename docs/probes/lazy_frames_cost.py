"""What a lazy resume's unit-frame reads cost on the host (app/session/lazy.py, issue 44), without a model: a
synthetic chat of the 8B shape's sizes (51 rounds of 646 tokens, 32 global layers, 8 KV heads, head size 128,
bfloat16, ~41 units per round, layer and KV head) written as unit frames (storage.unit_frames), then each layer's
choice brought in as `StoredRows.ensure` brings it in while a message runs: per KV head the units of ~1,024 slots,
the last 256 slots (the buffer) and the first 4 (the sinks). The cache is a host tensor, so the planes are merged
and the rows written on the CPU (on a GPU both happen on the device). The frames are in the page cache (just
written): warm reads.

    python docs/probes/lazy_frames_cost.py [--rounds 51] [--dir /tmp/lazy-frames] [--profile] [--ways] [--cold]

Prints the layout's time (the open), the 32 layers' reads (frames, MB, per layer and per frame) and, with
--profile, where the reads' time went; with --ways, three ways of reading the same layers' frames from the page
cache, each file opened afresh: gathered from memory mappings on one thread (a page fault a page touched), the same
with every file's mapping populated ahead on 16 threads (`MADV_POPULATE_READ`, Linux 5.14+; its time included), and a
pread a run of frames on one thread (storage.unit_frames.gather_frames; the reads the page cache refuses, on 32
threads). With --cold the preads run again with the files pushed out of the page cache before each (the mapped ways
are left out: a mapping faults each cold page in on its one thread).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from kvchat.app.session.lazy import StoredRows
from kvchat.storage.db import SEGMENT_UNIT_ROWS, RoundRow
from kvchat.storage.unit_frames import write_unit_frames

G, H, N, U, D = 32, 8, 646, 41, 128  # layers, KV heads, tokens a round, units a round (layer, head), head size
FINGERPRINT = "ab" * 32


class HostCache:
    """The part of a KVCache a lazy resume writes: [layers, 2, Hkv, slots, D]."""

    def __init__(self, slots: int):
        self.kv = torch.zeros(G, 2, H, slots, D, dtype=torch.bfloat16)

    def write_rows(self, layer: int, heads, slots, kv) -> None:
        self.kv[layer][:, heads, slots] = kv


class FolderStore:
    def __init__(self, folder: Path):
        self.kv_dir = folder


class Notes:
    notes: list[str] = []


def write_chat(folder: Path, rounds: int) -> tuple[list[dict], dict[int, torch.Tensor]]:
    """Each round's unit frames (random K/V, random members, every unit with some) and members."""
    torch.manual_seed(0)
    segments, members = [], {}
    for r in range(rounds):
        member = torch.randint(0, U, (G, H, N))
        member[..., :U] = torch.arange(U)
        kv = (torch.randn(G, H, 2, N, D) * 0.5).to(torch.bfloat16)
        order = member.argsort(dim=2, stable=True)
        rows = kv.gather(3, order[:, :, None, :, None].expand(-1, -1, 2, -1, D))
        counts = torch.zeros(G, H, U, dtype=torch.long).scatter_add_(2, member, torch.ones_like(member))
        ref = write_unit_frames(folder, rows, counts, fingerprint=FINGERPRINT, tokens=range(r * N, (r + 1) * N))
        segments.append({"kind": SEGMENT_UNIT_ROWS, "round_idx": r, "file": ref.file, "byte_size": ref.byte_size,
                         "codec": ref.codec, "dtype": "bfloat16"})
        members[r] = member
    return segments, members


def choices(members: dict[int, torch.Tensor], rounds: int) -> list[torch.Tensor]:
    """Per layer [Hkv, n]: each KV head's slots of 64 random (round, unit) pairs, the buffer and the sinks."""
    chat = torch.cat([members[r] for r in range(rounds)], 2)
    total, g = rounds * N, torch.Generator().manual_seed(1)
    out = []
    for layer in range(G):
        heads = []
        for h in range(H):
            mask = torch.zeros(total, dtype=torch.bool)
            for pair in torch.randperm(rounds * U, generator=g)[:64].tolist():
                r, u = divmod(pair, U)
                mask[r * N : (r + 1) * N] |= chat[layer, h, r * N : (r + 1) * N] == u
            mask[:4] = mask[-256:] = True
            heads.append(mask.nonzero()[:, 0])
        n = min(len(s) for s in heads)
        out.append(torch.stack([s[:n] for s in heads]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=51)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lazy-frames"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ways", action="store_true")
    parser.add_argument("--cold", action="store_true", help="the ways again, the files out of the page cache first")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    segments, members = write_chat(args.dir, args.rounds)
    print(f"wrote {args.rounds} rounds of unit frames, {sum(s['byte_size'] for s in segments) / 1e6:,.0f} MB, in "
          f"{time.perf_counter() - t0:.1f} s")
    rounds = [RoundRow(r, "u", "a", r * N, (r + 1) * N, "") for r in range(args.rounds)]
    picked = choices(members, args.rounds)
    cache = HostCache(args.rounds * N)
    t0 = time.perf_counter()
    rows = StoredRows(FolderStore(args.dir), segments, FINGERPRINT, rounds, cache, Notes(),
                      restore_whole=lambda: None, members=members, global_layers=list(range(G)))
    print(f"the open's layout of the units: {1000 * (time.perf_counter() - t0):.0f} ms")
    profile = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for layer in range(G):
        rows.ensure(layer, picked[layer])
    if profile:
        profile.disable()
    took = time.perf_counter() - t0
    print(f"{G} layers: {1000 * took:.0f} ms, {rows.frames_read:,} frames, {rows.bytes_read / 1e6:.1f} MB; "
          f"{1000 * took / G:.1f} ms a layer, {1e6 * took / max(rows.frames_read, 1):.0f} us a frame")
    print("  of it: " + ", ".join(f"{phase} {1000 * s:.0f} ms" for phase, s in rows.phase_s.items()) + "; io: " +
          ", ".join(f"{k} {1000 * v:.0f} ms" if k.endswith("_s") else f"{k} {v:,}" for k, v in rows.io_detail.items()
                    if not k.startswith("gap")))
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    if args.ways:
        compare_ways(args.dir, segments, members, rounds, picked)
    if args.cold:
        print("cold (each way's files pushed out of the page cache first):")
        compare_ways(args.dir, segments, members, rounds, picked, cold=True)


def compare_ways(folder: Path, segments: list[dict], members: dict[int, torch.Tensor], rounds: list[RoundRow],
                 picked: list[torch.Tensor], repeats: int = 3, cold: bool = False) -> None:
    """Each layer's frames (as `StoredRows.ensure` finds them) read three ways from the page cache, mapped afresh."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvchat.storage.unit_frames import UnitFramesFile, gather_frames

    rows = StoredRows(FolderStore(folder), segments, FINGERPRINT, rounds, HostCache(len(rounds) * N), Notes(),
                      restore_whole=lambda: None, members=members, global_layers=list(range(G)))
    layers = []  # per layer: each round's frames (ascending)
    for layer in range(G):
        wanted = picked[layer].long()
        units = rows._chat_member[layer].gather(1, wanted)
        round_of = wanted // N
        keys = ((round_of * H + torch.arange(H)[:, None]) * rows._most_units + units).unique().numpy()
        r, h, u = keys // (H * rows._most_units), keys // rows._most_units % H, keys % rows._most_units
        frames = (layer * H + h) * U + u
        layers.append([frames[r == i] for i in range(len(rounds))])
    pool = ThreadPoolExecutor(16)

    def index_of(hd, f):
        at, n = hd.first_row[f], hd.first_row[f + 1] - hd.first_row[f]
        return np.repeat(at - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))

    def mapping(file):
        m = mmap.mmap(file._fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        hd = file.header
        data = np.frombuffer(m, dtype=np.uint8, offset=hd.size, count=int(hd.first_row[-1]) * hd.row_bytes)
        return m, torch.from_numpy(data).view(-1, hd.row_bytes)

    def mapped(files, per_round, threads: int) -> None:
        def gather(ks):
            for k in ks:
                if k not in maps:  # each file mapped once a way's run (private: torch takes it without a copy)
                    maps[k] = mapping(files[k])
                torch.index_select(maps[k][1], 0, torch.from_numpy(index_of(files[k].header, per_round[k])))
        ks = list(range(len(files)))
        share = -(-len(ks) // threads)
        list(pool.map(gather, [ks[a : a + share] for a in range(0, len(ks), share)])) if threads > 1 else gather(ks)

    def populated(files, per_round, threads: int) -> None:  # every file mapped and populated ahead, on 16 threads
        if not maps:
            def populate(k):
                maps[k] = mapping(files[k])
                address = maps[k][1].data_ptr()
                length = maps[k][1].numel()
                start = address - address % mmap.PAGESIZE
                if libc.madvise(ctypes.c_void_p(start), length + address - start, 22):  # MADV_POPULATE_READ
                    raise OSError(ctypes.get_errno(), "madvise")
            t = time.perf_counter()
            list(pool.map(populate, range(len(files))))
            populate_s.append(time.perf_counter() - t)
        for k in range(len(files)):
            torch.index_select(maps[k][1], 0, torch.from_numpy(index_of(files[k].header, per_round[k])))

    def preads(files, per_round, threads: int) -> None:  # gather_frames without a ring: preads (refused: threads)
        gather_frames(files, per_round, pool, 32)

    import ctypes

    from kvchat.storage.pagecache import disk_bytes_read, evict

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    populate_s: list[float] = []
    ways = [("a pread a run of frames, one thread (the refused: 32 threads)", preads, 1)]
    if not cold:  # (a mapping faults a cold page in on the one thread: not a way for the disk)
        ways = [("mapped, one thread", mapped, 1), ("mapped and populated ahead on 16 threads (MADV_POPULATE_READ), "
                                                    "then one thread", populated, 1)] + ways
    for name, way, threads in ways * repeats:
        if cold:
            evict([folder / s["file"] for s in segments])
        files = [UnitFramesFile(folder / s["file"], fingerprint=FINGERPRINT) for s in segments]
        maps: dict[int, tuple] = {}
        populate_s.clear()
        disk = disk_bytes_read()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for per_round in layers:
                way(files, per_round, threads)
        took = time.perf_counter() - t0
        disk = None if disk is None else disk_bytes_read() - disk
        asked = sum(file.bytes_read for file in files)
        for m, _ in maps.values():
            try:
                m.close()
            except BufferError:  # (a tensor still views it: closed when it goes)
                pass
        for file in files:
            file.close()
        ahead = f", of it {1000 * populate_s[0]:.0f} ms populating" if populate_s else ""
        print(f"{name}: {1000 * took / G:.1f} ms a layer, {1000 * took:.0f} ms in all{ahead} "
              f"({sum(len(f) for f in layers[0]):,} frames in layer 0; {asked / 1e6:.1f} MB asked for, headers "
              f"included, {'?' if disk is None else f'{disk / 1e6:.1f}'} MB from the disk)")


if __name__ == "__main__":
    main()
