"""Unit-frame files (storage.unit_frames): a round's K/V in units' order, each unit readable alone, every damage a
StorageError."""

from __future__ import annotations

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
