"""Lossless KV compression: exact round trips, refusal of frames that lie about their size, and the byte-plane gain."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import zstandard
from hypothesis import given, settings, strategies as st

from kvchat.storage.codec import CODECS, StorageError, decode, encode


@st.composite
def arrays(draw):
    """(raw bytes, element size): random length that is a whole number of values, empty included."""
    element_size = draw(st.sampled_from([2, 4]))
    n_values = draw(st.integers(0, 300))
    # Mix noise with runs so that zstd actually finds matches in some examples.
    raw = draw(st.one_of(
        st.binary(min_size=n_values * element_size, max_size=n_values * element_size),
        st.binary(min_size=element_size, max_size=element_size).map(lambda v: v * n_values),
    ))
    return raw, element_size


@settings(max_examples=150, deadline=None)
@given(arrays(), st.sampled_from(CODECS))
def test_round_trip(array, codec):
    raw, element_size = array
    blob = encode(raw, element_size, codec)
    assert zstandard.frame_content_size(blob) == len(raw)
    assert bytes(decode(blob, element_size, codec, len(raw))) == raw


def test_planes_are_byte_planes():
    blob = encode(bytes([1, 2, 3, 4, 5, 6]), 2, "planes+zstd")
    assert zstandard.ZstdDecompressor().decompress(blob) == bytes([1, 3, 5, 2, 4, 6])


def test_output_is_deterministic():
    raw = torch.randn(4096).bfloat16().view(torch.int16).numpy().tobytes()
    assert encode(raw, 2, "planes+zstd") == encode(raw, 2, "planes+zstd")


def test_bomb_is_refused_before_allocating():
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10  # a tiny frame that declares 64 MiB
    tracemalloc.start()
    try:
        with pytest.raises(StorageError, match="declares 67108864 bytes where 1000 were expected"):
            decode(bomb, 2, "zstd", raw_size=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_frame_without_content_size_is_refused():
    blob = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    assert zstandard.frame_content_size(blob) == -1
    with pytest.raises(StorageError, match="does not declare its size"):
        decode(blob, 2, "zstd", raw_size=1000)


@pytest.mark.parametrize("blob", [b"", b"not zstd at all", b"\x28\xb5\x2f\xfd"])
def test_garbage_is_refused(blob):
    with pytest.raises(StorageError, match="does not start with a valid zstd frame header"):
        decode(blob, 2, "planes+zstd", raw_size=1000)


def test_damaged_frame_is_refused():
    raw = torch.randn(10_000, generator=torch.Generator().manual_seed(1)).bfloat16().view(torch.int16)
    raw = raw.numpy().tobytes()
    blob = bytearray(encode(raw, 2, "zstd"))
    blob[len(blob) // 2] ^= 0x01  # past the frame header, so the declared size stays valid
    with pytest.raises(StorageError, match="corrupt .decompression error: Restored data doesn't match checksum"):
        decode(bytes(blob), 2, "zstd", raw_size=len(raw))
    with pytest.raises(StorageError, match="corrupt .decompression error: did not decompress full frame"):
        decode(bytes(blob[: len(blob) // 2]), 2, "zstd", raw_size=len(raw))


def test_unknown_codec_names_the_accepted_ones():
    for call in (lambda: encode(b"", 2, "lz4"), lambda: decode(b"", 2, "lz4", 0)):
        with pytest.raises(StorageError, match="zstd, planes\\+zstd"):
            call()


def test_partial_values_are_refused():
    with pytest.raises(ValueError, match="3 bytes are not a whole number of 2-byte values"):
        encode(b"abc", 2, "zstd")
    with pytest.raises(StorageError, match="6 bytes of KV data are not a whole number of 4-byte values"):
        decode(encode(b"abcd", 2, "zstd"), 4, "zstd", raw_size=6)


def ratio(raw: bytes, element_size: int, codec: str) -> float:
    return len(encode(raw, element_size, codec, level=3)) / len(raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_planes_compress_floats_better(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g).to(dtype)
    raw = (x.view(torch.int16) if dtype == torch.bfloat16 else x).numpy().tobytes()
    planes, plain = ratio(raw, x.element_size(), "planes+zstd"), ratio(raw, x.element_size(), "zstd")
    print(f"\n{dtype} randn, 1M values, level 3: planes+zstd {planes:.4f}, zstd {plain:.4f} (compressed / raw)")
    assert planes < plain
