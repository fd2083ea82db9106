"""One token's matrix product, y = x W^T (+ b), for decode steps: a Triton GEMV.

A decode step multiplies one row by every weight matrix, so it is a pure weight read. On the H100 cuBLAS picks
split-K GEMM kernels for these shapes that read the 8B model's q/k/v and output projections at 1.4-1.7 TB/s in
isolation (docs/probes/gemv.py); this kernel, rows of W in tiles of 8 x 512 with the products summed in float32
per element and reduced once at the end, reads them 4-17% faster, and needs no split-K reduction kernel after.

`gemv_ref` (F.linear) is the definition the kernel is tested against.

Shapes: d_in = K, d_out = N; W [N, K] row-major, as nn.Linear stores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton

if triton is not None:
    import triton.language as tl


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [1, K], weight [N, K], bias [N] -> [1, N]."""
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, n_out, n_in,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        row_start = w_ptr + rows[:, None].to(tl.int64) * n_in
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k in range(0, n_in, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            col_ok = cols < n_in
            w = tl.load(row_start + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_runs(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `gemv` takes these operands (one contiguous row, a row-major weight, one dtype throughout)."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],))))


def default_tiles(element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): measured on the H100 over the 8B shape's four matrices
    (docs/probes/gemv.py). In the interpreter, which runs programs one after another in Python, few large tiles
    (the tests' odd sizes still leave partial tiles on both sides)."""
    if INTERPRET:
        return 64, 256, 1, 1
    return 8, 512 if element_size == 2 else 256, 4, 2


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
         tiles: tuple[int, int, int, int] | None = None) -> Tensor:
    """`gemv_ref` in one kernel where `gemv_runs` (else F.linear itself); `tiles` as `default_tiles` gives."""
    if not gemv_runs(x, weight, bias):
        return F.linear(x, weight, bias)
    n_out, n_in = weight.shape
    y = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tiles or default_tiles(x.element_size())
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](weight, x, weight if bias is None else bias, y, n_out, n_in,
                                                 HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                                                 num_warps=warps, num_stages=stages)
    return y
