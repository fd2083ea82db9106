"""Dequantizing GGUF tensor data with whole-tensor torch ops, on whatever device the raw bytes live on.

The block layouts are ggml's (llama.cpp ggml-common.h); gguf.quants holds the numpy reference we are tested
against, bit for bit. Every decoder repeats its float32 operations in the reference's order (e.g. `(d * sc) * q - dm`,
never `d * (sc * q)`), because float multiplication is not associative and we promise exact equality.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_T = GGMLQuantizationType

# Elements decoded per pass, which bounds the temporaries (a few bytes per element, plus the float32 scratch for
# non-float32 output) however large the tensor. On CPU a pass that fits in cache lets the in-place float ops reread
# it cheaply; on CUDA larger passes mean fewer kernel launches, and 16M elements keep temporaries under 256 MiB.
_CPU_PASS_ELEMS = 1 << 20
_CUDA_PASS_ELEMS = 1 << 24


def _pass_elems(device: torch.device) -> int:
    return _CPU_PASS_ELEMS if device.type == "cpu" else _CUDA_PASS_ELEMS


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as float32 of shape (n_blocks, 1)."""
    # contiguous() first: a column slice of the blocks cannot be reinterpreted in place as 2-byte values.
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Splits bytes into 4-bit values: each run of `group` bytes gives its low nibbles, then its high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, -1)


def _bits(qh: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """Splits bytes into `width`-bit fields: each run of `group` bytes gives field 0 of every byte, then field 1, ..."""
    n = qh.shape[0]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=qh.device).reshape(1, 1, -1, 1)
    return ((qh.reshape(n, -1, 1, group) >> shifts) & ((1 << width) - 1)).reshape(n, -1)


def _reinterpret(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return blocks.view(dtype)
    except RuntimeError:
        # The bytes start at an offset not aligned to the element size (a slice of a larger buffer): copy first.
        return blocks.clone().view(dtype)


# Each decoder turns uint8 blocks of shape (n_blocks, type_size) into float32 written to `out`, of shape
# (n_blocks, block_size). Integer work stays in (u)int8, offsets included, and the float math runs in place on `out`:
# fresh full-size float temporaries would cost a pass of memory traffic (and page faults) each.


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_reinterpret(blocks, torch.float32))


def _f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_reinterpret(blocks, torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_reinterpret(blocks, torch.bfloat16))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: fp16, then 32 signed bytes.
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_fp16(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: fp16, then 16 bytes of nibbles (low nibbles are elements 0-15, high nibbles 16-31), offset by 8.
    out.copy_(_nibbles(blocks[:, 2:], 16).view(torch.int8) - 8)
    out.mul_(_fp16(blocks, 0))


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: fp16, qh: a little-endian uint32 whose bit i is the 5th bit of element i, then Q4_0's nibbles; offset 16.
    qh = _bits(blocks[:, 2:6], 1, 1)
    out.copy_((_nibbles(blocks[:, 6:], 16) | (qh << 4)).view(torch.int8) - 16)
    out.mul_(_fp16(blocks, 0))


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's sub-block scales d * sc and mins dmin * m, as float32 of shape (n_blocks, 8, 1).

    Bytes 4-15 pack the 6-bit sc and m of the 8 sub-blocks: bytes 4-7 hold sc 0-3 and bytes 8-11 m 0-3 in their low
    6 bits; for sub-blocks 4-7 the low 4 bits sit in the nibbles of bytes 12-15 and the high 2 bits in the top bits
    of bytes 4-7 (sc) and 8-11 (m).
    """
    n = blocks.shape[0]
    lo_sc, lo_m, hi = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = torch.cat((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)), dim=1)
    m = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)), dim=1)
    dl = _fp16(blocks, 0) * sc.float()
    ml = _fp16(blocks, 2) * m.float()
    return dl.reshape(n, 8, 1), ml.reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, dmin: fp16; 12 bytes of scales/mins; 128 bytes of nibbles, each 32-byte run giving two 32-element sub-blocks.
    dl, ml = _k_scales_mins(blocks)
    out.copy_(_nibbles(blocks[:, 16:], 32))
    out.view(-1, 8, 32).mul_(dl).sub_(ml)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # As Q4_K, with 32 bytes of qh in between: bit j of qh byte i is the 5th bit of element i of sub-block j.
    dl, ml = _k_scales_mins(blocks)
    qh = _bits(blocks[:, 16:48], 1, 32)
    out.copy_(_nibbles(blocks[:, 48:], 32) | (qh << 4))
    out.view(-1, 8, 32).mul_(dl).sub_(ml)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # 128 bytes of low nibbles (in 64-byte runs), 64 bytes of 2-bit high parts (in 32-byte runs), 16 int8 scales
    # (one per 16 elements), then d: fp16 last. Values are offset by 32.
    ql = _nibbles(blocks[:, :128], 64)
    qh = _bits(blocks[:, 128:192], 2, 32)
    out.copy_((ql | (qh << 4)).view(torch.int8) - 32)
    dl = _fp16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()
    out.view(-1, 16, 16).mul_(dl.unsqueeze(-1))


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    _T.F32: _f32,
    _T.F16: _f16,
    _T.BF16: _bf16,
    _T.Q8_0: _q8_0,
    _T.Q4_0: _q4_0,
    _T.Q5_0: _q5_0,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)


def _check_type(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML tensor type {qtype!r}") from None
    if qtype not in _DECODERS:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"GGML tensor type {qtype.name} is not supported (supported: {names})")
    return qtype


def _n_elements(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        if dim < 0:
            raise ValueError(f"tensor shape {tuple(shape)} has a negative dimension")
        n *= dim
    return n


def byte_size(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes that a tensor of `shape` (torch order, row length last) occupies in a GGUF file as `qtype`."""
    qtype = _check_type(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if len(shape) else 1
    if row % block_size:
        raise ValueError(f"row length {row} is not a multiple of the {qtype.name} block size {block_size}")
    return _n_elements(shape) // block_size * type_size


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decodes a GGUF tensor's stored bytes into a tensor of `shape` and `dtype` on raw.device.

    raw: 1-D uint8 tensor of exactly the stored bytes. shape: torch order (rows..., row_length), the reverse of
    GGUF's ne[]. Raises ValueError for an unsupported type, a row length that is not a multiple of the block size,
    or a byte count other than the one `shape` needs.
    """
    qtype = _check_type(qtype)
    shape = tuple(int(d) for d in shape)
    needed = byte_size(qtype, shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError("raw must be a 1-D uint8 torch tensor of the tensor's stored bytes")
    if raw.numel() != needed:
        raise ValueError(f"a {qtype.name} tensor of shape {shape} needs {needed} bytes, got {raw.numel()}")

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    decode = _DECODERS[qtype]
    blocks = raw.reshape(-1, type_size)
    n_blocks = blocks.shape[0]
    out = torch.empty(n_blocks, block_size, dtype=dtype, device=raw.device)
    per_pass = max(1, _pass_elems(raw.device) // block_size)
    # float32 output is decoded in place; any other dtype goes through one reused float32 buffer.
    scratch = None if dtype == torch.float32 else torch.empty(min(per_pass, n_blocks), block_size, device=raw.device)
    for start in range(0, n_blocks, per_pass):
        stop = min(start + per_pass, n_blocks)
        target = out[start:stop] if scratch is None else scratch[: stop - start]
        decode(blocks[start:stop], target)
        if scratch is not None:
            out[start:stop].copy_(target)
    return out.reshape(shape)
