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
    assert ref.codec == "raw" and ref.raw_size == G * H * 2 * N * D * dtype.itemsize
    with UnitFramesFile(tmp_path / ref.file, fingerprint=FP) as f:
        assert (f.header.layers, f.header.heads, f.header.frames) == (G, H, G * H * U)
        f.check_members(counts.numpy())
        want = [(1, 2, 3), (0, 1, 0), (0, 1, 1), (1, 0, 4)]  # two adjacent frames: one read; an empty unit
        frames = sorted(f.frame_index(g, h, u, U) for g, h, u in want)
        by_frame = {f.frame_index(g, h, u, U): (g, h, u) for g, h, u in want}
        got = f.read(frames)
        for i, rows_read in zip(frames, got):
            assert torch.equal(rows_read, unit_of(kv, member, *by_frame[i]))
        assert f.bytes_read < ref.byte_size  # a part of the file, not all of it
    assert ref.file == write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(100, 100 + N)).file


def test_a_frames_checksum_catches_any_one_word_changed_or_two_swapped():
    from kvchat.storage.unit_frames import frame_rows, frame_sums

    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1])
    rows = torch.randint(0, 256, (2 * int(counts.sum()), 2 * D), dtype=torch.uint8)
    _, frame, place = frame_rows(counts)
    good = frame_sums(rows, frame, place, len(counts))
    for r, w in [(0, 0), (5, 3), (17, D - 1)]:
        for bit in (0, 7, 15):
            bad = rows.clone()
            bad.view(torch.int16)[r, w] ^= 1 << bit if bit < 15 else -(1 << 15)
            changed = (frame_sums(bad, frame, place, len(counts)) != good).any(1)
            assert changed.tolist() == [i == int(frame[r]) for i in range(len(counts))]
    swapped = rows.clone()
    swapped[[6, 7]] = rows[[7, 6]]  # two rows of one frame in each other's place
    assert not torch.equal(rows[6], rows[7]) and (frame_sums(swapped, frame, place, len(counts))[2] != good[2]).any()
    # two words whose weighted changes cancel in the first sum (word 0: -2, word 1: +1) do not in the second
    zeros = torch.zeros_like(rows)
    zeros.view(torch.int16)[0, 0] = 2
    other = torch.zeros_like(rows)
    other.view(torch.int16)[0, 1] = 1
    a, b = frame_sums(zeros, frame, place, len(counts))[0], frame_sums(other, frame, place, len(counts))[0]
    assert a[0] == b[0] and a[1] != b[1]


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

    damaged(30 + 12 * header.frames)  # the index (its checksums)
    with pytest.raises(SegmentCorrupt, match="index"):
        UnitFramesFile(path, fingerprint=FP)
    frame = 7
    row_bytes = D * 2
    damaged(header.size + int(header.first_row[frame] + header.first_row[frame + 1]) // 2 * row_bytes + 1)
    with UnitFramesFile(path, fingerprint=FP) as f:
        with pytest.raises(SegmentCorrupt, match="checksum"):
            f.read([frame])
        assert f.read([frame + 1])  # the others still read
        with pytest.raises(SegmentCorrupt):  # members the round's units do not give its frames
            f.check_members((counts + torch.eye(U, dtype=counts.dtype)[0]).numpy())
        with pytest.raises(SegmentCorrupt):  # units the file was not written with
            f.frame_index(0, 0, 0, U + 1)
    with pytest.raises(StorageError, match="content does not match"):
        verify_unit_frames(path)
    path.write_bytes(good)
    with pytest.raises(SegmentWrongModel):
        UnitFramesFile(path, fingerprint="cd" * 32)
    path.write_bytes(good[: header.size + 10])  # cut short
    with pytest.raises(SegmentCorrupt, match="shorter"):
        UnitFramesFile(path, fingerprint=FP)
    path.write_bytes(good + b"\0")  # or grown
    with pytest.raises(SegmentCorrupt, match="longer"):
        UnitFramesFile(path, fingerprint=FP)
    path.write_bytes(good.replace(b"KVUF\x02\x00", b"KVUF\x01\x00", 1))  # version 1's zstd frames: not read here
    with pytest.raises(SegmentCorrupt, match="version"):
        UnitFramesFile(path, fingerprint=FP)


def test_rows_that_do_not_make_the_round_are_refused(tmp_path):
    _, _, rows, counts = round_rows()
    with pytest.raises(ValueError):
        write_unit_frames(tmp_path, rows, counts[:, :, :-1], fingerprint=FP, tokens=range(N))
    with pytest.raises(ValueError):
        write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N + 1))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("across", [0, 1000, 1 << 20])
@pytest.mark.parametrize("first_pass", ["nowait", "none"])
def test_frames_of_several_files_gathered_together_are_each_files_own_in_order(tmp_path, monkeypatch, first_pass,
                                                                                across):
    """`gather_frames` (a lazy resume's reads of one layer): any frames of several files land back to back in one
    buffer exactly as each file's frames read alone, runs of consecutive frames included — read without waiting
    where the page cache holds them, on reader threads where it does not, and all on reader threads where the OS has
    no reads that refuse to wait ("none"); runs of a file read one by one, across the smaller gaps between them
    (1,000 bytes), or across all (the bytes between counted as read)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvchat.storage.pagecache import evict, resident_fraction
    from kvchat.storage.unit_frames import gather_frames

    if first_pass == "none":
        monkeypatch.delattr(os, "RWF_NOWAIT", raising=False)
    _, _, rows, counts = round_rows()
    other = torch.flip(rows, dims=[3]).contiguous()  # a second round: other bytes, the same counts' shapes
    paths = [tmp_path / write_unit_frames(tmp_path, r, counts, fingerprint=FP, tokens=range(N)).file
             for r in (rows, other)]
    chosen = [[0, 1, 2, 7, 9, 10], [3, 4, 11, G * H * U - 1]]  # runs and single frames
    with UnitFramesFile(paths[0], fingerprint=FP) as f:
        alone = [f.read([i])[0] for i in chosen[0]]
    with UnitFramesFile(paths[1], fingerprint=FP) as f:
        alone += [f.read([i])[0] for i in chosen[1]]
    files = [UnitFramesFile(p, fingerprint=FP) for p in paths]
    try:
        with ThreadPoolExecutor(4) as pool:
            for jobs, cold in [(1, True), (3, True), (16, True), (4, False)]:  # readers: one, several, more than reads
                # out of the page cache (where the OS can): a file's first read refused without waiting, its
                # others not tried, all waited for on the reader threads
                evicted = cold and evict(paths) and max(resident_fraction(p) for p in paths) == 0
                before = [f.bytes_read for f in files]
                detail = {}
                data, first, members = gather_frames(files, [np.asarray(c) for c in chosen], pool, jobs,
                                                     detail=detail, across=across)
                assert detail["runs"] == 6  # [0-2], [7], [9-10] of the first file; [3-4], [11], [29] of the second
                frame_bytes = [4 * D * int(c) for c in counts.view(-1).tolist()]
                gaps = [sum(frame_bytes[a + 1 : b]) for a, b in [(2, 7), (7, 9), (4, 11), (11, G * H * U - 1)]]
                assert 0 < min(gaps) <= 1000 < max(gaps)  # (the case: some gaps read across at 1,000 bytes, not all)
                across_of = [[g for g in gaps[:2] if g <= across], [g for g in gaps[2:] if g <= across]]
                assert detail["reads"] == 6 - sum(map(len, across_of))
                if first_pass == "none":  # every read waited for
                    assert detail["refused_reads"] == detail["reads"]
                elif not cold:  # all in the page cache (the reads before brought them): none refused
                    assert detail["refused_reads"] == 0
                elif evicted:  # (the kernel may finish a refused read's disk read before the next is tried)
                    assert 0 < detail["refused_reads"] <= detail["reads"]
                assert min(detail[k] for k in ("plan_s", "nowait_s", "wait_s")) >= 0
                for limit in (4, 16, 64):  # the gaps between a file's runs, by size (none between two files)
                    near = [g for g in gaps if g <= limit * 1024]
                    assert (detail[f"gaps_within_{limit}k"], detail[f"gap_bytes_within_{limit}k"]) == (
                        len(near), sum(near))
                got = [data[a : a + 2 * n].view(torch.bfloat16).view(2, n, D)
                       for a, n in zip(first.tolist(), members.tolist())]
                assert len(got) == len(alone) and all(torch.equal(a, b) for a, b in zip(got, alone))
                assert [f.bytes_read - b for f, b in zip(files, before)] == [  # each file counts its bytes read
                    sum(frame_bytes[i] for i in c) + sum(g) for c, g in zip(chosen, across_of)]
    finally:
        for f in files:
            f.close()


def test_files_with_no_frames_asked_and_frames_out_of_order_in_a_gather(tmp_path):
    """A file asked for nothing reads nothing (and counts nothing); frames not ascending, or past a file's end, are
    refused before any read."""
    from kvchat.storage.unit_frames import gather_frames

    _, _, rows, counts = round_rows()
    path = tmp_path / write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N)).file
    with UnitFramesFile(path, fingerprint=FP) as a, UnitFramesFile(path, fingerprint=FP) as b:
        alone, _, _ = gather_frames([a], [np.asarray([2, 3, 9])])
        before = b.bytes_read
        data, first, members = gather_frames([b, a, b], [np.asarray([], dtype=np.int64), np.asarray([2, 3, 9]),
                                                         np.asarray([], dtype=np.int64)])
        assert torch.equal(data, alone) and b.bytes_read == before
        assert members.tolist() == [int(counts.view(-1)[i]) for i in (2, 3, 9)]
        empty, first, members = gather_frames([a], [np.asarray([], dtype=np.int64)])
        assert empty.shape == (0, D * 2) and not first.size and not members.size
        no_members = (1 * H + 0) * U + 4  # layer 1, head 0, unit 4: a frame of no rows
        empty, first, members = gather_frames([a], [np.asarray([no_members])])
        assert empty.shape == (0, D * 2) and members.tolist() == [0]
        assert a.read([no_members])[0].shape == (2, 0, D)
        for bad in ([3, 2], [5, 5], [-1], [G * H * U]):
            with pytest.raises(ValueError):
                gather_frames([a], [np.asarray(bad)])


def test_a_file_cut_short_after_it_was_opened_is_named(tmp_path):
    from kvchat.storage.unit_frames import gather_frames

    _, _, rows, counts = round_rows()
    good = tmp_path / write_unit_frames(tmp_path, rows, counts, fingerprint=FP, tokens=range(N)).file
    other = torch.flip(rows, dims=[3]).contiguous()
    cut = tmp_path / write_unit_frames(tmp_path, other, counts, fingerprint=FP, tokens=range(N)).file
    with UnitFramesFile(good, fingerprint=FP) as a, UnitFramesFile(cut, fingerprint=FP) as b:
        os.truncate(cut, b.header.size + 10)
        with pytest.raises(SegmentCorrupt, match=f"{cut.name}.*shorter"):
            gather_frames([a, b], [np.asarray([0, 1]), np.asarray([G * H * U - 1])])


def test_a_cold_read_of_frames_takes_from_the_disk_their_pages_and_no_read_ahead(tmp_path):
    """storage.pagecache.disk_bytes_read (the bench's `lazy_disk_bytes_before_first_token`) on frames read as a
    lazy resume reads a layer's (ascending, with gaps): from a file out of the page cache, their whole pages and not
    the kernel's read-ahead, which took such reads for a sequential one and read up to 4x the bytes asked for
    (docs/benchmarks.md); read again, from the cache, nothing."""
    from kvchat.storage.pagecache import disk_bytes_read, evict, resident_fraction
    from kvchat.storage.unit_frames import gather_frames

    if disk_bytes_read() is None:
        pytest.skip("this OS does not count a process's disk reads")
    _, _, rows, counts = round_rows()
    big = rows.repeat(1, 1, 1, 512, 1).contiguous()  # [G, H, 2, 512 N, D]: frames of ~130 KB, a file of ~4 MB
    path = tmp_path / write_unit_frames(tmp_path, big, counts * 512, fingerprint=FP, tokens=range(512 * N)).file
    if not evict([path]) or resident_fraction(path) > 0:
        pytest.skip("files here cannot be pushed out of the page cache (a memory file system)")
    every_third = np.arange(0, G * H * U, 3)
    with UnitFramesFile(path, fingerprint=FP) as f:
        before = disk_bytes_read()
        gather_frames([f], [every_third], across=0)
        cold = disk_bytes_read() - before
        asked = f.bytes_read - f.header.size
        before = disk_bytes_read()
        gather_frames([f], [every_third], across=0)
        warm = disk_bytes_read() - before
    assert path.stat().st_size > 2 * asked > 0
    assert asked <= cold <= asked + 2 * 4096 * len(every_third)  # each frame's pages, no more
    assert warm == 0


def test_once_a_files_read_is_refused_its_other_reads_go_to_the_reader_threads_untried(tmp_path, monkeypatch):
    """A refused read without waiting has the kernel start it on the calling thread (~18 us); a file out of the
    page cache is so for its other frames too, so after its first refusal a file's reads are left to the reader
    threads untried, and another file's are still tried. Which reads the page cache refuses is the kernel's to say
    (a refused read's disk read may even be done before the next try), so here the first file's first read is
    refused by a stand-in for os.preadv, and every call is also made for real."""
    from concurrent.futures import ThreadPoolExecutor

    from kvchat.storage import unit_frames
    from kvchat.storage.unit_frames import gather_frames

    nowait = getattr(os, "RWF_NOWAIT", 0)
    if not nowait:
        pytest.skip("this OS has no reads that refuse to wait")
    _, _, rows, counts = round_rows()
    paths = [tmp_path / write_unit_frames(tmp_path, r, counts, fingerprint=FP, tokens=range(N)).file
             for r in (rows, torch.flip(rows, dims=[3]).contiguous())]
    files = [UnitFramesFile(p, fingerprint=FP) for p in paths]
    fds = [f._fd for f in files]
    chosen = [np.asarray([0, 7, 20]), np.asarray([3, 11])]
    tried = []  # (descriptor, whether without waiting) of every read
    real = os.preadv

    def preadv(fd, buffers, at, flags=0):
        tried.append((fd, bool(flags & nowait)))
        if tried[-1] == (fds[0], True) and tried.count((fds[0], True)) == 1:
            raise BlockingIOError("refused")
        return real(fd, buffers, at, flags)

    try:
        alone = torch.cat([gather_frames([f], [c], across=0)[0] for f, c in zip(files, chosen)])
        detail = {}
        with ThreadPoolExecutor(2) as pool:
            monkeypatch.setattr(unit_frames.os, "preadv", preadv)
            data, _, _ = gather_frames(files, chosen, pool, 2, detail=detail, across=0)
            monkeypatch.undo()
    finally:
        for f in files:
            f.close()
    assert detail["reads"] == 5 and detail["refused_reads"] == 3  # the first file's three; the second's none
    assert sorted(w for fd, w in tried if fd == fds[0]) == [False, False, False, True]  # one try, then three waits
    assert sorted(w for fd, w in tried if fd == fds[1]) == [True, True]  # both tried, both answered
    assert torch.equal(data, alone)


def test_a_read_across_gaps_takes_at_most_512_runs_and_a_table_refuses_frames_out_of_place(tmp_path):
    """A preadv takes at most IOV_MAX (1,024) buffers, two a run read across a gap: 1,050 runs of one file within
    READ_ACROSS of each other are read by three preadvs (512 runs at most each), the same bytes as one read a run.
    A frame table (what a lazy resume plans a layer's reads of ~50 files with) refuses frames past their file's end
    or out of order, and gives each frame's checksums as its file's index does."""
    from kvchat.storage.unit_frames import FrameTable, gather_frames, gather_table_frames

    n = 2100
    torch.manual_seed(1)
    rows = torch.randn(1, 1, 2, n, D).to(torch.bfloat16)  # one layer and head, a unit a slot: 2,100 frames
    path = tmp_path / write_unit_frames(tmp_path, rows, torch.ones(1, 1, n, dtype=torch.long), fingerprint=FP,
                                        tokens=range(n)).file
    every_other = np.arange(0, n, 2)
    with UnitFramesFile(path, fingerprint=FP) as f:
        one_a_run, _, _ = gather_frames([f], [every_other], across=0)
        detail = {}
        across, first, members = gather_frames([f], [every_other], detail=detail, across=1 << 20)
        assert detail["runs"] == len(every_other) == 1050 and detail["reads"] == 3
        assert torch.equal(across, one_a_run) and members.tolist() == [1] * 1050
        assert torch.equal(across.view(torch.bfloat16).view(-1, 2, D), rows[0, 0, :, ::2].transpose(0, 1))
        table = FrameTable([f, f])  # (the same file twice: two files' places in one table)
        which, frames = np.asarray([0, 0, 1]), np.asarray([5, 9, 2])
        assert np.array_equal(table.expected_sums(which, frames), f.header.sums[frames])
        data, _, _ = gather_table_frames(table, which, frames)
        assert torch.equal(data, torch.cat([gather_frames([f], [np.asarray([5, 9])])[0],
                                            gather_frames([f], [np.asarray([2])])[0]]))
        for bad_which, bad_frames in (([0, 0], [9, 5]), ([1, 0], [2, 5]), ([0], [n]), ([0], [-1])):
            with pytest.raises(ValueError):
                gather_table_frames(table, np.asarray(bad_which), np.asarray(bad_frames))
