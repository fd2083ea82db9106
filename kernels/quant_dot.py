"""One token's product with a GGUF-quantized matrix in integer arithmetic: x quantized to int8 once per product
(per 32 values, as llama.cpp's mmvq quantizes it to Q8_1), then 4-way int8 dot products (the GPU's dp4a) of the
weights' quants with x's, scaled per block.

Why not kernels.quant_gemv's float kernels: they run out of instructions before bytes. Turning each quant into a
float and multiplying it costs 10–13 instructions a Q4_K weight (docs/benchmarks.md, issue 41), which caps the
H100 at 1.3–1.5 TB/s of Q4_K against its ~3 TB/s. Here a 32-bit word of quants is masked once and meets a word of
x in one dp4a: four weights in about two instructions. A Q4_K word holds 8 nibbles, weights i (low) and 32 + i
(high) of a pair of sub-blocks, so one load feeds two dp4a.

Per block the sums stay integers and the scales are applied once (llama.cpp's vec_dot_q*_q8_1 form):
* Q8_0: y += d·dx·Σ q·xq.
* Q4_0: y += d·dx·(Σ q·xq − 8·Σ xq).
* Q4_K, Q5_K (32-weight sub-blocks): y += d·sc·dx·Σ q·xq − dmin·m·dx·Σ xq.
* Q6_K (16-weight groups): y += d·sc·dx·(Σ q·xq − 32·Σ xq).
Σ xq is x's integer sum per 16 values, computed once with x's quantization (`quantize_x`). Q5_0 has no kernel here
(its fifth bits are one 32-bit word a block, bit j for weight j, which no byte-wise mask spreads): it keeps the
float kernel.

The quantization of x is the only rounding beyond the float kernels' own: x is rounded to 1/127 of its 32-value
block's largest magnitude, as llama.cpp does on the CPU and the GPU alike. It is applied to 16-bit activations only
(bf16 already keeps 8 bits of mantissa); float32 models keep the float kernels (QuantizedMatrix decides).

`quant_dot_ref` (x as quantized, W dequantized exactly by gguf's decoder, the product in float64) is the definition
the kernels are tested against; `quantize_x_ref` is x's quantization in torch. In triton's interpreter (the tests on
the CPU) dp4a is computed byte by byte (`_dp4a`), since the interpreter runs no PTX.

Shapes: x [1, K]; QuantX: q int8 [K] (read as int32 words), d float32 [K / 32], sums float32 [K / 16];
a matrix of N rows: QuantBlocks (kernels.quant_gemv), each field [N, K / block · field bytes].
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton
from kvchat.kernels.quant_gemv import QuantBlocks

if triton is not None:
    import triton.language as tl

    # The float kernels' helpers (kernels.quant_gemv): clamped block numbers, Q4_K/Q5_K's packed 6-bit scales.
    from kvchat.kernels.quant_gemv import _k_scale_min, _row_blocks

_T = GGMLQuantizationType
# The quantization types with an integer kernel here.
QUANT_DOT_TYPES = frozenset({_T.Q8_0, _T.Q4_0, _T.Q4_K, _T.Q5_K, _T.Q6_K})
# Values per scale of x.
X_GROUP = 32


@dataclass
class QuantX:
    """x [1, K] quantized: q int8 [K], d float32 [K / 32] (x ≈ q·d per 32 values), sums float32 [K / 16] (the
    integer sum of q per 16 values, exact in float32)."""

    q: Tensor
    d: Tensor
    sums: Tensor


def quantize_x_ref(x: Tensor) -> QuantX:
    """x [1, K] (K a multiple of 32) -> QuantX, in torch: per 32 values d = max|x| / 127 and q = x · 127 / max|x|
    rounded to the nearest integer, as floor(v + 0.5) (the kernel's operations, in float32; where v + 0.5 is
    within a rounding of an integer, the kernel, whose multiply-add may be fused, can land one step away)."""
    groups = x.float().reshape(-1, X_GROUP)
    amax = groups.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(groups * inv[:, None] + 0.5).clamp(-127, 127)
    return QuantX(q.to(torch.int8).reshape(-1), amax * (1.0 / 127.0), q.reshape(-1, 16).sum(dim=1))


def quant_dot_ref(xq: QuantX, w: QuantBlocks) -> Tensor:
    """[1, N] float32: the quantized x (q·d) times W dequantized exactly (gguf's decoder), in float64."""
    weight = torch.from_numpy(gguf_dequantize(w.file_bytes().cpu().numpy(), w.qtype)).double()
    x = (xq.q.double().reshape(-1, X_GROUP) * xq.d.double()[:, None]).reshape(1, -1)
    return (x.cpu() @ weight.t()).float().to(xq.q.device)


if triton is not None:

    @triton.jit
    def _dp4a(a, b, ASM: tl.constexpr):
        """The dot product of a's and b's four signed bytes (int32 each): the GPU's dp4a, or the same sum byte by
        byte (ASM false: triton's interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise("{ .reg .s32 z; mov.s32 z, 0; dp4a.s32.s32 $0, $1, $2, z; }", "=r,r,r",
                                             [a, b], dtype=tl.int32, is_pure=True, pack=1)
        else:
            s = ((a << 24) >> 24) * ((b << 24) >> 24)
            for k in tl.static_range(1, 4):
                s += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
            return s

    @triton.jit
    def store_quantized_groups(x, g, ok, q_ptr, d_ptr, s_ptr):
        """x [G, 32] float32 (groups g [G], those with ok [G] stored) -> x's int8 quants, scales and sums (QuantX's
        arrays): `quantize_x_ref`'s operations. Shared with the kernels that produce a decode step's x
        (kernels.rms_norm, kernels.silu_mul), so that x is quantized where it is made, not by a kernel of its own."""
        i = tl.arange(0, 32)
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
        q = tl.floor(x * inv[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + g[:, None] * 32 + i[None, :], q.to(tl.int8), mask=ok[:, None])
        tl.store(d_ptr + g, amax * (1.0 / 127.0), mask=ok)
        first = (i < 16)[None, :]
        tl.store(s_ptr + g * 2, tl.sum(tl.where(first, q, 0.0), axis=1), mask=ok)
        tl.store(s_ptr + g * 2 + 1, tl.sum(tl.where(first, 0.0, q), axis=1), mask=ok)

    @triton.jit
    def _quantize_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, n_groups, GROUPS: tl.constexpr):
        g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
        i = tl.arange(0, 32)
        ok = g < n_groups
        x = tl.load(x_ptr + g[:, None] * 32 + i[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        store_quantized_groups(x, g, ok, q_ptr, d_ptr, s_ptr)

    @triton.jit
    def _x_words(xq_ptr, at, n_words, EVEN: tl.constexpr):
        """x's int8 quants, four to an int32 word, at word offsets `at` (loaded in the quants' tile shape, as
        kernels.quant_gemv loads x: no layout change through shared memory); zero beyond the row."""
        if EVEN:
            return tl.load(xq_ptr + at)
        return tl.load(xq_ptr + at, mask=at < n_words, other=0)

    @triton.jit
    def _x_scales(ptr, at, n, EVEN: tl.constexpr):
        if EVEN:
            return tl.load(ptr + at)
        return tl.load(ptr + at, mask=at < n, other=0.0)

    @triton.jit
    def _block32_dot_kernel(d_ptr, qs_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, n_out, n_blocks, KIND: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
        # KIND 0: Q8_0 (8 words of int8 quants a block), 1: Q4_0 (4 words of nibbles: weight i low, 16 + i high).
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        zero = 0 * rows[:, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = _row_blocks(rows, b, n_out, n_blocks)
            dx = _x_scales(xd_ptr, b, n_blocks, EVEN)[None, :]
            if KIND == 0:
                t = tl.arange(0, 8)
                q = tl.load(qs_ptr + blk[:, :, None] * 8 + t[None, None, :])
                x = _x_words(xq_ptr, (b[:, None] * 8 + t[None, :])[None] + zero, n_blocks * 8, EVEN)
                dot = tl.sum(_dp4a(q, x, ASM), axis=2).to(tl.float32)
            else:
                t = tl.arange(0, 4)
                q = tl.load(qs_ptr + blk[:, :, None] * 4 + t[None, None, :])
                at = (b[:, None] * 8 + t[None, :])[None] + zero
                x_lo = _x_words(xq_ptr, at, n_blocks * 8, EVEN)
                x_hi = _x_words(xq_ptr, at + 4, n_blocks * 8, EVEN)
                s = tl.sum(_dp4a(q & 0x0F0F0F0F, x_lo, ASM) + _dp4a((q >> 4) & 0x0F0F0F0F, x_hi, ASM), axis=2)
                xs = (_x_scales(xs_ptr, b * 2, n_blocks * 2, EVEN) + _x_scales(xs_ptr, b * 2 + 1, n_blocks * 2, EVEN))
                dot = s.to(tl.float32) - 8.0 * xs[None, :]
            acc += tl.load(d_ptr + blk).to(tl.float32) * dx * dot
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < n_out)

    @triton.jit
    def _q45_k_half(qs_ptr, qh_ptr, xq_ptr, blk, b, j, t, zero, n_blocks, FIVE: tl.constexpr, EVEN: tl.constexpr,
                    ASM: tl.constexpr):
        """Words 8j + t (t: 4 of the 8) of blocks blk [BLOCK_N, BLOCK_B] times x: the low and high nibbles' dp4a,
        [BLOCK_N, BLOCK_B, 4, 4] each."""
        q = tl.load(qs_ptr + blk[:, :, None, None] * 32 + (j[:, None] * 8 + t[None, :])[None, None])
        lo = q & 0x0F0F0F0F
        hi = (q >> 4) & 0x0F0F0F0F
        if FIVE:
            h = tl.load(qh_ptr + blk[:, :, None, None] * 8 + t[None, None, None, :])
            shift = 2 * j[None, None, :, None]
            lo = lo | (((h >> shift) & 0x01010101) << 4)
            hi = hi | (((h >> (shift + 1)) & 0x01010101) << 4)
        at = (b[:, None, None] * 64 + j[None, :, None] * 16 + t[None, None, :])[None] + zero
        return (_dp4a(lo, _x_words(xq_ptr, at, n_blocks * 64, EVEN), ASM),
                _dp4a(hi, _x_words(xq_ptr, at + 8, n_blocks * 64, EVEN), ASM))

    @triton.jit
    def _q45_k_dot_kernel(dm_ptr, scales_ptr, qh_ptr, qs_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, n_out, n_blocks,
                          FIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr,
                          ASM: tl.constexpr):
        # qs: 32 words a block; word 8j + t holds weights 4t..4t+3 of sub-block 2j (low nibbles) and of 2j + 1
        # (high). Q5_K's qh: 8 words a block; bits 2j and 2j + 1 of word t's bytes are those weights' fifth bits.
        # The 8 words of a pair j are read as two tiles of 4 (t and 4 + t), so that one thread holds all 8: its
        # sums stay in the thread (a sum across threads would shuffle at every block) and one set of scales serves
        # 64 weights.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        first = tl.minimum(rows, n_out - 1).to(tl.int64) * n_blocks  # each row's first block
        j = tl.arange(0, 4)
        t = tl.arange(0, 4)
        zero = 0 * rows[:, None, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B, 4], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = first[:, None] + (b if EVEN else tl.minimum(b, n_blocks - 1))[None, :]
            lo0, hi0 = _q45_k_half(qs_ptr, qh_ptr, xq_ptr, blk, b, j, t, zero, n_blocks, FIVE, EVEN, ASM)
            lo1, hi1 = _q45_k_half(qs_ptr, qh_ptr, xq_ptr, blk, b, j, t + 4, zero, n_blocks, FIVE, EVEN, ASM)
            s_lo = tl.sum(lo0 + lo1, axis=3).to(tl.float32)
            s_hi = tl.sum(hi0 + hi1, axis=3).to(tl.float32)
            sub = b[:, None] * 8 + 2 * j[None, :]  # [BLOCK_B, 4]: x's 32-value group of sub-block 2j
            dx_lo = _x_scales(xd_ptr, sub, n_blocks * 8, EVEN)[None]
            dx_hi = _x_scales(xd_ptr, sub + 1, n_blocks * 8, EVEN)[None]
            xs_lo = _x_scales(xs_ptr, 2 * sub, n_blocks * 16, EVEN) + _x_scales(xs_ptr, 2 * sub + 1, n_blocks * 16,
                                                                               EVEN)
            xs_hi = _x_scales(xs_ptr, 2 * sub + 2, n_blocks * 16, EVEN) + _x_scales(xs_ptr, 2 * sub + 3,
                                                                                   n_blocks * 16, EVEN)
            sc_lo, m_lo = _k_scale_min(scales_ptr, blk, 2 * j)
            sc_hi, m_hi = _k_scale_min(scales_ptr, blk, 2 * j + 1)
            d = tl.load(dm_ptr + blk * 2).to(tl.float32)[:, :, None]
            dmin = tl.load(dm_ptr + blk * 2 + 1).to(tl.float32)[:, :, None]
            acc += (d * (sc_lo * dx_lo * s_lo + sc_hi * dx_hi * s_hi)
                    - dmin * (m_lo * dx_lo * xs_lo[None] + m_hi * dx_hi * xs_hi[None]))
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < n_out)

    @triton.jit
    def _q6_k_dot_kernel(ql_ptr, qh_ptr, scales_ptr, d_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, n_out, n_blocks,
                         BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
        # Per half h of a block (128 weights): ql word 16h + u (u < 16) holds the low 4 bits of weights
        # 128h + 4u..4u+3 (low nibbles) and of the 64 after them (high); qh word 8h + u % 8 their top 2 bits, at
        # bit 2·(u // 8) of each byte (low) and 4 + 2·(u // 8) (high). Scales per 16 weights: group 8h + u // 4
        # (low) and 8h + 4 + u // 4 (high).
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.arange(0, 2)
        g = tl.arange(0, 4)  # four words (16 weights, one scale) a group: u = 4g + v
        v = tl.arange(0, 4)
        zero = 0 * rows[:, None, None, None, None]
        acc = tl.zeros([BLOCK_N, BLOCK_B, 2, 4], tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = _row_blocks(rows, b, n_out, n_blocks)
            at = blk[:, :, None, None, None]
            u = (g[:, None] * 4 + v[None, :])[None, None, None]  # [1, 1, 1, 4, 4]
            hh = h[None, None, :, None, None]
            ql = tl.load(ql_ptr + at * 32 + hh * 16 + u)
            qh = tl.load(qh_ptr + at * 16 + hh * 8 + u % 8)
            shift = 2 * (u // 8)
            lo = (ql & 0x0F0F0F0F) | (((qh >> shift) & 0x03030303) << 4)
            hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (shift + 4)) & 0x03030303) << 4)
            words = (b[:, None, None, None] * 64 + h[None, :, None, None] * 32 + g[None, None, :, None] * 4
                     + v[None, None, None, :])[None] + zero  # x words of the low weights; the high: + 16
            s_lo = tl.sum(_dp4a(lo, _x_words(xq_ptr, words, n_blocks * 64, EVEN), ASM), axis=4)
            s_hi = tl.sum(_dp4a(hi, _x_words(xq_ptr, words + 16, n_blocks * 64, EVEN), ASM), axis=4)
            grp = b[:, None, None] * 16 + h[None, :, None] * 8 + g[None, None, :]  # [BLOCK_B, 2, 4]: 16-value group
            dx = _x_scales(xd_ptr, grp // 2, n_blocks * 8, EVEN)[None]  # the 32-value group of the low weights
            dx_hi = _x_scales(xd_ptr, grp // 2 + 2, n_blocks * 8, EVEN)[None]
            xs_lo = _x_scales(xs_ptr, grp, n_blocks * 16, EVEN)[None]
            xs_hi = _x_scales(xs_ptr, grp + 4, n_blocks * 16, EVEN)[None]
            d = tl.load(d_ptr + blk).to(tl.float32)[:, :, None, None]
            sat = scales_ptr + blk[:, :, None, None] * 16 + (h[:, None] * 8 + g[None, :])[None, None]
            sc_lo = tl.load(sat).to(tl.float32)
            sc_hi = tl.load(sat + 4).to(tl.float32)
            acc += d * (sc_lo * dx * (s_lo.to(tl.float32) - 32.0 * xs_lo)
                        + sc_hi * dx_hi * (s_hi.to(tl.float32) - 32.0 * xs_hi))
        y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < n_out)


def quant_dot_runs(x: Tensor, w: QuantBlocks) -> bool:
    """Whether `quant_dot` takes these operands: one contiguous row of the matrix's width on its device, a type
    with an integer kernel, and triton present (compiled on CUDA, or its interpreter)."""
    return (triton is not None and w.qtype in QUANT_DOT_TYPES and x.dim() == 2 and x.shape[0] == 1
            and x.shape[1] == w.n_in and x.is_contiguous() and x.device == w.device and w.n_in % X_GROUP == 0
            and all(f.is_contiguous() for f in w.fields) and (x.is_cuda or INTERPRET))


def empty_quant_x(n_in: int, device: torch.device) -> QuantX:
    """Room for a quantized x of n_in values (a kernel fills it)."""
    return QuantX(torch.empty(n_in, dtype=torch.int8, device=device),
                  torch.empty(n_in // X_GROUP, dtype=torch.float32, device=device),
                  torch.empty(n_in // X_GROUP * 2, dtype=torch.float32, device=device))


def quantize_x(x: Tensor) -> QuantX:
    """`quantize_x_ref` in one kernel (x [1, K] on CUDA or in the interpreter; else the reference)."""
    if triton is None or not (x.is_cuda or INTERPRET) or not x.is_contiguous() or x.numel() % X_GROUP:
        return quantize_x_ref(x)
    n_groups = x.numel() // X_GROUP
    out = empty_quant_x(x.numel(), x.device)
    groups = 16 if INTERPRET else 4
    _quantize_x_kernel[(triton.cdiv(n_groups, groups),)](x, out.q, out.d, out.sums, n_groups, GROUPS=groups,
                                                          num_warps=1 if INTERPRET else 2)
    return out


# A JSON file {"Q4_K": [BLOCK_N, BLOCK_B, num_warps], "Q6_K/long": [...], ...} whose tiles replace the defaults: a type
# name alone for all of its matrices, "TYPE/CLASS" for one class (`matrix_class`); tiles measured on another card:
# docs/probes/quant_dot_tiles.py --best FILE writes one.
TILES_ENV = "KVCHAT_QUANT_DOT_TILES"
# Matrices whose best tiles differ (docs/probes/quant_dot_tiles.py, in a CUDA graph as a decode step runs them):
# "tall" ones (≥ 16k rows: gate+up, the output matrix) have rows enough to fill the card with small tiles; "long"
# rows (at least twice as many columns as rows: down) want few rows a program and long runs of blocks; the rest are
# "small" (q/k/v, o), whose few rows must still spread over every SM.
MATRIX_CLASSES = ("small", "tall", "long")


def matrix_class(n_out: int, n_in: int) -> str:
    if n_in >= 2 * n_out:
        return "long"
    return "tall" if n_out >= 16384 else "small"


@cache
def _tiles_from_env() -> dict[str, tuple[int, int, int]]:
    path = os.environ.get(TILES_ENV)
    if not path:
        return {}
    try:
        named = json.loads(open(path).read())
        tiles = {}
        for key, (n, b, warps) in named.items():
            name, _, kind = key.partition("/")
            if name not in _T.__members__ or (kind and kind not in MATRIX_CLASSES):
                raise KeyError(key)
            tiles[key] = (int(n), int(b), int(warps))
        return tiles
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{TILES_ENV}={path}: not a JSON object of type names (or TYPE/CLASS, a class one of "
                         f"{', '.join(MATRIX_CLASSES)}) to [rows, blocks, warps] ({e})") from e


# The tiles with the least time per matrix class, each in a CUDA graph of 32 copies, on an H100 (2026-11-27,
# docs/probes/quant_dot_tiles.py; docs/benchmarks.md, issue 41); a type without a class of its own here takes its
# "" entry.
# Q8_0, Q4_0 and Q5_K: one tile a type, the least summed time over the 8B shape's matrices on an H200 (each launch
# timed alone, docs/probes/quant_dot.py, the same day).
DEFAULT_DOT_TILES: dict[tuple[GGMLQuantizationType, str], tuple[int, int, int]] = {
    (_T.Q4_K, "small"): (2, 4, 1), (_T.Q4_K, "tall"): (2, 2, 1), (_T.Q4_K, "long"): (1, 4, 1),
    (_T.Q6_K, "small"): (2, 2, 1), (_T.Q6_K, "tall"): (2, 2, 1), (_T.Q6_K, "long"): (1, 2, 1),
    (_T.Q4_K, ""): (2, 2, 1), (_T.Q6_K, ""): (2, 2, 1),
    (_T.Q8_0, ""): (1, 32, 1), (_T.Q4_0, ""): (2, 32, 2), (_T.Q5_K, ""): (1, 4, 1),
}


def default_dot_tiles(qtype: GGMLQuantizationType, n_out: int = 0, n_in: int = 0) -> tuple[int, int, int]:
    """(BLOCK_N rows, BLOCK_B blocks, num_warps) for a matrix [n_out, n_in] of `qtype`: the environment's file, then
    the measured defaults, by class then by type; in the interpreter, large tiles (fewer Python-run programs)."""
    if INTERPRET:
        return 16, 2, 1
    kind = matrix_class(n_out, n_in)
    chosen = _tiles_from_env()
    tiles = chosen.get(f"{qtype.name}/{kind}") or chosen.get(qtype.name)
    return tiles or DEFAULT_DOT_TILES.get((qtype, kind)) or DEFAULT_DOT_TILES[qtype, ""]


def _words(t: Tensor) -> Tensor:
    return t.view(torch.int32)


def quant_dot(xq: QuantX, w: QuantBlocks, out: Tensor, tiles: tuple[int, int, int] | None = None) -> Tensor:
    """y = x W^T into `out` [1, N] (any float dtype; a slice of a fused output is fine) for x as `quantize_x` gave
    it; the caller checked `quant_dot_runs` on x."""
    block_n, block_b, warps = tiles or default_dot_tiles(w.qtype, w.n_out, w.n_in)
    grid = (triton.cdiv(w.n_out, block_n),)
    x_args = (_words(xq.q), xq.d, xq.sums, out, w.n_out, w.n_blocks)
    tile = dict(BLOCK_N=block_n, BLOCK_B=block_b, EVEN=w.n_blocks % block_b == 0, ASM=not INTERPRET,
                num_warps=warps)
    if w.qtype in (_T.Q8_0, _T.Q4_0):
        d, qs = w.fields
        _block32_dot_kernel[grid](d, _words(qs), *x_args, KIND=0 if w.qtype == _T.Q8_0 else 1, **tile)
    elif w.qtype == _T.Q4_K:
        dm, scales, qs = w.fields
        _q45_k_dot_kernel[grid](dm, scales, _words(qs), _words(qs), *x_args, FIVE=False, **tile)
    elif w.qtype == _T.Q5_K:
        dm, scales, qh, qs = w.fields
        _q45_k_dot_kernel[grid](dm, scales, _words(qh), _words(qs), *x_args, FIVE=True, **tile)
    else:
        ql, qh, scales, d = w.fields
        _q6_k_dot_kernel[grid](_words(ql), _words(qh), scales, d, *x_args, **tile)
    return out
