"""One token's product with a GGUF-quantized matrix, y = x W^T, dequantizing W in registers: Triton GEMVs.

A decode step reads every weight once, so its speed is the weights' bytes ÷ the memory bandwidth: a Q4_K matrix is
4.5 bits a weight against bf16's 16. These kernels read the file's own blocks (llama.cpp's ggml-common.h layouts,
the ones engine/gguf/dequant.py decodes), one row of blocks per weight row, and never write a dequantized copy.

Each program takes BLOCK_N rows and walks their blocks along K. Within a block the work is split the way the format
scales it, so the scale multiplies a partial dot product rather than each weight: for Q4_K, per 32-weight
sub-block, y += (d·sc)·Σ q·x − (dmin·m)·Σ x; for Q6_K, per 16 weights, y += (d·sc)·Σ q·x; for Q8_0, per 32, y +=
d·Σ q·x. Products and sums are float32 throughout.

`quant_gemv_ref` (dequantize exactly, then F.linear in float32) is the definition the kernels are tested against.

Shapes: x [1, K]; W as stored: uint8 [N, K / block · type_size] (`raw.view(N, -1)` of the tensor's bytes).
"""

from __future__ import annotations

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
# The quantization types with a kernel here.
QUANT_GEMV_TYPES = frozenset({_T.Q8_0, _T.Q4_K, _T.Q6_K})


def quant_gemv_ref(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    """x [1, K], raw uint8 [N, row bytes] -> [1, N] in x's dtype: W dequantized exactly (by gguf's own numpy
    decoder, which engine/gguf/dequant.py equals bit for bit), the product in float32."""
    weight = torch.from_numpy(gguf_dequantize(raw.cpu().numpy(), qtype)).to(raw.device)
    return F.linear(x.float(), weight).to(x.dtype)


if triton is not None:

    @triton.jit
    def _fp16_at(ptr):
        """The little-endian fp16 whose two bytes start at `ptr` (a uint8 pointer, any alignment), as float32."""
        lo = tl.load(ptr).to(tl.uint16)
        hi = tl.load(ptr + 1).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q8_0_kernel(w_ptr, x_ptr, y_ptr, n_out, n_blocks, row_bytes, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        # A block: d (fp16), then 32 int8 weights.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        row_ptr = w_ptr + rows.to(tl.int64) * row_bytes  # [BLOCK_N]
        i = tl.arange(0, 32)
        acc = tl.zeros([BLOCK_N, BLOCK_B], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ok = row_ok[:, None] & (b < n_blocks)[None, :]  # [BLOCK_N, BLOCK_B]
            block_ptr = row_ptr[:, None] + b[None, :] * 34
            d = _fp16_at(tl.where(ok, block_ptr, w_ptr))
            q = tl.load(block_ptr[:, :, None] + 2 + i[None, None, :], mask=ok[:, :, None], other=0)
            q = q.to(tl.int8, bitcast=True).to(tl.float32)
            x = tl.load(x_ptr + b[:, None] * 32 + i[None, :], mask=(b < n_blocks)[:, None], other=0.0)
            acc += tl.where(ok, d, 0.0) * tl.sum(q * x.to(tl.float32)[None, :, :], axis=2)
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _k_scale_min(block_ptr, s):
        """Q4_K's d·sc and dmin·m of sub-blocks `s` [S] of each block at `block_ptr` [BLOCK_N, BLOCK_B], float32
        [BLOCK_N, BLOCK_B, S]. Sub-blocks 0-3: sc, m are bytes 4+s and 8+s (low 6 bits); 4-7: low 4 bits in byte
        12+(s-4)'s nibbles, high 2 bits in the top of bytes 4+(s-4) (sc) and 8+(s-4) (m)."""
        at = block_ptr[:, :, None] + (s % 4)[None, None, :]
        lo_sc = tl.load(at + 4).to(tl.int32)
        lo_m = tl.load(at + 8).to(tl.int32)
        hi = tl.load(at + 12).to(tl.int32)
        first = (s < 4)[None, None, :]
        sc = tl.where(first, lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)).to(tl.float32)
        m = tl.where(first, lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)).to(tl.float32)
        return _fp16_at(block_ptr)[:, :, None] * sc, _fp16_at(block_ptr + 2)[:, :, None] * m

    @triton.jit
    def _q4_k_decode(block_ptr, s, i):
        """A 256-weight Q4_K block at each of `block_ptr` [BLOCK_N, BLOCK_B]: d, dmin (fp16); 12 bytes packing 8
        six-bit (sc, m) pairs; 128 bytes of nibbles, each 32-byte run holding sub-block 2j in its low nibbles and
        2j+1 in its high ones. Returns (d·sc, dmin·m) [BLOCK_N, BLOCK_B, 8] and q [BLOCK_N, BLOCK_B, 8, 32], float32:
        w = (d·sc)·q − dmin·m."""
        dl, ml = _k_scale_min(block_ptr, s)
        nibble_at = 16 + (s // 2)[:, None] * 32 + i[None, :]  # [8, 32] byte offset in the block
        q = tl.load(block_ptr[:, :, None, None] + nibble_at[None, None, :, :]).to(tl.int32)
        q = ((q >> ((s % 2) * 4)[None, None, :, None]) & 15).to(tl.float32)
        return dl, ml, q

    @triton.jit
    def _q4_k_kernel(w_ptr, x_ptr, y_ptr, n_out, n_blocks, row_bytes, BLOCK_N: tl.constexpr,
                     BLOCK_B: tl.constexpr):
        # BLOCK_B blocks of BLOCK_N rows at a time (loads in flight); per 32-weight sub-block:
        # y += (d·sc)·Σ q·x − (dmin·m)·Σ x. (Reading the nibbles as 32-bit words instead, with x gathered to match,
        # measured 1.8× slower on the H100: docs/benchmarks.md.)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        row_ptr = w_ptr + rows.to(tl.int64) * row_bytes
        s = tl.arange(0, 8)  # sub-block
        i = tl.arange(0, 32)  # weight within it
        acc = tl.zeros([BLOCK_N, BLOCK_B, 8], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ok = row_ok[:, None] & (b < n_blocks)[None, :]
            dl, ml, q = _q4_k_decode(tl.where(ok, row_ptr[:, None] + b[None, :] * 144, w_ptr), s, i)
            x = tl.load(x_ptr + b[:, None, None] * 256 + s[None, :, None] * 32 + i[None, None, :],
                        mask=(b < n_blocks)[:, None, None], other=0.0).to(tl.float32)  # [BLOCK_B, 8, 32]
            acc += dl * tl.sum(q * x[None, :, :, :], axis=3) - ml * tl.sum(x, axis=2)[None, :, :]
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _q4_k_dequant_kernel(w_ptr, out_ptr, n_out, n_in, row_bytes, BLOCK_N: tl.constexpr):
        # One program: BLOCK_N rows of one block, written out whole.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        blk = tl.program_id(1)
        row_ok = rows < n_out
        s = tl.arange(0, 8)
        i = tl.arange(0, 32)
        block_ptr = tl.where(row_ok, w_ptr + rows.to(tl.int64) * row_bytes + blk * 144, w_ptr)[:, None]
        dl, ml, q = _q4_k_decode(block_ptr, s, i)
        dl, ml = tl.reshape(dl, [BLOCK_N, 8, 1]), tl.reshape(ml, [BLOCK_N, 8, 1])  # the one block of each row
        w = dl * tl.reshape(q, [BLOCK_N, 8, 32]) - ml
        at = rows.to(tl.int64)[:, None, None] * n_in + blk * 256 + (s[:, None] * 32 + i[None, :])[None, :, :]
        tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None, None])

    @triton.jit
    def _q6_k_decode(block_ptr, g, i):
        """A 256-weight Q6_K block at each of `block_ptr` [BLOCK_N, BLOCK_B]: 128 bytes of low nibbles (weight e of
        each 128 in byte 64·(e//128) + e%64, the low nibble for e%128 < 64), 64 bytes of 2-bit high parts (byte 128
        + 32·(e//128) + e%32, bits 2·((e%128)//32)), 16 int8 scales (one per 16 weights), d (fp16) last. Returns d·sc
        [BLOCK_N, BLOCK_B, 16] and q − 32 [BLOCK_N, BLOCK_B, 16, 16], float32: w = (d·sc)·(q − 32)."""
        e = g[:, None] * 16 + i[None, :]  # [16, 16] weight within the block
        half, within = e // 128, e % 128
        d = _fp16_at(block_ptr + 208)[:, :, None]
        sc = tl.load(block_ptr[:, :, None] + 192 + g[None, None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        at = block_ptr[:, :, None, None]
        ql = tl.load(at + (half * 64 + within % 64)[None, None, :, :]).to(tl.int32)
        qh = tl.load(at + (128 + half * 32 + within % 32)[None, None, :, :]).to(tl.int32)
        q = (((ql >> ((within // 64) * 4)[None, None, :, :]) & 15)
             | (((qh >> ((within // 32) * 2)[None, None, :, :]) & 3) << 4))
        return d * sc, (q - 32).to(tl.float32)

    @triton.jit
    def _q6_k_kernel(w_ptr, x_ptr, y_ptr, n_out, n_blocks, row_bytes, BLOCK_N: tl.constexpr,
                     BLOCK_B: tl.constexpr):
        # Per 16 weights: y += (d·sc)·Σ (q − 32)·x.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        row_ptr = w_ptr + rows.to(tl.int64) * row_bytes
        g = tl.arange(0, 16)  # group of 16 weights, one scale each
        i = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, BLOCK_B, 16], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ok = row_ok[:, None] & (b < n_blocks)[None, :]
            dl, q = _q6_k_decode(tl.where(ok, row_ptr[:, None] + b[None, :] * 210, w_ptr), g, i)
            x = tl.load(x_ptr + b[:, None, None] * 256 + g[None, :, None] * 16 + i[None, None, :],
                        mask=(b < n_blocks)[:, None, None], other=0.0).to(tl.float32)  # [BLOCK_B, 16, 16]
            acc += dl * tl.sum(q * x[None, :, :, :], axis=3)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _q6_k_dequant_kernel(w_ptr, out_ptr, n_out, n_in, row_bytes, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        blk = tl.program_id(1)
        row_ok = rows < n_out
        g = tl.arange(0, 16)
        i = tl.arange(0, 16)
        block_ptr = tl.where(row_ok, w_ptr + rows.to(tl.int64) * row_bytes + blk * 210, w_ptr)[:, None]
        dl, q = _q6_k_decode(block_ptr, g, i)
        at = rows.to(tl.int64)[:, None, None] * n_in + blk * 256 + (g[:, None] * 16 + i[None, :])[None, :, :]
        w = tl.reshape(dl, [BLOCK_N, 16, 1]) * tl.reshape(q, [BLOCK_N, 16, 16])  # the one block of each row
        tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None, None])

    @triton.jit
    def _q8_0_dequant_kernel(w_ptr, out_ptr, n_out, n_in, n_blocks, row_bytes, BLOCK_N: tl.constexpr,
                             BLOCK_B: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        ok = (rows < n_out)[:, None] & (b < n_blocks)[None, :]
        block_ptr = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + b[None, :] * 34
        d = _fp16_at(tl.where(ok, block_ptr, w_ptr))
        i = tl.arange(0, 32)
        q = tl.load(block_ptr[:, :, None] + 2 + i[None, None, :], mask=ok[:, :, None], other=0)
        w = d[:, :, None] * q.to(tl.int8, bitcast=True).to(tl.float32)
        at = rows.to(tl.int64)[:, None, None] * n_in + (b[None, :, None] * 32 + i[None, None, :])
        tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=ok[:, :, None])


def quant_gemv_runs(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether `quant_gemv` takes these operands: one contiguous row, a type with a kernel, bytes that hold whole
    blocks of the row's length, and triton present."""
    if triton is None or qtype not in QUANT_GEMV_TYPES or raw.dtype != torch.uint8 or raw.dim() != 2:
        return False
    block, size = GGML_QUANT_SIZES[qtype]
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and raw.is_contiguous()
            and raw.shape[1] % size == 0 and raw.shape[1] // size * block == x.shape[1]
            and x.device == raw.device and (x.is_cuda or INTERPRET))


def default_rows(qtype: GGMLQuantizationType) -> tuple[int, int, int]:
    """(BLOCK_N rows, BLOCK_B blocks, num_warps). In the interpreter, which runs programs one after another in
    Python, large tiles (the tests' sizes still leave partial tiles on both sides)."""
    if INTERPRET:
        return 32, 2, 1
    # The best summed time over the 8B shape's four layer matrices on an H200 (docs/probes/quant_gemv.py,
    # 2026-11-27; docs/benchmarks.md).
    return {_T.Q8_0: (8, 16, 4), _T.Q4_K: (16, 4, 4), _T.Q6_K: (4, 2, 4)}[qtype]


def quant_gemv(x: Tensor, raw: Tensor, qtype: GGMLQuantizationType, out: Tensor | None = None,
               tiles: tuple[int, int, int] | None = None) -> Tensor:
    """`quant_gemv_ref` in one kernel where `quant_gemv_runs` (else the reference). `out` [1, N]: written in place
    (a slice of a fused output, e.g. q, k and v of different types). `tiles`: (BLOCK_N, BLOCK_B, num_warps),
    as `default_rows` gives."""
    if not quant_gemv_runs(x, raw, qtype):
        y = quant_gemv_ref(x, raw, qtype)
        return y if out is None else out.copy_(y)
    size = GGML_QUANT_SIZES[qtype][1]
    n_out, n_blocks = raw.shape[0], raw.shape[1] // size
    y = out if out is not None else torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    block_n, block_b, warps = tiles or default_rows(qtype)
    grid = (triton.cdiv(n_out, block_n),)
    kernel = {_T.Q8_0: _q8_0_kernel, _T.Q4_K: _q4_k_kernel, _T.Q6_K: _q6_k_kernel}[qtype]
    kernel[grid](raw, x, y, n_out, n_blocks, raw.shape[1], BLOCK_N=block_n, BLOCK_B=block_b, num_warps=warps)
    return y


def dequantize_rows(raw: Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype,
                    out: Tensor | None = None) -> Tensor:
    """raw uint8 [N, row bytes] -> W [N, K] in `dtype`, in one kernel where `quant_gemv_runs` would take the type
    and device (a prefill's band of rows, dequantized just before its product); else None. `out`: [N, K] to fill (a
    reused buffer)."""
    if triton is None or qtype not in QUANT_GEMV_TYPES or not (raw.is_cuda or INTERPRET) or not raw.is_contiguous():
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    n_out, n_blocks = raw.shape[0], raw.shape[1] // size
    n_in = n_blocks * block
    w = out if out is not None else torch.empty(n_out, n_in, dtype=dtype, device=raw.device)
    if qtype == _T.Q8_0:
        grid = (triton.cdiv(n_out, 16), triton.cdiv(n_blocks, 8))
        _q8_0_dequant_kernel[grid](raw, w, n_out, n_in, n_blocks, raw.shape[1], BLOCK_N=16, BLOCK_B=8, num_warps=4)
    elif qtype == _T.Q4_K:
        _q4_k_dequant_kernel[(triton.cdiv(n_out, 4), n_blocks)](raw, w, n_out, n_in, raw.shape[1], BLOCK_N=4,
                                                                 num_warps=4)
    else:
        _q6_k_dequant_kernel[(triton.cdiv(n_out, 4), n_blocks)](raw, w, n_out, n_in, raw.shape[1], BLOCK_N=4,
                                                                 num_warps=4)
    return w
