"""Opening GGUF files: header sanity checks first, then gguf's memory-mapped reader, with every failure turned into
one GGUFError sentence.

gguf.GGUFReader trusts the file: a truncated or garbled file surfaces as IndexError, ValueError, KeyError or
struct errors deep inside it, and absurd counts would make it loop. We check what is cheap to check before it runs
and translate whatever it raises afterwards.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from kvchat.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Far beyond any real model (Llama-3.1-405B has ~1,100 tensors and ~40 metadata keys besides the vocab arrays).
MAX_TENSORS = 100_000
MAX_KV = 100_000
# Arrays we never need to turn into Python lists: the tokenizer reads them itself through llama.cpp.
_LAZY_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}


class _PastTheEnd(Exception):
    """What the file's header and metadata describe runs past its last byte."""


class _Reader(GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its memory map: a numpy memmap pays for a subclass
    finalizer on every slice, and the reader slices once per vocabulary entry (three times 262k for Gemma 3's
    vocabulary: 10 s of a 12 s load on a 2-core CPU, 4x less this way). The slices are the same bytes."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        end = offset + int(np.dtype(dtype).itemsize) * count
        if end > len(plain):  # numpy would say why it cannot view or reshape the short slice, not that it is short
            raise _PastTheEnd(end)
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows..., row_length), the reverse of GGUF's ne[]
    data: np.ndarray  # the raw bytes as stored (uint8 view into the memory map, or typed for float types)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensors (memory-mapped, not yet dequantized)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        _check_header(self.path)
        try:
            reader = _Reader(self.path, "r")
        except _PastTheEnd as exc:
            raise GGUFError(f"{self.path}: truncated GGUF file: it holds {self.path.stat().st_size:,} bytes, its "
                            f"metadata and tensors need at least {exc.args[0]:,}") from None
        except Exception as exc:  # noqa: BLE001 - the reader raises many kinds on corrupt input; all mean the same
            raise GGUFError(f"{self.path}: not a readable GGUF file ({_describe(exc)})") from None
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        try:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key in _LAZY_ARRAYS:
                    continue
                self.metadata[key] = _field_value(field)
            self.tensors: dict[str, TensorInfo] = {t.name: _tensor_info(t) for t in reader.tensors}
        except GGUFError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise GGUFError(f"{self.path}: garbled GGUF metadata ({_describe(exc)})") from None
        self._check_tensor_bounds()

    def array_length(self, key: str) -> int:
        """Length of a metadata array without converting it (vocabulary arrays hold 100k+ strings)."""
        field = self._reader.fields.get(key)
        return 0 if field is None else len(field.data)

    def array(self, key: str) -> list:
        """A metadata array in full, the vocabulary's too (`metadata` leaves those out)."""
        field = self._reader.fields.get(key)
        return [] if field is None else list(field.contents())

    def _check_tensor_bounds(self) -> None:
        file_size = self.path.stat().st_size
        for t in self.tensors.values():
            block, type_size = GGML_QUANT_SIZES[t.qtype]
            if t.shape[-1] % block:
                raise GGUFError(f"{self.path}: tensor {t.name} has rows of {t.shape[-1]}, not a multiple of {block}")
            needed = t.n_elements // block * type_size
            if t.data.nbytes != needed or t.data.ctypes.data == 0:
                raise GGUFError(f"{self.path}: tensor {t.name} is truncated (the file holds {file_size} bytes)")


def _check_header(path: Path) -> None:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a file")
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic or too short); kvchat reads GGUF models of the "
                        f"{', '.join(SUPPORTED_ARCHS)} architectures")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise GGUFError(f"{path}: garbled GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")


def _field_value(field) -> Any:
    main = field.types[0] if field.types else None
    if main == GGUFValueType.ARRAY:
        return field.contents()
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _tensor_info(t) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(int(t.tensor_type))
    except ValueError:
        raise GGUFError(f"tensor {t.name} has unknown type id {int(t.tensor_type)}") from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if any(d <= 0 for d in shape):
        raise GGUFError(f"tensor {t.name} has an empty dimension {shape}")
    return TensorInfo(name=t.name, qtype=qtype, shape=shape, data=t.data)


def _describe(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__
