"""A chat's retrieval units stored with it (LouisKV, issue 44): each round's units (engine.kv.units.round_units: its
message's keys in k-means clusters, its reply's in segments cut where the retrieval trigger fired while it was
written) as a segment of kind "units" beside its K/V (storage.db.SEGMENT_UNITS), so that no later open clusters a
round again.

- Saving: a round answered under a policy that stores units (`louiskv`) has them built from the cache right after
  its K/V is handed to the writer, and written the same way (the background writer, content-addressed files).
- Opening: the rounds' files are read, checked and decompressed on several threads (hashing and zstd release
  the GIL) from the restore's start, beside its K/V (`read_ahead`), and handed to the cache (KVCache.units) once
  its K/V is in, where the policy finds them. One at a time after the K/V they added ~1.2 s to a 32k chat's
  restore on the 8B shape, whose units were ~1/8 of its raw K/V in float32 then (docs/benchmarks.md, "LouisKV").
  A round without units (saved before, or under another policy) or whose units cannot be read (a damaged or
  missing file, another model's) gets them built from its K/V — clustered whole: no trigger was watched for its
  reply — and stored, with one restore note saying how many and why.

A segment holds the units of one round in one uint8 tensor [G, 2, Hkv, rows, D] (G global layers), per layer and KV
head: plane 0 rows [0, U) the centroids' e4m3 bits (engine.kv.units.centroids_in_8_bits; U the highest unit its
members name + 1); plane 1, flattened, each of the n tokens' unit as a little-endian int16 (2n bytes: a round has
fewer than 2^15 units per layer and KV head at any context kvchat runs), then each centroid's bfloat16 scale (2U
bytes), then zeros. Since 2026-11-29: half the bytes of the bfloat16 format before, which a lazy resume reads before
its first token. Chats saved before hold bfloat16 segments (plane 0 the centroids, plane 1 the int16 members' bits)
or, before 2026-11-28, float32 ones (members exact in float32 up to 2^24); both are read as they are.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.app.session.writer import KVWriter
from kvchat.engine.kv.units import Units, centroids_in_8_bits, centroids_of_8_bits
from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_UNIT_ROWS, SEGMENT_UNITS, RoundRow, Store
from kvchat.storage.segments import read_segment
from kvchat.storage.unit_frames import readable_frames, write_unit_frames


# A member's unit must fit an int16 to be stored in the bfloat16 plane's bits.
MOST_UNITS = 1 << 15


def pack_units(units: Units) -> Tensor:
    """Units (one centroid per unit) as a units segment's tensor [G, 2, Hkv, rows, D] uint8 on the CPU (the module's
    docstring). Centroids made by engine.kv.units come back from it bit for bit (they are made in its precision)."""
    g, h, u, s, d = units.summary.shape
    if s != 1:
        raise ValueError("only units summarized by one centroid are stored")
    if u > MOST_UNITS:
        raise ValueError(f"a round of {u} units per layer and KV head is more than a units segment holds")
    if d < 4 or d % 2:
        raise ValueError(f"a head size of {d} cannot hold a units segment's members (an even size of 4 or more can)")
    member = units.member.cpu().to(torch.int16)  # [G, Hkv, n]
    n = member.shape[2]
    named = int(member.max()) + 1 if n else 1  # the units the members name: the rest are never read
    if named > u:
        raise ValueError(f"members name unit {named - 1} of {u}")
    bits, scale = centroids_in_8_bits(units.summary[:, :, :named, 0].cpu())  # [G, Hkv, U, D], [G, Hkv, U]
    rows = max(named, math.ceil((2 * n + 2 * named) / d), 1)
    packed = torch.zeros(g, 2, h, rows, d, dtype=torch.uint8)
    packed[:, 0, :, :named] = bits
    tail = torch.zeros(g, h, rows * d, dtype=torch.uint8)
    tail[:, :, : 2 * n] = member.contiguous().view(torch.uint8)
    tail[:, :, 2 * n : 2 * n + 2 * named] = scale.contiguous().view(torch.uint8)
    packed[:, 1] = tail.view(g, h, rows, d)
    return packed


@dataclass(frozen=True)
class StoredUnits:
    """A round's units as its segment holds them, on the host: the members as int16 (float32 segments: int64) and
    the centroids in their stored precision (8-bit segments: the e4m3 bits and their scales). `on` makes them Units
    on a device, converting there: the copy moves the stored bytes, not float32 centroids and int64 members (the
    lazy open copies a 32k chat's units before its first token)."""

    start: int
    end: int
    member: Tensor  # [G, Hkv, n]
    centroid: Tensor  # [G, Hkv, U, D]
    scale: Tensor | None = None  # [G, Hkv, U] bfloat16: the 8-bit centroids' scales

    def on(self, device: torch.device | str) -> Units:
        centroid = self.centroid.to(device)
        centroid = (centroids_of_8_bits(centroid, self.scale.to(device)) if self.scale is not None
                    else centroid.to(torch.float32))
        return Units(self.start, self.end, self.member.to(device).long(), centroid[:, :, :, None])


def _tokens_held(rows: int, d: int, dtype: torch.dtype) -> int:
    """The most tokens whose units a units segment of `rows` rows of `d` holds: a member is 2 bytes of a uint8 plane,
    one value of an older format's."""
    return rows * d // (2 if dtype == torch.uint8 else 1)


def _member_plane(packed: Tensor, n: int) -> Tensor:
    """The members of a round of n slots as a units segment's tensor holds them [G, Hkv, n] (the int16s of plane 1's
    bytes or of its bfloat16 bits; float32 segments, before 2026-11-28: the floats), on its device, not yet
    checked."""
    g, _, h, rows, d = packed.shape
    plane = packed[:, 1].reshape(g, h, rows * d)
    if packed.dtype == torch.uint8:
        return plane[:, :, : 2 * n].view(torch.int16)
    plane = plane[:, :, :n]
    return plane.view(torch.int16) if packed.dtype == torch.bfloat16 else plane.long()


def _holds(packed: Tensor, n: int, named: int) -> bool:
    """Whether a units segment's tensor of a round of n slots holds `named` units' centroids (and their scales)."""
    _, _, _, rows, d = packed.shape
    return named <= rows and (packed.dtype != torch.uint8 or 2 * n + 2 * named <= rows * d)


def _centroids(packed: Tensor, n: int, named: int) -> tuple[Tensor, Tensor | None]:
    """The first `named` centroids of a units segment's tensor of a round of n slots, as stored ([G, Hkv, U, D]),
    and their scales [G, Hkv, U] in an 8-bit segment (else None), as views of it."""
    g, _, h, rows, d = packed.shape
    stored = packed[:, 0, :, :named]
    if packed.dtype != torch.uint8:
        return stored, None
    return stored, packed[:, 1].reshape(g, h, rows * d)[:, :, 2 * n : 2 * n + 2 * named].view(torch.bfloat16)


def units_of_packed(packed: list[Tensor], spans: list[tuple[int, int]]) -> list[Units | None]:
    """Rounds' units segments' tensors (`pack_units`' layout or an older one, on any device) unpacked where they are,
    with one wait for the device for all of them (each round's member range); None for a round whose members name
    units its segment does not hold. What `stored_units` then `StoredUnits.on` give, without the host's work."""
    members = [_member_plane(p, end - start) for p, (start, end) in zip(packed, spans)]
    ranges = [torch.stack([m.max(), m.min()]).long() if m.numel() else m.new_zeros(2, dtype=torch.long)
              for m in members]
    ranges = torch.stack(ranges).cpu().tolist() if ranges else []  # (the one wait)
    out: list[Units | None] = []
    for p, member, (start, end), (high, low) in zip(packed, members, spans, ranges):
        named = int(high) + 1 if member.numel() else 1
        if low < 0 or not _holds(p, end - start, named):
            out.append(None)
            continue
        centroid, scale = _centroids(p, end - start, named)
        # (a copy either way: not a view holding the whole segment)
        centroid = centroids_of_8_bits(centroid, scale) if scale is not None else centroid.to(torch.float32)
        out.append(Units(start, end, member.long(), centroid[:, :, :, None].contiguous()))
    return out


def stored_units(packed: Tensor, start: int, end: int) -> StoredUnits:
    """`pack_units`' inverse (or an older format's) for a round of slots [start, end), still on the host
    (`StoredUnits.on`)."""
    g, _, h, rows, d = packed.shape
    n = end - start
    if n > _tokens_held(rows, d, packed.dtype):
        raise ValueError(f"a units segment of {rows} rows cannot hold {n} tokens' units")
    member = _member_plane(packed, n).contiguous()
    named = int(member.max()) + 1 if n else 1
    if bool((member < 0).any()) or not _holds(packed, n, named):
        raise ValueError("a units segment names units it does not hold")
    centroid, scale = _centroids(packed, n, named)
    return StoredUnits(start, end, member, centroid.contiguous(), None if scale is None else scale.contiguous())


def unpack_units(packed: Tensor, start: int, end: int, device: torch.device | str = "cpu") -> Units:
    """`pack_units`' inverse for a round of slots [start, end)."""
    return stored_units(packed, start, end).on(device)


def stores_units(policy) -> bool:
    """Whether a chat policy keeps its rounds' units with the chat (`louiskv`)."""
    return callable(getattr(policy, "round_units", None))


# Threads reading a chat's units files (each file is read, hashed and decompressed by one; hashing, zstd and numpy's
# copies release the GIL, so up to one a core pays: a lazy open waits on a 32k chat's 51 files).
READ_THREADS = min(16, os.cpu_count() or 1)


def unit_rows(cache, layers: list[int], units: Units) -> tuple[Tensor, Tensor]:
    """A round's K/V in its units' order, for storage.unit_frames: (rows [G, Hkv, 2, n, D], each global layer's and KV
    head's slots sorted by unit then by slot; counts [G, Hkv, U], each unit's members), on the cache's device. U is
    what the stored members name (the highest unit + 1), so that a reader of the units segment counts the same."""
    member = units.member  # [G, Hkv, n]
    g, h, n = member.shape
    u = int(member.max()) + 1 if n else 1
    order = member.argsort(dim=2, stable=True)  # [G, Hkv, n]
    rows = torch.stack([cache.span(layer, units.start, units.end).gather(
        2, order[j][None, :, :, None].expand(2, -1, -1, cache.kv.shape[-1])).transpose(0, 1)
        for j, layer in enumerate(layers)])  # [G, Hkv, 2, n, D]
    counts = torch.zeros(g, h, u, dtype=torch.long, device=member.device).scatter_add_(
        2, member, torch.ones_like(member))
    return rows, counts


@dataclass
class ReadAhead:
    """Units files being read ahead of a restore's end (`ChatUnits.read_ahead`): (round, its span) -> the read."""

    futures: dict[tuple[int, int, int], Future]


class ChatUnits:
    """One chat's units in the store (see the module docstring); `policy`: the chat's message policy."""

    def __init__(self, store: Store, writer: KVWriter, sid: str, fingerprint: str, model, policy,
                 unit_rows: bool = False):
        """`unit_rows`: each round's K/V stored a second time in its units' order too (storage.unit_frames), what a
        lazy resume reads before its first token (app/session/lazy.py)."""
        self.store, self.writer, self.sid, self.fingerprint = store, writer, sid, fingerprint
        self.model, self.policy, self.unit_rows = model, policy, unit_rows
        self.layers = model.cfg.global_layers
        self.load_stored_s: dict[str, float] = {}  # the last `load_stored`'s parts (s)

    def save(self, cache, row: RoundRow, reply_at: int) -> None:
        """Build the units of a round just answered (its reply's cuts are the policy's latest) and store them."""
        with torch.inference_mode():
            units = self.policy.round_units(cache, self.layers, row.token_start, reply_at, row.token_end)
        cache.units[(row.token_start, row.token_end)] = units
        self._submit(row, units)
        if self.unit_rows:
            self._submit_rows(cache, row, units)

    def read_ahead(self, rounds: list[RoundRow]) -> ReadAhead:
        """Start reading the rounds' units files on reader threads, to be handed to `load` once the chat's K/V is in
        the cache: a restore reads them while it reads (or recomputes) the K/V, not after it."""
        rows = {s["round_idx"]: s for s in self.store.segments(self.sid) if s["kind"] == SEGMENT_UNITS}
        pool = ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(rounds))))
        futures = {(row.idx, row.token_start, row.token_end): pool.submit(self._read, rows.get(row.idx), row)
                   for row in rounds if row.idx in rows}
        pool.shutdown(wait=False)  # the threads finish what was submitted, then end
        return ReadAhead(futures)

    def load(self, cache, rounds: list[RoundRow], ahead: ReadAhead | None = None) -> list[str]:
        """Hand the cache every closed round's units, read from the store (or taken from `ahead`, where it read the
        same round) or built from its K/V (then stored); the restore notes this adds."""
        segments = self.store.segments(self.sid)
        rows = {s["round_idx"]: s for s in segments if s["kind"] == SEGMENT_UNITS}
        built, damaged = [], []
        device = cache.kv.device
        todo = [row for row in rounds if (row.token_start, row.token_end) not in cache.units
                and row.token_start < row.token_end <= cache.length]
        early = ahead.futures if ahead is not None else {}
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(todo)))) as pool:
            pending = [early.get((row.idx, row.token_start, row.token_end)) or pool.submit(self._read, rows.get(
                row.idx), row) for row in todo]  # a round the restore re-tokenized is read again, as it is now
            read = [f.result() for f in pending]
        for row, (units, problem) in zip(todo, read):
            if units is not None:
                units = units.on(device)
            else:
                if problem:
                    damaged.append(problem)
                with torch.inference_mode():
                    units = self.policy.round_units(cache, self.layers, row.token_start, row.token_end,
                                                    row.token_end)
                self._submit(row, units)
                built.append(row.idx)
            cache.units[(row.token_start, row.token_end)] = units
        if self.unit_rows:  # a chat stored before, or without them: its rounds' unit rows from the K/V just restored
            held = set(readable_frames(segments, cache.kv.dtype))  # (frames a lazy resume cannot read: written again)
            for row in rounds:
                units = cache.units.get((row.token_start, row.token_end))
                if row.idx not in held and units is not None and row.token_end <= cache.length:
                    self._submit_rows(cache, row, units)
        notes = []
        if built:
            why = f" ({'; '.join(damaged[:3])})" if damaged else " (stored without them)"
            notes.append(f"retrieval units built for {len(built)} of {len(rounds)} rounds from their K/V{why}; "
                         f"stored with the chat")
        return notes

    def load_stored(self, cache, rounds: list[RoundRow]) -> list[int]:
        """Hand the cache the units stored for the rounds, building none (a lazily opened chat has no K/V to build
        them from yet); the rounds whose units could not be read, none handed over then.

        On a GPU this is the lazy open's whole cost (~140 ms of a 32k chat's ~100 MB of units at the 8B shape on
        the H200 host, read and unpacked on the host, 2026-11-29): so the reader threads only read, check and
        decompress, their bytes go to the device (through the pinned staging buffers), and the planes are merged
        and the units unpacked there, with one wait for the device for every round's member range."""
        t0 = time.perf_counter()
        rows = {s["round_idx"]: s for s in self.store.segments(self.sid) if s["kind"] == SEGMENT_UNITS}
        device = cache.kv.device
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(rounds)))) as pool:
            read = list(pool.map(lambda row: self._read(rows.get(row.idx), row, device), rounds))
        t1 = time.perf_counter()
        missing = [row.idx for row, (units, _) in zip(rounds, read) if units is None]
        if missing:
            return missing
        units = units_of_packed([p for p, _ in read], [(row.token_start, row.token_end) for row in rounds])
        # where the open's time went: the files read, checked, decompressed and sent; the units unpacked there
        self.load_stored_s = {"read": t1 - t0, "unpack": time.perf_counter() - t1}
        bad = [row.idx for row, u in zip(rounds, units) if u is None]
        if bad:
            return bad
        for row, u in zip(rounds, units):
            cache.units[(row.token_start, row.token_end)] = u
        return []

    def _read(self, seg: dict | None, row: RoundRow, device: torch.device | None = None
              ) -> tuple[StoredUnits | Tensor | None, str]:
        """A round's units on the CPU, read from its segment (on a reader thread), or None and why not ('' where
        it has none); with a `device`, the segment's tensor there as stored (`pack_units`' layout; on a GPU its
        planes merged there), for `units_of_packed` to unpack."""
        if seg is None:
            return None, ""
        if (seg["token_start"], seg["token_end"]) != (row.token_start, row.token_end):
            return None, f"round {row.idx}: units of other tokens"
        try:
            header, packed = read_segment(self.store.kv_dir / seg["file"], fingerprint=self.fingerprint,
                                          device=device or "cpu")
            if header.shape[0] != len(self.layers) or header.shape[4] != self.model.cfg.head_dim:
                raise ValueError("units of another model's shape")
            n = row.token_end - row.token_start
            if n > _tokens_held(header.shape[3], header.shape[4], header.dtype):
                raise ValueError(f"a units segment of {header.shape[3]} rows cannot hold {n} tokens' units")
            if device is not None:
                return packed, ""
            return stored_units(packed, row.token_start, row.token_end), ""
        except (StorageError, ValueError) as exc:
            return None, f"round {row.idx}: {exc}"

    def _submit_rows(self, cache, row: RoundRow, units: Units) -> None:
        """Store the round's K/V in its units' order (storage.unit_frames), on the writer's thread."""
        with torch.inference_mode():
            rows, counts = unit_rows(cache, self.layers, units)
        # on the host before it is queued: a restore that stores every round's frames would otherwise hold them all
        # on the device until the writer gets to them (a round is ~84 MB at the 8B shape)
        rows, counts = rows.cpu(), counts.cpu()

        def write() -> None:
            ref = write_unit_frames(self.store.kv_dir, rows, counts, fingerprint=self.fingerprint,
                                    tokens=range(row.token_start, row.token_end))
            self.store.add_segment(self.sid, kind=SEGMENT_UNIT_ROWS, round_idx=row.idx, layer_start=0,
                                   layer_end=self.model.cfg.n_layers, token_start=row.token_start,
                                   token_end=row.token_end, codec=ref.codec,
                                   dtype=str(rows.dtype).removeprefix("torch."), byte_size=ref.byte_size,
                                   raw_size=ref.raw_size, checksum=ref.checksum, file=ref.file,
                                   model_fingerprint=self.fingerprint, live_from=0, merged="")

        self.writer.submit_job(write, f"round {row.idx}'s unit rows")

    def _submit(self, row: RoundRow, units: Units) -> None:
        self.writer.submit(self.sid, row.idx, pack_units(units), range(self.model.cfg.n_layers),
                           range(row.token_start, row.token_end), kind=SEGMENT_UNITS)
