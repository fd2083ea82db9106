"""Unit-frame files (storage.unit_frames): a round's K/V in units' order, each unit readable alone, every damage a
StorageError."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvchat.storage.codec import StorageError
from kvchat.storage.segments import SegmentCorrupt, SegmentWrongModel
from kvchat.storage.unit_frames import UnitFramesFile, verify_unit_frames, write_unit_frames

FP = "ab" * 32
G, H, N, D, U = 2, 3, 40, 8, 5


def round_rows(dtype=torch.bfloat16):
    """K/V [G, H, 2, N, D] of a round and its members [G, H, N] (unit 4 of head 0 of layer 1 empty)."""
    torch.manual_seed(0)
    kv = torch.randn(G, H, 2, N, D).to(dtype)
    member = torch.randint(0, U, (G, H, N))
    member[1, 0][member[1, 0] == 4] = 3
    order = member.argsort(dim=2, stable=True)
    rows = kv.gather(3, order[:, :, None, :, None].expand(-1, -1, 2, -1, D))
    counts = torch.zeros(G, H, U, dtype=torch.long).scatter_add_(2, member, torch.ones_like(member))
    return kv, member, rows, counts


def unit_of(kv, member, g, h, u):
    return kv[g, h][:, member[g, h] == u]  # [2, members, D] in slot order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_each_unit_reads_back_alone_bit_for_bit(tmp_path, dtype):
    kv, member, rows, counts = round_rows(dtype)
    ref = write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(100, 100 + N))
    verify_unit_frames(tmp_path / ref.file)
    with UnitFramesFile(tmp_path / ref.file, fingerprint=FP) as f:
        assert (f.header.layers, f.header.heads, f.header.frames) == (G, H, G * H * U)
        want = [(1, 2, 3), (0, 1, 0), (0, 1, 1), (1, 0, 4)]  # two adjacent frames: one read; an empty unit
        frames = sorted(f.frame_index(g, h, u, U) for g, h, u in want)
        by_frame = {f.frame_index(g, h, u, U): (g, h, u) for g, h, u in want}
        got = f.read(frames, [int(counts[by_frame[i]]) for i in frames])
        for i, rows_read in zip(frames, got):
            assert torch.equal(rows_read, unit_of(kv, member, *by_frame[i]))
        assert f.bytes_read < ref.byte_size  # a part of the file, not all of it
    assert ref.file == write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(100, 100 + N)).file


def test_damage_anywhere_is_an_error_never_wrong_rows(tmp_path):
    kv, member, rows, counts = round_rows()
    ref = write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N))
    path = tmp_path / ref.file
    with UnitFramesFile(path, fingerprint=FP) as f:
        header = f.header
    good = path.read_bytes()

    def damaged(at: int) -> None:
        data = bytearray(good)
        data[at] ^= 0x10
        path.chmod(0o644)
        path.write_bytes(bytes(data))

    damaged(header.size - 40)  # the index
    with pytest.raises(SegmentCorrupt, match="index"):
        UnitFramesFile(path, fingerprint=FP)
    frame = 7
    damaged(header.size + (header.offsets[frame] + header.offsets[frame + 1]) // 2)
    with UnitFramesFile(path, fingerprint=FP) as f:
        with pytest.raises(SegmentCorrupt, match="cannot be decoded"):
            f.read([frame], [int(counts.view(-1)[frame])])
        assert f.read([frame + 1], [int(counts.view(-1)[frame + 1])])  # the others still read
        with pytest.raises(SegmentCorrupt):  # a row count the frame does not hold
            f.read([frame + 1], [int(counts.view(-1)[frame + 1]) + 1])
        with pytest.raises(SegmentCorrupt):  # units the file was not written with
            f.frame_index(0, 0, 0, U + 1)
    with pytest.raises(StorageError, match="content does not match"):
        verify_unit_frames(path)
    path.write_bytes(good)
    with pytest.raises(SegmentWrongModel):
        UnitFramesFile(path, fingerprint="cd" * 32)
    path.write_bytes(good[: header.size + 10])  # cut short
    with UnitFramesFile(path, fingerprint=FP) as f, pytest.raises(SegmentCorrupt, match="shorter"):
        f.read([G * H * U - 1], [int(counts.view(-1)[-1])])


def test_rows_that_do_not_make_the_round_are_refused(tmp_path):
    _, _, rows, counts = round_rows()
    with pytest.raises(ValueError):
        write_unit_frames(tmp_path, rows, counts[:, :, :-1], fingerprint=FP, tokens=range(N))
    with pytest.raises(ValueError):
        write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N + 1))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("first_pass", ["nowait", "none"])
def test_frames_of_several_files_read_together_are_each_files_own_in_order(tmp_path, monkeypatch, first_pass):
    """`read_frames_of` (a lazy resume's reads of one layer): any frames of several files land back to back in one
    buffer exactly as each file's frames read alone, runs of consecutive frames included — read without waiting
    where the page cache holds them, on reader threads where it does not, and all on reader threads where the OS
    has no reads that refuse to wait ("none")."""
    from concurrent.futures import ThreadPoolExecutor

    from kvchat.storage.pagecache import evict
    from kvchat.storage.unit_frames import read_frames_of

    if first_pass == "none":
        monkeypatch.delattr(os, "RWF_NOWAIT", raising=False)
    _, _, rows, counts = round_rows()
    other = torch.flip(rows, dims=[3]).contiguous()  # a second round: other bytes, the same counts' shapes
    paths = [tmp_path / write_unit_frames(tmp_path, r, counts, fingerprint=FP, tokens=range(N)).file
             for r in (rows, other)]
    chosen = [[0, 1, 2, 7, 9, 10], [3, 4, 11, G * H * U - 1]]  # runs and single frames
    files = [UnitFramesFile(p, fingerprint=FP) for p in paths]
    try:
        alone = []
        for f, frames in zip(files, chosen):
            for frame in frames:
                a, b = f.header.offsets[frame], f.header.offsets[frame + 1]
                alone.append(f._pread(int(b - a), f.header.size + int(a)))
        before = [f.bytes_read for f in files]
        with ThreadPoolExecutor(4) as pool:
            for jobs in (1, 3, 16):  # one reader, several, more than the runs
                # the files out of the page cache (where the OS can): the reads refused without waiting, then waited
                # for on the pool's threads
                evict(paths)
                data, segments = read_frames_of(files, [np.asarray(c) for c in chosen], pool, jobs)
                assert [bytes(data[a : a + n]) for a, n in segments.tolist()] == alone
            data, segments = read_frames_of(files, [np.asarray(c) for c in chosen], pool, 4)  # from the page cache
            assert [bytes(data[a : a + n]) for a, n in segments.tolist()] == alone
        # each file counts the bytes read of it (four times over: the four reads above)
        assert [f.bytes_read - b for f, b in zip(files, before)] == [4 * sum(
            int(f.header.offsets[i + 1] - f.header.offsets[i]) for i in c) for f, c in zip(files, chosen)]
        # and a frame of the second file decompresses to that round's rows of its unit
        g, h, u = 11 // (H * U), 11 // U % H, 11 % U
        got = files[1].read([11], [int(counts[g, h, u])])[0]
        assert torch.equal(got, other[g, h][:, int(counts[g, h, :u].sum()) : int(counts[g, h, : u + 1].sum())])
    finally:
        for f in files:
            f.close()


def test_a_file_cut_short_among_several_is_named(tmp_path):
    from kvchat.storage.unit_frames import read_frames_of

    _, _, rows, counts = round_rows()
    good = tmp_path / write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N)).file
    other = torch.flip(rows, dims=[3]).contiguous()
    cut = tmp_path / write_unit_frames(tmp_path, other, counts, fingerprint=FP, tokens=range(N)).file
    data = cut.read_bytes()
    cut.chmod(0o644)
    with UnitFramesFile(cut, fingerprint=FP) as f:
        size = f.header.size
    cut.write_bytes(data[: size + 10])
    with UnitFramesFile(good, fingerprint=FP) as a, UnitFramesFile(cut, fingerprint=FP) as b:
        with pytest.raises(SegmentCorrupt, match=f"{cut.name}.*shorter"):
            read_frames_of([a, b], [np.asarray([0, 1]), np.asarray([G * H * U - 1])])
