"""KV segment files: the K/V of one dialogue round for one group of layers, compressed, one file each.

A file is a fixed little-endian header followed by the encoded payload:

    magic b"KVCS" | version u16 | header length u16 | model fingerprint 32 bytes (sha256) | dtype u8 | codec u8 |
    ndim u8 | ndim x u32 shape | layer_start u32 | layer_end u32 | token_start u32 | token_end u32 |
    raw_size u64 | payload_size u64 | payload sha256 32 bytes | payload ...

Files are named by the sha256 of their whole content, so identical K/V is stored once, a name can be shared by
several chats, and a file that no longer hashes to its name is known to be damaged. A segment is only a cache: every
way of reading it wrong is reported as a StorageError subclass, and the caller recomputes.

A segment of kind "key-bounds" holds a round's key bounds instead of its K/V, in the same format with blocks of tokens
in place of tokens ([layers, 2 (min, max), Hkv, blocks, D]); the header does not record the kind, the database row does.
A segment of kind "units" holds a round's retrieval units (storage.db.SEGMENT_UNITS: [global layers, 2, Hkv, rows, D]
within the model's layer range, 1 <= rows <= tokens; uint8 since 2026-11-29, bfloat16 or float32 before:
app/session/units.py).
A segment of kind "merged" holds two layers' K/V merged (engine.kv.cross_layer: [2, 2, Hkv, tokens + retained, D]); its
layer range runs from the lower layer to the higher one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import math
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvchat.storage import codec as kvcodec
from kvchat.storage.codec import CODECS, StorageError
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, SEGMENT_UNITS, check_segment_kind
from kvchat.storage.failpoints import crash_point

if TYPE_CHECKING:
    from kvchat.storage.staging import HostToDevice

FORMAT_VERSION = 1
MAGIC = b"KVCS"
SUFFIX = ".kvs"
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".kvs.part"

# Index = the code stored in the file; never reorder, only append.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)  # uint8: units alone (8-bit centroids' bytes)
# numpy has no bfloat16: its bits travel as int16. Explicit little-endian so files mean the same on every host.

_PREFIX = struct.Struct("<4sHH32sBBB")  # magic .. ndim
_DIM = struct.Struct("<I")
_TAIL = struct.Struct("<IIIIQQ32s")  # layer_start .. payload sha256
_U32_MAX = (1 << 32) - 1
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER = _PREFIX.size + 255 * _DIM.size + _TAIL.size  # ndim is one byte


class SegmentMissing(StorageError):
    """The segment file does not exist (deleted, swept, or never written)."""


class SegmentCorrupt(StorageError):
    """The segment file exists but is damaged, truncated, or in a format this version cannot read."""


class SegmentWrongModel(StorageError):
    """The segment is intact but was computed by a different model (or model file) than the one loaded."""


@dataclass(frozen=True)
class SegmentRef:
    """What the database stores to find a segment again."""

    file: str  # "<sha256 of the whole file>.kvs"
    byte_size: int  # bytes on disk
    raw_size: int  # bytes of the uncompressed tensor
    checksum: str  # sha256 hex of the payload
    codec: str


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    header_size: int
    fingerprint: str  # sha256 hex of the model
    dtype: torch.dtype
    codec: str
    shape: tuple[int, ...]
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    raw_size: int
    payload_size: int
    checksum: str  # sha256 hex of the payload

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def tokens(self) -> range:
        return range(self.token_start, self.token_end)

    def pack(self) -> bytes:
        return b"".join((
            _PREFIX.pack(MAGIC, self.version, self.header_size, bytes.fromhex(self.fingerprint),
                         DTYPES.index(self.dtype), CODECS.index(self.codec), len(self.shape)),
            *(_DIM.pack(d) for d in self.shape),
            _TAIL.pack(self.layer_start, self.layer_end, self.token_start, self.token_end,
                       self.raw_size, self.payload_size, bytes.fromhex(self.checksum)),
        ))


def header_size(ndim: int) -> int:
    return _PREFIX.size + ndim * _DIM.size + _TAIL.size


# ----------------------------------------------------------------------------------------------------------- write


def write_segment(folder: Path, kv: torch.Tensor, *, fingerprint: str, layers: range, tokens: range,
                  codec: str = "planes+zstd", kind: str = SEGMENT_KV) -> SegmentRef:
    """Save `kv` ([len(layers), 2, Hkv, len(tokens), D], any device, fp32/bf16/fp16) durably under `folder`; for
    kind "key-bounds", the keys' per-block min and max ([len(layers), 2, Hkv, blocks, D], 1 <= blocks <= len(tokens)).

    When this returns, the file is on disk and survives a crash; when it raises StorageError, nothing new is left
    in `folder`.
    """
    _check_fingerprint(fingerprint)
    _check_kv(kv, layers, tokens, kind)
    if codec not in CODECS:
        raise StorageError(f"unknown KV codec {codec!r}; accepted codecs are {', '.join(CODECS)}.")
    raw_size = kv.numel() * kv.element_size()
    payload = kvcodec.compress(_host_bytes(kv, split_planes=codec == "planes+zstd"))
    header = SegmentHeader(
        version=FORMAT_VERSION, header_size=header_size(kv.dim()), fingerprint=fingerprint.lower(), dtype=kv.dtype,
        codec=codec, shape=tuple(kv.shape), layer_start=layers.start, layer_end=layers.stop,
        token_start=tokens.start, token_end=tokens.stop, raw_size=raw_size, payload_size=len(payload),
        checksum=hashlib.sha256(payload).hexdigest(),
    )
    head = header.pack()
    name = place_content_addressed(Path(folder), (head, payload), "KV segment")
    return SegmentRef(file=name, byte_size=len(head) + len(payload), raw_size=raw_size, checksum=header.checksum,
                      codec=codec)


def place_content_addressed(folder: Path, parts: tuple[bytes, ...], what: str) -> str:
    """Durably place a file of `parts` under `folder`, named by the sha256 of its content; its name. On
    StorageError nothing new is left in `folder`."""
    name = _whole_file_hash(*parts) + SUFFIX
    try:
        _ensure_folder(folder)
        # Content addressing: an intact file of that name already holds exactly these bytes. A damaged one is
        # replaced, so recomputing after a SegmentCorrupt actually repairs the store.
        if not _intact(folder / name):
            _write_atomically(folder, name, parts)
    except OSError as e:
        raise StorageError(f"cannot save {what} in {folder}: {_reason(e)}.") from e
    return name


def _check_fingerprint(fingerprint: str) -> None:
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", fingerprint):
        raise ValueError(f"model fingerprint must be a sha256 hex string (64 hex digits), not {fingerprint!r}")


def _check_kv(kv: torch.Tensor, layers: range, tokens: range, kind: str) -> None:
    check_segment_kind(kind)
    name, rows = {SEGMENT_KV: ("K/V", "tokens"), SEGMENT_UNITS: ("units", "rows")}.get(kind, ("key bounds", "blocks"))
    if kv.dtype not in DTYPES:
        raise ValueError(f"{name} of dtype {kv.dtype} cannot be saved; supported: {', '.join(map(str, DTYPES))}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"{name} must be [layers, 2, kv_heads, {rows}, head_dim], not {list(kv.shape)}")
    for what, r in (("layers", layers), ("tokens", tokens)):
        if r.step != 1 or not 0 <= r.start <= r.stop <= _U32_MAX:
            raise ValueError(f"{what} {r} must be a contiguous range of non-negative 32-bit indices")
    if kind == SEGMENT_UNITS and kv.dtype not in (torch.uint8, torch.bfloat16, torch.float32):
        # uint8 (8-bit centroids and int16 members as bytes), bfloat16 (a token's unit in the bits of an int16) as
        # chats saved before 2026-11-29 hold, or float32 as those before 2026-11-28
        raise ValueError(f"units are uint8, bfloat16 or float32 (a token's unit is a number in them), not {kv.dtype}")
    if kind != SEGMENT_UNITS and kv.dtype == torch.uint8:
        raise ValueError(f"{name} of dtype {kv.dtype} cannot be saved: bytes are units' alone")
    if not layer_rows_fit(kind, kv.shape[0], len(layers)):
        raise ValueError(f"{name} for layers {layers} must hold {len(layers)} layers, not {kv.shape[0]}")
    if not token_rows_fit(kind, kv.shape[3], len(tokens)):
        allowed = {SEGMENT_KV: len(tokens), SEGMENT_MERGED: f"{len(tokens)} to {2 * len(tokens)}"}.get(
            kind, f"1 to {len(tokens)}")
        raise ValueError(f"{name} for tokens {tokens} must hold {allowed} {rows}, not {kv.shape[3]}")
    if any(d > _U32_MAX for d in kv.shape):
        raise ValueError(f"K/V shape {list(kv.shape)} does not fit the segment format")


def token_rows_fit(kind: str | None, rows: int, n_tokens: int) -> bool:
    """Whether a segment's dimension 3 fits its token range: one row per token for K/V, 1 to n_tokens blocks for
    key bounds, n_tokens to 2 n_tokens (the retained tokens after them) merged. kind None (a file read without its
    database row) accepts any."""
    per_token, blocks, merged = rows == n_tokens, 1 <= rows <= n_tokens, 1 <= n_tokens <= rows <= 2 * n_tokens
    if kind is None:
        return per_token or blocks or merged
    return {SEGMENT_KV: per_token, SEGMENT_MERGED: merged}.get(kind, blocks)


def layer_rows_fit(kind: str | None, rows: int, n_layers: int) -> bool:
    """Whether a segment's dimension 0 fits its layer range: one row per layer, or the two ends of a merged pair."""
    merged = rows == 2 and n_layers >= 2
    if kind is None:
        return rows == n_layers or merged or 1 <= rows <= n_layers
    if kind == SEGMENT_UNITS:  # the global layers among them
        return 1 <= rows <= n_layers
    return merged if kind == SEGMENT_MERGED else rows == n_layers


def _host_bytes(kv: torch.Tensor, split_planes: bool) -> np.ndarray:
    """The tensor's little-endian bytes on the host, split into byte planes first when asked. The split runs
    where the tensor lives, so on a GPU the host sees one plain copy and the CPU does no byte shuffling."""
    flat = kv.detach().contiguous().view(torch.uint8).reshape(-1)
    if split_planes and flat.numel():
        flat = flat.view(-1, kv.element_size()).t().contiguous().reshape(-1)
    return flat.cpu().numpy()


def _whole_file_hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _ensure_folder(folder: Path) -> None:
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    # The new folder's own entry must reach the disk too, or a crash could lose every segment inside it.
    _fsync_dir(folder.parent)


def _intact(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            h = hashlib.sha256()
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except FileNotFoundError:
        return False
    return h.hexdigest() + SUFFIX == path.name


def _write_atomically(folder: Path, name: str, parts: tuple[bytes, ...]) -> None:
    """Temp file, fsync, rename, fsync the folder: readers see the whole file or none, even after a power cut."""
    tmp = folder / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{TEMP_SUFFIX}"
    final = folder / name
    renamed = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                _write_all(fd, part)
            crash_point("segment-written")
            os.fsync(fd)
            crash_point("segment-fsynced")
        finally:
            os.close(fd)
        os.replace(tmp, final)
        renamed = True
        crash_point("segment-renamed")
        _fsync_dir(folder)
    except BaseException:
        # Unlinking both is safe: the caller found no intact file of this name, so none of it predates this call.
        _unlink_quietly(tmp)
        if renamed:
            _unlink_quietly(final)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # a write that makes no progress would loop forever
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        view = view[n:]


def _fsync_dir(folder: Path) -> None:
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:  # Windows cannot open (nor fsync) a directory; its renames are durable enough without it
        return
    fd = os.open(folder, os.O_RDONLY | flag)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else (e.strerror or str(e))


# ------------------------------------------------------------------------------------------------------------ read


def read_segment(path: Path, *, fingerprint: str, max_raw_size: int = 1 << 34,
                 device: torch.device | str = "cpu") -> tuple[SegmentHeader, torch.Tensor]:
    """The header and the tensor of a segment, on the CPU in the stored dtype, bit for bit as written.

    Raises SegmentMissing, SegmentCorrupt or SegmentWrongModel (all StorageError) instead of returning anything
    that was not verified.
    """
    header, raw = read_segment_bytes(path, fingerprint=fingerprint, max_raw_size=max_raw_size)
    return header, tensor_on(header, raw, device)


def read_segment_bytes(path: Path, *, fingerprint: str, max_raw_size: int = 1 << 34) -> tuple[SegmentHeader, bytes]:
    """The host half of read_segment (read, verify, decompress; no GPU work); `tensor_on` is the other half."""
    path = Path(path)
    return decode_segment(read_segment_file(path, max_raw_size), path, fingerprint=fingerprint,
                          max_raw_size=max_raw_size)


def read_segment_file(path: Path, max_raw_size: int = 1 << 34) -> memoryview:
    """The file's bytes, unchecked: the disk's share of a read, kept apart so that restores can keep many reads in
    flight while other threads verify and decompress."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_raw_size + (max_raw_size >> 6) + (1 << 16):  # zstd never grows data by more than this
                raise SegmentCorrupt(f"KV segment {path.name} is corrupt: it is {size} bytes, more than its "
                                     f"format allows.")
            data = memoryview(np.empty(size, dtype=np.uint8))  # not zero-filled (a bytearray is, holding the GIL)
            got = f.readinto(data) if size else 0
            while 0 < got < size:
                n = f.readinto(data[got:])
                if not n:
                    break
                got += n
    except FileNotFoundError:
        raise SegmentMissing(f"KV segment {path.name} is missing.") from None
    except OSError as e:
        raise StorageError(f"cannot read KV segment {path.name}: {_reason(e)}.") from e
    if got != size:
        raise SegmentCorrupt(f"KV segment {path.name} is corrupt: it changed size while being read.")
    return data


def decode_segment(data: memoryview | bytes, path: Path, *, fingerprint: str | None,
                   max_raw_size: int = 1 << 34) -> tuple[SegmentHeader, bytes]:
    """Check a segment's bytes (header, sizes, content hash, model) and decompress its payload. CPU only, and
    hashing and zstd release the GIL, so many threads decode at once. fingerprint None skips the model check."""
    path = Path(path)
    if fingerprint is not None:
        _check_fingerprint(fingerprint)
    header, head = _read_header(io.BytesIO(bytes(data[:_MAX_HEADER])), path, len(data), max_raw_size)
    payload = memoryview(data)[len(head):]
    _verify(path, header, head, payload)
    if fingerprint is not None and header.fingerprint != fingerprint.lower():
        raise SegmentWrongModel(f"KV segment {path.name} was computed by a different model.")
    return header, _decompress(payload, header, path.name)


def tensor_on(header: SegmentHeader, raw: bytes, device: torch.device | str = "cpu",
              staging: HostToDevice | None = None) -> torch.Tensor:
    """The segment's tensor on `device` from its decompressed bytes. For a GPU the bytes travel through pinned
    buffers (`staging`, or the process's own) and the planes are merged on the GPU."""
    from kvchat.storage.staging import HostToDevice

    device = torch.device(device)
    if device.type == "cpu":
        data = np.frombuffer(raw, dtype=np.uint8)
        if not data.size:
            return torch.empty(header.shape, dtype=header.dtype)
        values = kvcodec.from_planes(data, header.dtype.itemsize) if header.codec == "planes+zstd" else data.copy()
        return torch.from_numpy(values).view(header.dtype).reshape(header.shape)  # owns its memory
    return merge_planes(header, (staging or HostToDevice.shared(device)).copy(raw).wait())


def merge_planes(header: SegmentHeader, flat: torch.Tensor) -> torch.Tensor:
    """The segment's tensor from its decoded bytes (a uint8 tensor on any device): byte planes merged back into
    values (a byte transpose: on the GPU it costs nothing next to the disk read), then shaped."""
    if header.codec == "planes+zstd" and flat.numel() and header.dtype.itemsize > 1:  # (bytes: one plane)
        flat = flat.view(header.dtype.itemsize, -1).t().contiguous().reshape(-1)
    return flat.view(header.dtype).reshape(header.shape)


def _decompress(payload: bytes, header: SegmentHeader, name: str) -> bytes:
    try:
        return kvcodec.decompress(payload, header.raw_size)
    except StorageError as e:
        raise SegmentCorrupt(f"KV segment {name} cannot be decoded: {e}") from None


def _read_header(f, path: Path, file_size: int, max_raw_size: int) -> tuple[SegmentHeader, bytes]:
    """The parsed header and its bytes, after checking that every size in it is consistent and affordable."""
    def corrupt(why: str) -> SegmentCorrupt:
        return SegmentCorrupt(f"KV segment {path.name} is corrupt: {why}.")

    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise corrupt("it is shorter than a header")
    magic, version, size, fp, dtype_code, codec_code, ndim = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise corrupt("it is not a KV segment file")
    if version != FORMAT_VERSION:
        raise corrupt(f"format version {version} is not {FORMAT_VERSION}")
    if size != header_size(ndim):
        raise corrupt(f"its header length {size} does not match its {ndim} dimensions")
    rest = f.read(size - _PREFIX.size)
    if len(rest) < size - _PREFIX.size:
        raise corrupt("it is shorter than its header")
    if dtype_code >= len(DTYPES):
        raise corrupt(f"dtype code {dtype_code} is unknown")
    if codec_code >= len(CODECS):
        raise corrupt(f"codec code {codec_code} is unknown")
    shape = struct.unpack_from(f"<{ndim}I", rest)
    l0, l1, t0, t1, raw_size, payload_size, checksum = _TAIL.unpack_from(rest, ndim * _DIM.size)
    header = SegmentHeader(
        version=version, header_size=size, fingerprint=fp.hex(), dtype=DTYPES[dtype_code], codec=CODECS[codec_code],
        shape=shape, layer_start=l0, layer_end=l1, token_start=t0, token_end=t1, raw_size=raw_size,
        payload_size=payload_size, checksum=checksum.hex(),
    )
    # Every size is checked against the others and the file before a byte is read or decompressed, so a damaged
    # or hostile header cannot make us allocate more than max_raw_size.
    if size + payload_size != file_size:
        raise corrupt(f"it is {file_size} bytes but its header accounts for {size + payload_size}")
    if raw_size > max_raw_size:
        raise corrupt(f"it declares {raw_size} raw bytes, more than the {max_raw_size} allowed")
    if math.prod(shape) * header.dtype.itemsize != raw_size:
        raise corrupt(f"shape {list(shape)} of {header.dtype} does not make {raw_size} bytes")
    # The header does not record the kind, so dimension 3 may be one row per token (K/V), fewer (key bounds) or
    # more (merged), and dimension 0 one per layer or the two ends of a merged pair.
    if ndim != 5 or shape[1] != 2 or l0 > l1 or t0 > t1 or not layer_rows_fit(None, shape[0], l1 - l0) or \
            not token_rows_fit(None, shape[3], t1 - t0):
        raise corrupt(f"shape {list(shape)} does not match layers [{l0}, {l1}) and tokens [{t0}, {t1})")
    return header, prefix + rest


def _verify(path: Path, header: SegmentHeader, head: bytes, payload: bytes) -> None:
    # A content-addressed name covers header and payload in one pass (the payload checksum alone cannot see a
    # damaged header: a flipped fingerprint or range would go unnoticed). Files renamed by hand are still readable,
    # with the payload check only.
    stem = path.name.removesuffix(SUFFIX)
    if path.name.endswith(SUFFIX) and _SHA256_NAME.fullmatch(stem):
        if _whole_file_hash(head, payload) != stem:
            raise SegmentCorrupt(f"KV segment {path.name} is corrupt: its content does not match its name.")
    elif hashlib.sha256(payload).hexdigest() != header.checksum:
        raise SegmentCorrupt(f"KV segment {path.name} is corrupt: its payload checksum does not match.")


# ----------------------------------------------------------------------------------------------------------- sweep


def sweep(folder: Path, referenced: set[str], orphan_age_s: float = 300.0) -> list[str]:
    """Delete the leftovers of interrupted saves; return the names removed.

    Another kvchat process may be saving right now, and its files look exactly like leftovers until it commits.
    So a temp file goes only when the process that wrote it (its pid is in the name) is gone, and a segment file no
    row references only when it is older than `orphan_age_s` (a save commits its row within moments).
    """
    folder = Path(folder)
    removed = []
    try:
        entries = sorted(e.name for e in os.scandir(folder) if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return removed
    except OSError as e:
        raise StorageError(f"cannot list KV segments in {folder}: {_reason(e)}.") from e
    now = time.time()
    for name in entries:
        is_temp = name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX) and not _writer_alive(name)
        is_orphan = name.endswith(SUFFIX) and name not in referenced and _age(folder / name, now) >= orphan_age_s
        if not (is_temp or is_orphan):
            continue
        try:
            os.unlink(folder / name)
        except FileNotFoundError:  # someone else swept it first
            continue
        except OSError as e:
            raise StorageError(f"cannot delete KV segment {name} in {folder}: {_reason(e)}.") from e
        removed.append(name)
    return removed


def _writer_alive(temp_name: str) -> bool:
    try:
        pid = int(temp_name[len(TEMP_PREFIX):].split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


# ------------------------------------------------------------------------------------------- segments in memory


def parse_segment(data: bytes, name: str, *, fingerprint: str | None,
                  max_raw_size: int = 1 << 34) -> tuple[SegmentHeader, torch.Tensor]:
    """Like read_segment, for a segment held in memory (a state file's blob): every check, nothing written.
    With fingerprint None the model is not checked (the importer decides what a foreign model's K/V means)."""
    header, raw = decode_segment(data, Path(name), fingerprint=fingerprint, max_raw_size=max_raw_size)
    return header, tensor_on(header, raw, "cpu")


def store_segment_bytes(folder: Path, name: str, data: bytes) -> None:
    """Durably place an already verified segment file (content-addressed `name`) in `folder`."""
    try:
        _ensure_folder(folder)
        if not _intact(folder / name):
            _write_atomically(folder, name, (data,))
    except OSError as e:
        raise StorageError(f"cannot save KV segment in {folder}: {_reason(e)}.") from e
