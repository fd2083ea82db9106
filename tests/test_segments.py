"""KV segment files: bit-exact round trips, content addressing, refusal of every damaged file with the right reason,
no debris after a failed write, and sweeping of orphans."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import errno
import hashlib
import os
import tempfile
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvchat.storage import segments
from kvchat.storage.codec import CODECS, StorageError
from kvchat.storage.segments import (
    FORMAT_VERSION, SegmentCorrupt, SegmentMissing, SegmentRef, SegmentWrongModel, read_segment, sweep,
    write_segment,
)

FP = "ab" * 32
OTHER_FP = "cd" * 32
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def random_kv(dtype=torch.bfloat16, layers=2, heads=2, tokens=5, head_dim=8, seed=0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities and subnormals included): storage must not care what they mean."""
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(info.min, info.max, (layers, 2, heads, tokens, head_dim), generator=g, dtype=torch.int64)
    return raw.to(bits).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def saved(tmp_path):
    kv = random_kv(tokens=64, head_dim=16)
    ref = write_segment(tmp_path, kv, fingerprint=FP, layers=range(4, 6), tokens=range(100, 164))
    return tmp_path / ref.file, kv


# ----------------------------------------------------------------------------------------------------- round trip


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(BITS)),
    codec=st.sampled_from(CODECS),
    dims=st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(0, 9), st.integers(1, 8)),
    layer_start=st.integers(0, 80),
    token_start=st.integers(0, 5000),
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_exact(dtype, codec, dims, layer_start, token_start, seed):
    n_layers, heads, n_tokens, head_dim = dims
    kv = random_kv(dtype, n_layers, heads, n_tokens, head_dim, seed)
    layers, tokens = range(layer_start, layer_start + n_layers), range(token_start, token_start + n_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        ref = write_segment(Path(tmp), kv, fingerprint=FP, layers=layers, tokens=tokens, codec=codec)
        path = Path(tmp) / ref.file
        header, back = read_segment(path, fingerprint=FP)
        assert same_bits(back, kv) and back.device.type == "cpu"
        assert (header.version, header.fingerprint, header.dtype, header.codec) == (FORMAT_VERSION, FP, dtype, codec)
        assert (header.shape, header.layers, header.tokens) == (tuple(kv.shape), layers, tokens)
        assert header.raw_size == ref.raw_size == kv.numel() * kv.element_size()
        assert header.checksum == ref.checksum and ref.codec == codec
        assert ref.byte_size == path.stat().st_size == header.header_size + header.payload_size
        assert debris(Path(tmp)) == [ref.file]


def test_reads_back_what_the_cache_holds(tmp_path):
    kv = torch.randn(3, 2, 2, 7, 16).bfloat16()
    ref = write_segment(tmp_path, kv[:, :, :, 2:5], fingerprint=FP, layers=range(3), tokens=range(2, 5))
    _, back = read_segment(tmp_path / ref.file, fingerprint=FP)
    assert back.is_contiguous() and same_bits(back, kv[:, :, :, 2:5].contiguous())


@pytest.mark.gpu
def test_cuda_tensor_comes_back_on_the_cpu(tmp_path):
    kv = torch.randn(2, 2, 2, 5, 8, device="cuda").bfloat16()
    ref = write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(5))
    _, back = read_segment(tmp_path / ref.file, fingerprint=FP)
    assert back.device.type == "cpu" and same_bits(back, kv.cpu())


def test_same_content_same_file_written_once(tmp_path, monkeypatch):
    kv = random_kv()
    first = write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(5))
    before = (tmp_path / first.file).stat()
    replaced = []
    monkeypatch.setattr(segments.os, "replace", lambda *a: replaced.append(a))
    again = write_segment(tmp_path, kv.clone(), fingerprint=FP, layers=range(2), tokens=range(5))
    assert again == first and replaced == []
    after = (tmp_path / first.file).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert debris(tmp_path) == [first.file]


def test_anything_else_is_another_file(tmp_path):
    kv = random_kv()
    names = {
        write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(5)).file,
        write_segment(tmp_path, kv, fingerprint=OTHER_FP, layers=range(2), tokens=range(5)).file,
        write_segment(tmp_path, kv, fingerprint=FP, layers=range(1, 3), tokens=range(5)).file,
        write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(1, 6)).file,
        write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(5), codec="zstd").file,
    }
    assert len(names) == 5 and debris(tmp_path) == sorted(names)


def test_damaged_file_is_repaired_by_writing_again(saved):
    path, kv = saved
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(SegmentCorrupt):
        read_segment(path, fingerprint=FP)
    write_segment(path.parent, kv, fingerprint=FP, layers=range(4, 6), tokens=range(100, 164))
    assert same_bits(read_segment(path, fingerprint=FP)[1], kv)


@pytest.mark.parametrize("bad", [
    dict(kv=torch.zeros(2, 2, 1, 3, 4, dtype=torch.float64)),
    dict(kv=torch.zeros(2, 3, 1, 3, 4)),
    dict(kv=torch.zeros(2, 2, 3, 4)),
    dict(layers=range(3)),
    dict(tokens=range(4)),
    dict(layers=range(0, 4, 2)),
    dict(tokens=range(-1, 2)),
    dict(fingerprint="ab" * 31),
    dict(fingerprint="xy" * 32),
    dict(kind="bounds"),
    dict(kind="key-bounds", tokens=range(2)),
])
def test_bad_arguments_are_value_errors(tmp_path, bad):
    args = dict(kv=torch.zeros(2, 2, 1, 3, 4), fingerprint=FP, layers=range(2), tokens=range(3)) | bad
    with pytest.raises(ValueError):
        write_segment(tmp_path, args.pop("kv"), **args)
    assert debris(tmp_path) == []


def test_key_bounds_hold_blocks_of_tokens(tmp_path):
    bounds = random_kv(tokens=3)  # min and max per block of 32 tokens: 3 blocks for 70 tokens
    ref = write_segment(tmp_path, bounds, fingerprint=FP, layers=range(8, 10), tokens=range(10, 80), kind="key-bounds")
    header, back = read_segment(tmp_path / ref.file, fingerprint=FP)
    assert same_bits(back, bounds) and (header.shape, header.tokens) == (tuple(bounds.shape), range(10, 80))


@pytest.mark.parametrize("blocks,tokens", [(6, 5), (0, 5), (1, 0)])
def test_key_bounds_need_one_to_len_tokens_blocks(tmp_path, blocks, tokens):
    with pytest.raises(ValueError, match=f"must hold 1 to {tokens} blocks, not {blocks}"):
        write_segment(tmp_path, random_kv(tokens=blocks), fingerprint=FP, layers=range(2), tokens=range(tokens),
                      kind="key-bounds")
    assert debris(tmp_path) == []


def test_folder_is_created(tmp_path):
    ref = write_segment(tmp_path / "a" / "b", random_kv(), fingerprint=FP, layers=range(2), tokens=range(5))
    assert (tmp_path / "a" / "b" / ref.file).is_file()


# -------------------------------------------------------------------------------------------------------- refusals


def expect_corrupt(path: Path, fingerprint: str = FP, **kw) -> SegmentCorrupt:
    """Exactly SegmentCorrupt: any other exception type escaping here is a bug."""
    try:
        read_segment(path, fingerprint=fingerprint, **kw)
    except SegmentCorrupt as e:
        return e
    except BaseException as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} instead of SegmentCorrupt: {e}")
    pytest.fail("a damaged segment was read without complaint")


def test_missing(tmp_path):
    with pytest.raises(SegmentMissing, match="missing"):
        read_segment(tmp_path / ("0" * 64 + ".kvs"), fingerprint=FP)


def test_wrong_model(saved):
    path, _ = saved
    with pytest.raises(SegmentWrongModel, match="different model"):
        read_segment(path, fingerprint=OTHER_FP)


def test_truncated_anywhere(saved):
    path, _ = saved
    data = path.read_bytes()
    header_size = segments.header_size(5)
    cuts = sorted({0, 1, 3, 4, 10, 40, 43, 50, header_size - 1, header_size, header_size + 1,
                   len(data) // 2, len(data) - 1})
    for cut in cuts:
        path.write_bytes(data[:cut])
        expect_corrupt(path)


def test_trailing_bytes(saved):
    path, _ = saved
    path.write_bytes(path.read_bytes() + b"\0")
    expect_corrupt(path)


def test_every_flipped_header_byte_is_noticed(saved):
    # Including the fingerprint: a damaged file is corrupt, not a different model's.
    path, _ = saved
    data = path.read_bytes()
    for i in range(segments.header_size(5)):
        flipped = bytearray(data)
        flipped[i] ^= 0x10
        path.write_bytes(flipped)
        expect_corrupt(path)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_payload_byte(saved, where):
    path, _ = saved
    data = bytearray(path.read_bytes())
    start = segments.header_size(5)
    data[start + int(where * (len(data) - start - 1))] ^= 0x01
    path.write_bytes(data)
    assert "does not match its name" in str(expect_corrupt(path))
    # Under another name only the payload checksum can tell.
    renamed = path.with_name("copy.kvs")
    path.rename(renamed)
    assert "checksum" in str(expect_corrupt(renamed))


def test_wrong_magic(saved):
    path, _ = saved
    path.write_bytes(b"GGUF" + path.read_bytes()[4:])
    assert "not a KV segment" in str(expect_corrupt(path))


def test_renamed_file_is_still_checked(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    other = path.with_name("copy.kvs")
    other.write_bytes(data)
    expect_corrupt(other)


def header_of(path: Path) -> segments.SegmentHeader:
    with open(path, "rb") as f:
        return segments._read_header(f, path, path.stat().st_size, 1 << 34)[0]


def forge(header: segments.SegmentHeader, payload: bytes, folder: Path) -> Path:
    """A file that is internally consistent (hashes and name match) but describes something we must refuse."""
    data = header.pack() + payload
    path = folder / (segments._whole_file_hash(data) + ".kvs")
    path.write_bytes(data)
    return path


def test_unknown_version_dtype_codec(saved):
    path, _ = saved
    good = header_of(path)
    payload = path.read_bytes()[good.header_size:]
    data = bytearray(path.read_bytes())
    for offset, value in ((4, FORMAT_VERSION + 1), (40, 7), (41, 7)):  # version u16, dtype u8, codec u8
        forged = bytearray(data)
        forged[offset] = value
        forged_path = path.with_name(segments._whole_file_hash(bytes(forged)) + ".kvs")
        forged_path.write_bytes(forged)
        expect_corrupt(forged_path)
    expect_corrupt(forge(replace(good, shape=(2, 2, 1, 64, 16)), payload, path.parent))  # shape x size != raw
    garbage = b"not a zstd frame"
    undecodable = replace(good, payload_size=len(garbage), checksum=hashlib.sha256(garbage).hexdigest())
    assert "cannot be decoded" in str(expect_corrupt(forge(undecodable, garbage, path.parent)))


def test_sizes_are_checked_before_decompressing(saved, monkeypatch):
    path, _ = saved
    good = header_of(path)
    payload = path.read_bytes()[good.header_size:]
    with monkeypatch.context() as m:
        m.setattr(segments.kvcodec, "decode", lambda *a: pytest.fail("decompressed an unchecked segment"))
        assert "allowed" in str(expect_corrupt(path, max_raw_size=good.raw_size - 1))
        expect_corrupt(forge(replace(good, payload_size=good.payload_size + 1), payload, path.parent))
    # Consistent, hashes right, within max_raw_size, and claiming 8 GiB: the zstd frame's own size disagrees, and
    # that is noticed before anything that size is allocated.
    huge = replace(good, shape=(2, 2, 1 << 20, 64, 16), raw_size=2 * 2 * (1 << 20) * 64 * 16 * 2)
    tracemalloc.start()
    try:
        assert "declares" in str(expect_corrupt(forge(huge, payload, path.parent)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_unreadable_is_a_storage_error(tmp_path):
    (tmp_path / "dir.kvs").mkdir()
    with pytest.raises(StorageError):
        read_segment(tmp_path / "dir.kvs", fingerprint=FP)


# ------------------------------------------------------------------------------------------------ failing writes


def failing(real, err: int, on_call: int = 1):
    """`real`, except that call number `on_call` raises OSError(err); a write first writes part of its data."""
    calls = [0]

    def fake(*args):
        calls[0] += 1
        if calls[0] != on_call:
            return real(*args)
        if real is os.write:
            real(args[0], bytes(args[1])[:7])
        raise OSError(err, os.strerror(err))

    return fake


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("name, on_call", [
    ("open", 1),  # creating the temp file
    ("write", 1),  # the header
    ("write", 2),  # the payload
    ("fsync", 1),  # the file
    ("fsync", 2),  # the folder, after the rename: the final file must go too
    ("replace", 1),
])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, err, name, on_call):
    monkeypatch.setattr(segments.os, name, failing(getattr(os, name), err, on_call))
    with pytest.raises(StorageError, match=os.strerror(err)) as info:
        write_segment(tmp_path, random_kv(), fingerprint=FP, layers=range(2), tokens=range(5))
    monkeypatch.undo()
    assert str(info.value).startswith("cannot save KV segment")
    assert debris(tmp_path) == []


def test_failed_write_keeps_other_segments(tmp_path, monkeypatch):
    kept = write_segment(tmp_path, random_kv(seed=1), fingerprint=FP, layers=range(2), tokens=range(5))
    monkeypatch.setattr(segments.os, "fsync", failing(os.fsync, errno.EIO))
    with pytest.raises(StorageError, match="Input/output error"):
        write_segment(tmp_path, random_kv(seed=2), fingerprint=FP, layers=range(2), tokens=range(5))
    monkeypatch.undo()
    assert debris(tmp_path) == [kept.file]
    read_segment(tmp_path / kept.file, fingerprint=FP)


def test_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot save KV segment"):
        write_segment(tmp_path / "file" / "sub", random_kv(), fingerprint=FP, layers=range(2), tokens=range(5))


# ----------------------------------------------------------------------------------------------------------- sweep


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep(tmp_path):
    refs = [write_segment(tmp_path, random_kv(seed=s), fingerprint=FP, layers=range(2), tokens=range(5))
            for s in range(3)]
    temp = tmp_path / f".tmp-{dead_pid()}-abcdef.kvs.part"
    temp.write_bytes(b"half a segment")
    (tmp_path / "notes.txt").write_text("not ours")
    # A fresh unreferenced segment may be another process's save about to commit: kept until it is old.
    assert sweep(tmp_path, {refs[0].file, refs[2].file, "gone.kvs"}) == [temp.name]
    removed = sweep(tmp_path, {refs[0].file, refs[2].file, "gone.kvs"}, orphan_age_s=0)
    assert removed == [refs[1].file]
    assert debris(tmp_path) == sorted([refs[0].file, refs[2].file, "notes.txt"])
    assert sweep(tmp_path, {refs[0].file, refs[2].file}, orphan_age_s=0) == []
    assert sweep(tmp_path / "never-made", set()) == []


def test_sweep_keeps_a_live_writers_temp_file(tmp_path):
    temp = tmp_path / f".tmp-{os.getpid()}-abcdef.kvs.part"
    temp.write_bytes(b"being written")
    assert sweep(tmp_path, set(), orphan_age_s=0) == [] and temp.exists()


def test_ref_is_plain_data():
    ref = SegmentRef(file="x.kvs", byte_size=1, raw_size=2, checksum="0" * 64, codec="zstd")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.file = "y.kvs"  # frozen: the database row and the file must not drift apart


def same_bits_kv(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_cold_and_cached_reads_give_the_same_bits(tmp_path, tokens):
    from kvchat.app.bench.engine_speed import drop_page_cache

    kv = random_kv(tokens=tokens, heads=4, head_dim=64, seed=tokens)
    ref = write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(tokens))
    drop_page_cache()  # where allowed
    assert same_bits_kv(read_segment(tmp_path / ref.file, fingerprint=FP)[1], kv)
    assert same_bits_kv(read_segment(tmp_path / ref.file, fingerprint=FP)[1], kv)


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path):
    kv = random_kv(tokens=5)
    ref = write_segment(tmp_path, kv, fingerprint=FP, layers=range(2), tokens=range(5))
    with open(tmp_path / ref.file, "ab") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte on paper, nothing on disk
    tracemalloc.start()
    with pytest.raises(SegmentCorrupt, match="more than its format allows"):
        read_segment(tmp_path / ref.file, fingerprint=FP, max_raw_size=1 << 20)
    assert tracemalloc.get_traced_memory()[1] < 1 << 22
    tracemalloc.stop()
