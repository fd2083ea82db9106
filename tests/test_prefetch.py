"""Reading segments ahead of use: results in order, every failure a reason (never a hang), bounded memory, and
the host-to-GPU staging ring bit-exact."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvchat.storage import prefetch
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.segments import tensor_on, write_segment

FP = "ab" * 32


def saved_rounds(folder, n=6, tokens=7):
    refs, kvs = [], []
    for i in range(n):
        kv = torch.randn(2, 2, 2, tokens, 8, generator=torch.Generator().manual_seed(i)).bfloat16()
        refs.append(write_segment(folder, kv, fingerprint=FP, layers=range(2),
                                  tokens=range(i * tokens, (i + 1) * tokens)))
        kvs.append(kv)
    return refs, kvs


def counted_reads(monkeypatch) -> list[str]:
    """The names of the segment files read from now on, in order."""
    reads = []
    real = prefetch.read_segment_file
    monkeypatch.setattr(prefetch, "read_segment_file", lambda path: reads.append(path.name) or real(path))
    return reads


def test_items_come_back_in_order_with_their_headers(tmp_path):
    refs, kvs = saved_rounds(tmp_path)
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs] + [[]], [r.raw_size for r in refs] + [0],
                                finish=lambda header, raw: tensor_on(header, raw, "cpu"))
    try:
        for i, kv in enumerate(kvs):
            [(header, got)] = fetcher.get(i)
            assert header.token_start == i * 7 and torch.equal(got.view(torch.int16), kv.view(torch.int16))
        assert fetcher.get(len(kvs)) == []  # an item with nothing stored
    finally:
        fetcher.close()


def test_an_item_taken_in_order_is_the_callers_alone(tmp_path):
    """Once `get` hands an item over, the prefetcher keeps no reference to it: a restore frees each round's staged
    bytes as soon as the round is placed, not when the whole restore ends."""
    import gc
    import weakref

    refs, _ = saved_rounds(tmp_path, n=3)
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs], [r.raw_size for r in refs],
                                finish=lambda header, raw: tensor_on(header, raw, "cpu"))
    try:
        item = fetcher.get(0)
        held = weakref.ref(item[0][1])
        del item
        gc.collect()
        assert held() is None
        with pytest.raises(RuntimeError, match="taken already"):
            fetcher.get(0)
        assert fetcher.get(1)[0][0].token_start == 7
    finally:
        fetcher.close()


def test_missing_damaged_and_foreign_files_give_reasons(tmp_path):
    refs, _ = saved_rounds(tmp_path, n=3)
    (tmp_path / refs[0].file).unlink()
    data = bytearray((tmp_path / refs[1].file).read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / refs[1].file).write_bytes(bytes(data))
    fetcher = SegmentPrefetcher(tmp_path, "cd" * 32, [[r.file] for r in refs], [r.raw_size for r in refs])
    try:
        assert "missing" in fetcher.get(0)
        assert "corrupt" in fetcher.get(1)
        assert "different model" in fetcher.get(2)
    finally:
        fetcher.close()


def test_an_unexpected_failure_reaches_the_consumer(tmp_path, monkeypatch):
    refs, _ = saved_rounds(tmp_path, n=2)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(prefetch, "decode_segment", broken)
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs], [r.raw_size for r in refs])
    try:
        with pytest.raises(RuntimeError, match="boom"):
            fetcher.get(0)
    finally:
        fetcher.close()


def test_only_a_window_of_bytes_is_read_ahead(tmp_path, monkeypatch):
    refs, _ = saved_rounds(tmp_path, n=8)
    reads = counted_reads(monkeypatch)
    monkeypatch.setattr(SegmentPrefetcher, "WINDOW_BYTES", 3 * refs[0].raw_size)
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs], [r.raw_size for r in refs])
    try:
        fetcher.get(0)
        time.sleep(0.2)
        assert len(reads) == 4  # item 0, then a window of three items ahead of the consumer
        fetcher.get(5)  # skipping ahead (items 1-4 left unused) frees their share of the window too
        time.sleep(0.2)
        assert len(reads) == 8
    finally:
        fetcher.close()


def test_hurried_items_are_read_at_once_and_taken_without_another_read(tmp_path, monkeypatch):
    refs, kvs = saved_rounds(tmp_path, n=5)
    reads = counted_reads(monkeypatch)
    finish = lambda header, raw: tensor_on(header, raw, "cpu")  # noqa: E731
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs], [r.raw_size for r in refs], finish=finish,
                                window_bytes=0)  # nothing read in the background: only what is hurried
    try:
        fetcher.hurry([3, 1])
        fetcher.wait()
        assert sorted(reads) == sorted([refs[3].file, refs[1].file])
        for i in (3, 1):
            (tmp_path / refs[i].file).unlink()  # taken from memory: the file is no longer needed
            [(header, got)] = fetcher.take(i)
            assert header.token_start == i * 7 and torch.equal(got.view(torch.int16), kvs[i].view(torch.int16))
        [(_, got)] = fetcher.take(4)  # not hurried: read on the spot
        assert torch.equal(got.view(torch.int16), kvs[4].view(torch.int16))
        fetcher.close()
        fetcher.hurry([0])  # closed: nothing starts, and take still reads
        assert "missing" in fetcher.take(1) and fetcher.take(0)[0][0].token_start == 0
    finally:
        fetcher.close()


def test_paused_background_reads_start_nothing_while_hurried_and_taken_items_still_come(tmp_path, monkeypatch):
    refs, kvs = saved_rounds(tmp_path, n=6)
    reads = counted_reads(monkeypatch)
    fetcher = SegmentPrefetcher(tmp_path, FP, [[r.file] for r in refs], [r.raw_size for r in refs])
    try:
        fetcher.pause()
        fetcher.start()
        fetcher.hurry([4])
        [(header, _)] = fetcher.take(4)
        [(other, _)] = fetcher.take(2)  # not hurried: read on the spot
        time.sleep(0.2)
        assert header.token_start == 28 and other.token_start == 14
        assert sorted(reads) == sorted([refs[4].file, refs[2].file])  # nothing else while paused
        fetcher.resume()
        fetcher.wait()
        assert len(reads) == 2 + 6  # the background read goes on over every item (results of taken ones dropped)
    finally:
        fetcher.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("size", [0, 1, 4096, 8 << 20, (8 << 20) * 5 + 3])
def test_staging_ring_copies_bit_exact(size):
    from kvchat.storage.staging import HostToDevice

    ring = HostToDevice("cuda", chunk=1 << 20, slots=3)
    data = [bytes(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy()) for _ in range(5)]
    got = [None] * 5

    def copy(i):
        got[i] = ring.copy(data[i])

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(5)]  # several threads share the buffers
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(bytes(g.wait().cpu().numpy()) == d for g, d in zip(got, data))


@pytest.mark.parametrize("samples, window", [(8, 32), (1, 1 << 30)])
def test_resident_fraction_sees_what_the_page_cache_holds(tmp_path, samples, window):
    """A file just read is resident, one pushed out is not, one with its first half pushed out is about half
    resident, whether all its pages are looked up or a few windows of them."""
    from kvchat.storage.pagecache import evict, resident_fraction

    path = tmp_path / "seg.bin"
    path.write_bytes(os.urandom(4 << 20))
    path.read_bytes()
    assert resident_fraction(path, samples, window) == 1.0
    if not evict([path]) or resident_fraction(path, samples, window) > 0.0:
        pytest.skip("this filesystem keeps its pages whatever it is advised")
    path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:  # the first half out again (reading half would read ahead into the rest)
        os.posix_fadvise(fd, 0, 2 << 20, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert 0.3 <= resident_fraction(path, samples, window) <= 0.7
    assert resident_fraction(tmp_path / "gone.bin") == 0.0
    (tmp_path / "empty.bin").write_bytes(b"")
    assert resident_fraction(tmp_path / "empty.bin") == 1.0
