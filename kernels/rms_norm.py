"""RMSNorm for decode steps, optionally fused with the residual add before it: one kernel instead of the 3-5 that
`x.float()`, F.rms_norm and `.to(dtype)` launch (a decode step of an 8B model runs 65 norms; each small kernel
costs a few microseconds of a ~7 ms step). Statistics in float32, as engine.model.RMSNorm and llama.cpp do.

`add_rms_norm_ref` is the plain-torch definition the kernel is tested against.

Shapes: T rows (1 in decode), d model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton
from kvchat.kernels.quant_dot import X_GROUP, QuantX, empty_quant_x

if triton is not None:
    import triton.language as tl

    from kvchat.kernels.quant_dot import store_quantized_groups


def add_rms_norm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [T, d] (x's dtype), weight [d] float32 -> (s = x + residual, rms_norm(s) in s's dtype); without
    a residual s is x itself."""
    s = x if residual is None else x + residual
    return s, F.rms_norm(s.float(), weight.shape, weight, eps).to(s.dtype)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, d_ptr, s_ptr, n_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * n_cols + cols, mask=ok, other=0.0)
            # rounded to the activations' dtype, as torch's x + residual is
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = (xf * inv_rms * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, out, mask=ok)
        if QUANTIZE:  # the output as a one-row product's int8 x (kernels.quant_dot), as rounded to its dtype
            groups = tl.reshape(out.to(tl.float32), [BLOCK // 32, 32])
            g = tl.arange(0, BLOCK // 32)
            store_quantized_groups(groups, g, g < n_cols // 32, q_ptr, d_ptr, s_ptr)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                 quantize: bool = False) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, QuantX]:
    """`add_rms_norm_ref` in one kernel: x, residual [T, d] contiguous, weight [d] float32. `quantize` (one row, d a
    multiple of 32): also the normed row as kernels.quant_dot's int8 x, made in the same kernel (a third result;
    equal to quantize_x of the second)."""
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1],) or weight.dtype != torch.float32:
        raise ValueError(f"rms norm takes x [T, d] contiguous and a float32 weight [d]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError("the residual must match x's shape and dtype, contiguous")
    if quantize and (x.shape[0] != 1 or x.shape[1] % X_GROUP):
        raise ValueError(f"a quantized norm takes one row of a multiple of {X_GROUP} values, got {tuple(x.shape)}")
    s = x if residual is None else torch.empty_like(x)
    out = torch.empty_like(x)
    xq = empty_quant_x(x.shape[1], x.device) if quantize else None
    block = max(triton.next_power_of_2(x.shape[1]), 32)
    _add_rms_norm_kernel[(x.shape[0],)](x, x if residual is None else residual, weight, s, out,
                                        *((xq.q, xq.d, xq.sums) if quantize else (out, out, out)), x.shape[1], eps,
                                        HAS_RESIDUAL=residual is not None, BLOCK=block, QUANTIZE=quantize,
                                        num_warps=1 if INTERPRET else min(16, max(1, block // 256)))
    return (s, out, xq) if quantize else (s, out)
