"""Lossless compression of KV cache bytes.

K/V values are floats whose high bytes (sign, exponent) repeat a lot while their low bytes (mantissa) are close to
noise. Interleaved, the two kinds dilute each other's statistics; split into byte planes ("all first bytes, then all
second bytes, ...") zstd sees one long run of low-entropy bytes and one of high-entropy bytes, and the exponent plane
shrinks a lot. That is "planes+zstd"; plain "zstd" is kept as the baseline and for data that is not floats.
"""

from __future__ import annotations

import numpy as np
import zstandard

from kvchat.errors import KvchatError

CODECS = ("zstd", "planes+zstd")


class StorageError(KvchatError):
    """Saved KV data that cannot be written, found or trusted; the chat can always be recomputed instead."""


def encode(raw: bytes, element_size: int, codec: str, level: int = 3) -> bytes:
    """Compress `raw`, an array of `element_size`-byte values, into one zstd frame that declares its content size."""
    _check_codec(codec)
    if not _whole_values(len(raw), element_size):
        # The caller's bytes, not saved data: a bug, not a storage problem.
        raise ValueError(f"{len(raw)} bytes are not a whole number of {element_size}-byte values")
    data = _to_planes(raw, element_size) if codec == "planes+zstd" else raw
    return compress(data, level)


def compress(data, level: int = 3) -> bytes:
    """One zstd frame declaring its content size (`data`: any buffer, e.g. planes already split on the GPU)."""
    # Single-threaded on purpose: the output must be a pure function of the input, because segment files are named
    # by the hash of their content and identical K/V must land in the same file. The frame's own checksum (4 bytes)
    # makes damage show up as an error here rather than as plausible wrong floats, whatever the container checks.
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(data)


def decode(blob: bytes, element_size: int, codec: str, raw_size: int) -> bytes | bytearray | np.ndarray:
    """Inverse of `encode`; `raw_size` is what the caller expects back, and nothing larger is ever allocated.

    Bytes after the zstd frame are ignored: the integrity of the blob as a whole is the container's job (segment
    files hash their payload).
    """
    _check_codec(codec)
    if not _whole_values(raw_size, element_size):
        raise StorageError(f"{raw_size} bytes of KV data are not a whole number of {element_size}-byte values.")
    out = decompress(blob, raw_size)
    # A writable buffer either way, so the tensor made from it owns writable memory.
    return from_planes(out, element_size) if codec == "planes+zstd" else bytearray(out)


def decompress(blob: bytes, raw_size: int) -> bytes:
    """The frame's content, refusing any frame that does not declare exactly
    `raw_size` bytes (planes are left as they are: the caller merges them, on the GPU when there is one)."""
    # The frame header is attacker-controlled size information: it is read, and refused, before anything is
    # allocated, so a tiny frame declaring gigabytes (a "zip bomb") costs nothing.
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError:
        raise StorageError("compressed KV data does not start with a valid zstd frame header.") from None
    if declared == -1:
        raise StorageError("compressed KV data does not declare its size, so it cannot be decompressed safely.")
    if declared != raw_size:
        raise StorageError(f"compressed KV data declares {declared} bytes where {raw_size} were expected.")
    try:
        # One call that drops the GIL for the whole frame, so restores decode segments on many threads at once.
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=raw_size)
    except zstandard.ZstdError as e:
        raise StorageError(f"compressed KV data is corrupt ({e}).") from None
    if len(out) != raw_size:
        raise StorageError(f"compressed KV data decompressed to {len(out)} bytes where {raw_size} were expected.")
    return out


def _to_planes(raw: bytes, element_size: int) -> np.ndarray:
    # A C-contiguous array is handed to zstd as a buffer: no extra bytes copy.
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, element_size).T.copy()


def from_planes(planes, element_size: int) -> np.ndarray:
    """The interleaved bytes as a flat uint8 array that owns its memory: one copy, plane by plane into strided
    columns (4-5x faster than a transposing copy, and numpy drops the GIL, so reader threads merge side by side)."""
    src = np.frombuffer(planes, dtype=np.uint8).reshape(element_size, -1)
    values = np.empty((src.shape[1], element_size), dtype=np.uint8)
    for i in range(element_size):
        values[:, i] = src[i]
    return values.reshape(-1)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise StorageError(f"unknown KV codec {codec!r}; accepted codecs are {', '.join(CODECS)}.")


def _whole_values(n_bytes: int, element_size: int) -> bool:
    return element_size >= 1 and n_bytes >= 0 and n_bytes % element_size == 0
