"""One token's product with a GGUF-quantized matrix, y = x W^T, dequantizing W in registers: Triton GEMVs; and the
prefill's dequantizer of a band of rows.

A decode step reads every weight once, so its speed is the weights' bytes ÷ the memory bandwidth: a Q4_K matrix is
4.5 bits a weight against bf16's 16. The weights are the file's own blocks (llama.cpp's ggml-common.h layouts, the
ones engine/gguf/dequant.py decodes), repacked once at load (`repack`) so that each field of a block — its fp16
scales, its packed sub-block scales, its quants — lies in an array of its own, [rows, blocks · field bytes]: the same
bytes, not one more, in another order. The file's blocks are 18, 22, 34 or 210 bytes, which no vector load can take
at once; each field array is aligned, so a thread reads 16 quant bytes in one instruction.

Each program takes BLOCK_N rows and walks BLOCK_B blocks at a time along K. Within a block the work is split the way
the format scales it, so a scale multiplies a partial dot product rather than each weight: for Q4_K and Q5_K, per
32-weight sub-block, y += (d·sc)·Σ q·x − (dmin·m)·Σ x; for Q6_K, per 16 weights, y += (d·sc)·Σ q·x; for the
32-weight blocks of Q8_0, Q4_0 and Q5_0, y += d·Σ q·x. Products and sums are float32 throughout.

The quants become floats without the integer-to-float conversion instruction, which the H100 runs at a quarter of
its float rate (it bounded the first version of these kernels at 0.5–1.3 TB/s): an integer v below 2^23 ORed into
the bits of the float 2^23 is the float 2^23 + v, and one exact subtraction leaves v (`_as_float`).

`quant_gemv_ref` (dequantize exactly, then F.linear in float32) is the definition the kernels are tested against.

Shapes: x [1, K]; a matrix of N rows: QuantBlocks, each field [N, K / block · field bytes].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton

if triton is not None:
    import triton.language as tl

_T = GGMLQuantizationType
# Each type's block as fields (name, byte offset, bytes, element type), in the file's order (ggml-common.h).
BLOCK_FIELDS: dict[GGMLQuantizationType, tuple[tuple[str, int, int, torch.dtype], ...]] = {
    _T.Q8_0: (("d", 0, 2, torch.float16), ("qs", 2, 32, torch.uint8)),
    _T.Q4_0: (("d", 0, 2, torch.float16), ("qs", 2, 16, torch.uint8)),
    _T.Q5_0: (("d", 0, 2, torch.float16), ("qh", 2, 4, torch.int32), ("qs", 6, 16, torch.uint8)),
    _T.Q4_K: (("dm", 0, 4, torch.float16), ("scales", 4, 12, torch.uint8), ("qs", 16, 128, torch.uint8)),
    _T.Q5_K: (("dm", 0, 4, torch.float16), ("scales", 4, 12, torch.uint8), ("qh", 16, 32, torch.uint8),
              ("qs", 48, 128, torch.uint8)),
    _T.Q6_K: (("ql", 0, 128, torch.uint8), ("qh", 128, 64, torch.uint8), ("scales", 192, 16, torch.int8),
              ("d", 208, 2, torch.float16)),
}
# The quantization types with a kernel here.
QUANT_GEMV_TYPES = frozenset(BLOCK_FIELDS)


@dataclass
class QuantBlocks:
    """A matrix [N, K] of one quantization type as its blocks' fields, each [N, blocks · field bytes] in its element
    type (`BLOCK_FIELDS`)."""

    qtype: GGMLQuantizationType
    n_in: int
    fields: tuple[Tensor, ...]

    @property
    def n_out(self) -> int:
        return self.fields[0].shape[0]

    @property
    def n_blocks(self) -> int:
        return self.n_in // GGML_QUANT_SIZES[self.qtype][0]

    @property
    def device(self) -> torch.device:
        return self.fields[0].device

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.fields)

    def row_slice(self, r0: int, r1: int) -> "QuantBlocks":
        """Rows [r0, r1): views, no copy."""
        return QuantBlocks(self.qtype, self.n_in, tuple(f[r0:r1] for f in self.fields))

    def take(self, ids: Tensor) -> "QuantBlocks":
        """The rows `ids` [T] (an embedding lookup), gathered."""
        return QuantBlocks(self.qtype, self.n_in, tuple(f[ids] for f in self.fields))

    @staticmethod
    def stack(parts: list[QuantBlocks]) -> QuantBlocks:
        """Matrices of one type and width, their rows stacked (one copy): one kernel for a fused product."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.n_in != first.n_in for p in parts):
            raise ValueError("only matrices of one quantization type and width stack")
        return QuantBlocks(first.qtype, first.n_in, tuple(torch.cat(fs) for fs in zip(*(p.fields for p in parts))))

    def file_bytes(self) -> Tensor:
        """uint8 [N, row bytes] in the file's block layout (what gguf's and the engine's dequantizers read)."""
        n, nb = self.n_out, self.n_blocks
        return torch.cat([f.view(torch.uint8).view(n, nb, -1) for f in self.fields], dim=2).view(n, -1)


def repack(raw: Tensor, qtype: GGMLQuantizationType, n_in: int) -> QuantBlocks:
    """uint8 [N, row bytes] as the file stores it -> QuantBlocks on raw's device (one copy of each field)."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n_in // block
    if raw.dtype != torch.uint8 or raw.dim() != 2 or n_in % block or raw.shape[1] != nb * size:
        raise ValueError(f"a {qtype.name} matrix of {n_in} columns needs uint8 rows of {nb * size} bytes, got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    blocks = raw.view(raw.shape[0], nb, size)
    fields = tuple(blocks[:, :, at:at + n].contiguous().view(raw.shape[0], nb * n).view(dtype)
                   for _, at, n, dtype in BLOCK_FIELDS[qtype])
    return QuantBlocks(qtype, n_in, fields)


def quant_gemv_ref(x: Tensor, w: QuantBlocks) -> Tensor:
    """x [1, K] -> [1, N] in x's dtype: W dequantized exactly (by gguf's own numpy decoder, which
    engine/gguf/dequant.py equals bit for bit), the product in float32."""
    weight = torch.from_numpy(gguf_dequantize(w.file_bytes().cpu().numpy(), w.qtype)).to(x.device)
    return F.linear(x.float(), weight).to(x.dtype)


if triton is not None:

    @triton.jit
    def _as_float(v):
        """int32 v in [0, 2^23) -> float32 v, exactly, in two full-rate instructions (see the module's docstring)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _row_blocks(rows, b, n_out, n_blocks):
        """Block numbers in the matrix [BLOCK_N, BLOCK_B] (row-major over rows, then blocks) of rows × blocks,
        each clamped into the matrix: loads need no mask (whose shape could stop them being vectorized); the
        clamped blocks meet zeros of x, and clamped rows are not stored."""
        r = tl.minimum(rows, n_out - 1).to(tl.int64)
        return r[:, None] * n_blocks + tl.minimum(b, n_blocks - 1)[None, :]

    @triton.jit
    def _k_scale_min(scales_ptr, blk, s):
        """Q4_K/Q5_K's 6-bit (sc, m) of sub-blocks `s` [S] of blocks `blk` [BLOCK_N, BLOCK_B], float32
        [BLOCK_N, BLOCK_B, S]. Sub-blocks 0-3: sc, m are bytes s and 4+s (low 6 bits); 4-7: low 4 bits in byte
        8+(s-4)'s nibbles, high 2 bits in the top of bytes s-4 (sc) and s (m)."""
        at = scales_ptr + blk[:, :, None] * 12 + (s % 4)[None, None, :]
        lo_sc = tl.load(at).to(tl.int32)
        lo_m = tl.load(at + 4).to(tl.int32)
        hi = tl.load(at + 8).to(tl.int32)
        first = (s < 4)[None, None, :]
        sc = tl.where(first, lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4))
        m = tl.where(first, lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4))
        return _as_float(sc), _as_float(m)

    @triton.jit
    def _x_at(x_ptr, at, n_in, EVEN: tl.constexpr):
        """x at offsets `at` [BLOCK_N, BLOCK_B, ...] (the same for every row: the caller broadcasts them over the
        rows) as float32. Loaded in the shape of the quants' tiles, hence in their layout (one copy per row, from
        L1): x loaded once in a layout of its own would be moved into theirs through shared memory, with barriers,
        at every step. Zero beyond the row (the clamped blocks of `_row_blocks`); EVEN: the row is whole tiles, no
        mask."""
        if EVEN:
            return tl.load(x_ptr + at).to(tl.float32)
        return tl.load(x_ptr + at, mask=at < n_in, other=0.0).to(tl.float32)

    # ---- 32-weight blocks: Q8_0 (int8 quants), Q4_0 (nibbles − 8), Q5_0 (nibbles and a high bit − 16) ----

    @triton.jit
    def _q8_0_quants(qs_ptr, blk, i):
        """[BLOCK_N, BLOCK_B, 32] of blocks blk: the int8 quants as float32 (their bytes XOR 128 are q + 128)."""
        q = tl.load(qs_ptr + blk[:, :, None] * 32 + i[None, None, :]).to(tl.int32)
        return _as_float(q ^ 128) - 128.0

    @triton.jit
    def _q4_0_quants(qs_ptr, blk, i):
        """Weights i and 16 + i [BLOCK_N, BLOCK_B, 16] each: byte i's low and high nibbles, − 8."""
        q = tl.load(qs_ptr + blk[:, :, None] * 16 + i[None, None, :]).to(tl.int32)
        return _as_float(q & 15) - 8.0, _as_float(q >> 4) - 8.0

    @triton.jit
    def _q5_0_quants(qh_ptr, qs_ptr, blk, i):
        """As Q4_0, each weight j's fifth bit being bit j of the block's 32-bit qh; − 16."""
        q = tl.load(qs_ptr + blk[:, :, None] * 16 + i[None, None, :]).to(tl.int32)
        h = tl.load(qh_ptr + blk)[:, :, None]
        lo = (q & 15) | (((h >> i[None, None, :]) & 1) << 4)
        hi = (q >> 4) | (((h >> (i[None, None, :] + 16)) & 1) << 4)
        return _as_float(lo) - 16.0, _as_float(hi) - 16.0

    @triton.jit
    def _block32_kernel(d_ptr, qh_ptr, qs_ptr, x_ptr, y_ptr, n_out, n_blocks, KIND: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr):
        # KIND 0: Q8_0, 1: Q4_0, 2: Q5_0 (qh_ptr unused but for Q5_0). y += d·Σ q·x per block.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        zero = 0 * rows[:, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = _row_blocks(rows, b, n_out, n_blocks)
            if KIND == 0:
                i = tl.arange(0, 32)
                x = _x_at(x_ptr, (b[:, None] * 32 + i[None, :])[None] + zero, n_blocks * 32, EVEN)
                dot = tl.sum(_q8_0_quants(qs_ptr, blk, i) * x, axis=2)
            else:
                i = tl.arange(0, 16)
                at = (b[:, None] * 32 + i[None, :])[None] + zero
                x_lo = _x_at(x_ptr, at, n_blocks * 32, EVEN)
                x_hi = _x_at(x_ptr, at + 16, n_blocks * 32, EVEN)
                if KIND == 1:
                    lo, hi = _q4_0_quants(qs_ptr, blk, i)
                else:
                    lo, hi = _q5_0_quants(qh_ptr, qs_ptr, blk, i)
                dot = tl.sum(lo * x_lo + hi * x_hi, axis=2)
            acc += tl.load(d_ptr + blk).to(tl.float32) * dot
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < n_out)

    @triton.jit
    def _block32_dequant_kernel(d_ptr, qh_ptr, qs_ptr, out_ptr, n_out, n_blocks, KIND: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        blk = _row_blocks(rows, b, n_out, n_blocks)
        d = tl.load(d_ptr + blk).to(tl.float32)[:, :, None]
        ok = ((rows < n_out)[:, None] & (b < n_blocks)[None, :])[:, :, None]
        at = rows.to(tl.int64)[:, None, None] * (n_blocks * 32) + b[None, :, None] * 32
        if KIND == 0:
            i = tl.arange(0, 32)
            w = d * _q8_0_quants(qs_ptr, blk, i)
            tl.store(out_ptr + at + i[None, None, :], w.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            i = tl.arange(0, 16)
            if KIND == 1:
                lo, hi = _q4_0_quants(qs_ptr, blk, i)
            else:
                lo, hi = _q5_0_quants(qh_ptr, qs_ptr, blk, i)
            tl.store(out_ptr + at + i[None, None, :], (d * lo).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(out_ptr + at + 16 + i[None, None, :], (d * hi).to(out_ptr.dtype.element_ty), mask=ok)

    # ---- 256-weight K-quants ----

    @triton.jit
    def _q45_k_quants(qh_ptr, qs_ptr, blk, j, i, FIVE: tl.constexpr):
        """Q4_K (FIVE false) or Q5_K quants of sub-blocks 2j and 2j+1 [BLOCK_N, BLOCK_B, 4, 32] as float32: byte
        32j + i of qs holds weight i of sub-block 2j in its low nibble and of 2j+1 in its high one; Q5_K's fifth
        bits are bits 2j and 2j+1 of qh's byte i."""
        q = tl.load(qs_ptr + blk[:, :, None, None] * 128 + (j[:, None] * 32 + i[None, :])[None, None, :, :])
        q = q.to(tl.int32)
        lo, hi = q & 15, q >> 4
        if FIVE:
            h = tl.load(qh_ptr + blk[:, :, None, None] * 32 + i[None, None, None, :]).to(tl.int32)
            shift = 2 * j[None, None, :, None]
            lo = lo | (((h >> shift) & 1) << 4)
            hi = hi | (((h >> (shift + 1)) & 1) << 4)
        return _as_float(lo), _as_float(hi)

    @triton.jit
    def _q45_k_kernel(dm_ptr, scales_ptr, qh_ptr, qs_ptr, x_ptr, y_ptr, n_out, n_blocks, FIVE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr):
        # Per 32-weight sub-block: y += (d·sc)·Σ q·x − (dmin·m)·Σ x.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, 4)  # a pair of sub-blocks, 2j and 2j + 1
        i = tl.arange(0, 32)
        zero = 0 * rows[:, None, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B, 4], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = _row_blocks(rows, b, n_out, n_blocks)
            lo, hi = _q45_k_quants(qh_ptr, qs_ptr, blk, j, i, FIVE)
            at = (b[:, None, None] * 256 + j[None, :, None] * 64 + i[None, None, :])[None] + zero
            x_lo = _x_at(x_ptr, at, n_blocks * 256, EVEN)  # [BLOCK_N, BLOCK_B, 4, 32]
            x_hi = _x_at(x_ptr, at + 32, n_blocks * 256, EVEN)
            sc_lo, m_lo = _k_scale_min(scales_ptr, blk, 2 * j)
            sc_hi, m_hi = _k_scale_min(scales_ptr, blk, 2 * j + 1)
            d = tl.load(dm_ptr + blk * 2).to(tl.float32)[:, :, None]
            dmin = tl.load(dm_ptr + blk * 2 + 1).to(tl.float32)[:, :, None]
            acc += (d * (sc_lo * tl.sum(lo * x_lo, axis=3) + sc_hi * tl.sum(hi * x_hi, axis=3))
                    - dmin * (m_lo * tl.sum(x_lo, axis=3) + m_hi * tl.sum(x_hi, axis=3)))
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < n_out)

    @triton.jit
    def _q45_k_dequant_kernel(dm_ptr, scales_ptr, qh_ptr, qs_ptr, out_ptr, n_out, n_blocks, FIVE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        blk = _row_blocks(rows, b, n_out, n_blocks)
        j = tl.arange(0, 4)
        i = tl.arange(0, 32)
        lo, hi = _q45_k_quants(qh_ptr, qs_ptr, blk, j, i, FIVE)
        sc_lo, m_lo = _k_scale_min(scales_ptr, blk, 2 * j)
        sc_hi, m_hi = _k_scale_min(scales_ptr, blk, 2 * j + 1)
        d = tl.load(dm_ptr + blk * 2).to(tl.float32)[:, :, None]
        dmin = tl.load(dm_ptr + blk * 2 + 1).to(tl.float32)[:, :, None]
        # As the engine's dequantizer rounds: (d·sc)·q − dmin·m, each product rounded to float32.
        w_lo = (d * sc_lo)[:, :, :, None] * lo - (dmin * m_lo)[:, :, :, None]
        w_hi = (d * sc_hi)[:, :, :, None] * hi - (dmin * m_hi)[:, :, :, None]
        ok = ((rows < n_out)[:, None] & (b < n_blocks)[None, :])[:, :, None, None]
        at = (rows.to(tl.int64)[:, None, None, None] * (n_blocks * 256) + b[None, :, None, None] * 256
              + (j[:, None] * 64 + i[None, :])[None, None, :, :])
        tl.store(out_ptr + at, w_lo.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + at + 32, w_hi.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _q6_k_quants(ql_ptr, qh_ptr, blk, h, k, i):
        """Q6_K quants − 32 as float32, [BLOCK_N, BLOCK_B, 2, 4, 16] twice: weight h·128 + k·16 + i (lo) and
        the one 64 further (hi). ql byte h·64 + k·16 + i holds their low 4 bits (low and high nibble); qh byte
        h·32 + (k % 2)·16 + i their top 2 bits, at bit 2·(k // 2) (lo) and 4 + 2·(k // 2) (hi)."""
        at = blk[:, :, None, None, None]
        ql = tl.load(ql_ptr + at * 128 + (h[:, None, None] * 64 + k[None, :, None] * 16 + i[None, None, :])[None, None])
        qh = tl.load(qh_ptr + at * 64 + (h[:, None, None] * 32 + (k % 2)[None, :, None] * 16
                                         + i[None, None, :])[None, None])
        ql, qh = ql.to(tl.int32), qh.to(tl.int32)
        shift = (2 * (k // 2))[None, None, None, :, None]
        lo = (ql & 15) | (((qh >> shift) & 3) << 4)
        hi = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
        return _as_float(lo) - 32.0, _as_float(hi) - 32.0

    @triton.jit
    def _q6_k_scales(scales_ptr, d_ptr, blk, h, k):
        """d·sc of the 16-weight groups of `_q6_k_quants`' lo (group h·8 + k) and hi (h·8 + k + 4) weights,
        float32 [BLOCK_N, BLOCK_B, 2, 4]."""
        d = tl.load(d_ptr + blk).to(tl.float32)[:, :, None, None]
        at = scales_ptr + blk[:, :, None, None] * 16 + (h[:, None] * 8 + k[None, :])[None, None]
        return d * tl.load(at).to(tl.float32), d * tl.load(at + 4).to(tl.float32)

    @triton.jit
    def _q6_k_kernel(ql_ptr, qh_ptr, scales_ptr, d_ptr, x_ptr, y_ptr, n_out, n_blocks, BLOCK_N: tl.constexpr,
                     BLOCK_B: tl.constexpr, EVEN: tl.constexpr):
        # Per 16 weights: y += (d·sc)·Σ (q − 32)·x.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.arange(0, 2)
        k = tl.arange(0, 4)
        i = tl.arange(0, 16)
        zero = 0 * rows[:, None, None, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B, 2, 4], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = _row_blocks(rows, b, n_out, n_blocks)
            lo, hi = _q6_k_quants(ql_ptr, qh_ptr, blk, h, k, i)
            at = (b[:, None, None, None] * 256 + h[None, :, None, None] * 128 + k[None, None, :, None] * 16
                  + i[None, None, None, :])[None] + zero
            x_lo = _x_at(x_ptr, at, n_blocks * 256, EVEN)  # [BLOCK_N, BLOCK_B, 2, 4, 16]
            x_hi = _x_at(x_ptr, at + 64, n_blocks * 256, EVEN)
            s_lo, s_hi = _q6_k_scales(scales_ptr, d_ptr, blk, h, k)
            acc += s_lo * tl.sum(lo * x_lo, axis=4) + s_hi * tl.sum(hi * x_hi, axis=4)
        y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < n_out)

    @triton.jit
    def _q6_k_dequant_kernel(ql_ptr, qh_ptr, scales_ptr, d_ptr, out_ptr, n_out, n_blocks, BLOCK_N: tl.constexpr,
                             BLOCK_B: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        blk = _row_blocks(rows, b, n_out, n_blocks)
        h = tl.arange(0, 2)
        k = tl.arange(0, 4)
        i = tl.arange(0, 16)
        lo, hi = _q6_k_quants(ql_ptr, qh_ptr, blk, h, k, i)
        s_lo, s_hi = _q6_k_scales(scales_ptr, d_ptr, blk, h, k)
        ok = ((rows < n_out)[:, None] & (b < n_blocks)[None, :])[:, :, None, None, None]
        at = (rows.to(tl.int64)[:, None, None, None, None] * (n_blocks * 256) + b[None, :, None, None, None] * 256
              + (h[:, None, None] * 128 + k[None, :, None] * 16 + i[None, None, :])[None, None])
        tl.store(out_ptr + at, (s_lo[:, :, :, :, None] * lo).to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + at + 64, (s_hi[:, :, :, :, None] * hi).to(out_ptr.dtype.element_ty), mask=ok)


def quant_gemv_runs(x: Tensor, w: QuantBlocks) -> bool:
    """Whether `quant_gemv` takes these operands: one contiguous row of the matrix's width on its device, a type
    with a kernel, and triton present (compiled on CUDA, or its interpreter)."""
    return (triton is not None and w.qtype in QUANT_GEMV_TYPES and x.dim() == 2 and x.shape[0] == 1
            and x.shape[1] == w.n_in and x.is_contiguous() and x.device == w.device
            and all(f.is_contiguous() for f in w.fields) and (x.is_cuda or INTERPRET))


def default_tiles(qtype: GGMLQuantizationType) -> tuple[int, int, int]:
    """(BLOCK_N rows, BLOCK_B blocks, num_warps). In the interpreter, which runs programs one after another in
    Python, large tiles (the tests' sizes still leave partial tiles on both sides)."""
    if INTERPRET:
        return 32, 2, 1
    # The best summed time over the 8B shape's layer and output matrices on an H100 (docs/probes/quant_gemv.py,
    # 2026-11-27; docs/benchmarks.md).
    return {_T.Q8_0: (1, 32, 2), _T.Q4_0: (2, 64, 2), _T.Q5_0: (4, 32, 4), _T.Q4_K: (2, 8, 2), _T.Q5_K: (2, 8, 2),
            _T.Q6_K: (8, 4, 4)}[qtype]


def default_dequant_tiles(qtype: GGMLQuantizationType) -> tuple[int, int, int]:
    """`dequantize_rows`' (BLOCK_N rows, BLOCK_B blocks, num_warps): a program writes BLOCK_N × BLOCK_B × 256
    weights (a 32-weight type takes eight times the blocks)."""
    block_n, block_b, warps = (8, 1, 1) if INTERPRET else (16, 2, 4)
    return block_n, block_b * (8 if qtype in _BLOCK32_KIND else 1), warps


_BLOCK32_KIND = {_T.Q8_0: 0, _T.Q4_0: 1, _T.Q5_0: 2}


def _operands(w: QuantBlocks) -> tuple[Tensor, ...]:
    """The fields in each kernel's argument order (a type without qh passes another field in its place)."""
    f = dict(zip((name for name, *_ in BLOCK_FIELDS[w.qtype]), w.fields))
    if w.qtype in _BLOCK32_KIND:
        return f["d"], f.get("qh", f["d"]), f["qs"]
    if w.qtype in (_T.Q4_K, _T.Q5_K):
        return f["dm"], f["scales"], f.get("qh", f["qs"]), f["qs"]
    return f["ql"], f["qh"], f["scales"], f["d"]


def quant_gemv(x: Tensor, w: QuantBlocks, out: Tensor | None = None,
               tiles: tuple[int, int, int] | None = None) -> Tensor:
    """`quant_gemv_ref` in one kernel where `quant_gemv_runs` (else the reference). `out` [1, N]: written in place
    (a slice of a fused output, e.g. q, k and v of different types). `tiles`: (BLOCK_N, BLOCK_B, num_warps),
    as `default_tiles` gives."""
    if not quant_gemv_runs(x, w):
        y = quant_gemv_ref(x, w)
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(1, w.n_out, dtype=x.dtype, device=x.device)
    block_n, block_b, warps = tiles or default_tiles(w.qtype)
    grid = (triton.cdiv(w.n_out, block_n),)
    args = (*_operands(w), x, y, w.n_out, w.n_blocks)
    tile = dict(BLOCK_N=block_n, BLOCK_B=block_b, EVEN=w.n_blocks % block_b == 0, num_warps=warps)
    if w.qtype in _BLOCK32_KIND:
        _block32_kernel[grid](*args, KIND=_BLOCK32_KIND[w.qtype], **tile)
    elif w.qtype in (_T.Q4_K, _T.Q5_K):
        _q45_k_kernel[grid](*args, FIVE=w.qtype == _T.Q5_K, **tile)
    else:
        _q6_k_kernel[grid](*args, **tile)
    return y


def dequantize_rows(w: QuantBlocks, dtype: torch.dtype, out: Tensor | None = None,
                    tiles: tuple[int, int, int] | None = None) -> Tensor | None:
    """W [N, K] in `dtype`, in one kernel where the type has one and triton runs on w's device (a prefill's band of
    rows, dequantized just before its product); else None. Each weight rounded as the engine's dequantizer rounds
    it. `out`: [N, K] to fill (a reused buffer)."""
    if (triton is None or w.qtype not in QUANT_GEMV_TYPES or not (w.device.type == "cuda" or INTERPRET)
            or not all(f.is_contiguous() for f in w.fields)):
        return None
    result = out if out is not None else torch.empty(w.n_out, w.n_in, dtype=dtype, device=w.device)
    block_n, block_b, warps = tiles or default_dequant_tiles(w.qtype)
    grid = (triton.cdiv(w.n_out, block_n), triton.cdiv(w.n_blocks, block_b))
    args = (*_operands(w), result, w.n_out, w.n_blocks)
    if w.qtype in _BLOCK32_KIND:
        _block32_dequant_kernel[grid](*args, KIND=_BLOCK32_KIND[w.qtype], BLOCK_N=block_n, BLOCK_B=block_b,
                                      num_warps=warps)
    elif w.qtype in (_T.Q4_K, _T.Q5_K):
        _q45_k_dequant_kernel[grid](*args, FIVE=w.qtype == _T.Q5_K, BLOCK_N=block_n, BLOCK_B=block_b,
                                    num_warps=warps)
    else:
        _q6_k_dequant_kernel[grid](*args, BLOCK_N=block_n, BLOCK_B=block_b, num_warps=warps)
    return result
