"""SwiGLU's silu(gate) * up over the fused gate/up projection, in one kernel rather than two (a slice-and-silu and a
multiply): decode steps launch one per layer. Computed in float32 and rounded once.

`silu_mul_ref` is the plain-torch definition the kernel is tested against.
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

BLOCK = 1024


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2F] (gate first) -> silu(gate) * up [T, F] in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, q_ptr, d_ptr, s_ptr, n_cols, BLOCK: tl.constexpr,
                         QUANTIZE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, out, mask=ok)
        if QUANTIZE:  # the output as the down product's int8 x (kernels.quant_dot), as rounded to its dtype
            groups = tl.reshape(out.to(tl.float32), [BLOCK // 32, 32])
            g = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
            store_quantized_groups(groups, g, g < n_cols // 32, q_ptr, d_ptr, s_ptr)


def silu_mul(gate_up: Tensor, quantize: bool = False) -> Tensor | tuple[Tensor, QuantX]:
    """`silu_mul_ref` in one kernel: gate_up [T, 2F] contiguous. `quantize` (one row, F a multiple of 32): also
    the result as kernels.quant_dot's int8 x, made in the same kernel (returned second; equal to quantize_x of the
    first)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul takes a contiguous [T, 2F]; got {tuple(gate_up.shape)}")
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    if quantize and (n_rows != 1 or n_cols % X_GROUP):
        raise ValueError(f"a quantized silu_mul takes one row of a multiple of {X_GROUP} values, got "
                         f"{tuple(gate_up.shape)}")
    out = torch.empty(n_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    xq = empty_quant_x(n_cols, gate_up.device) if quantize else None
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, BLOCK))](gate_up, out,
                                                           *((xq.q, xq.d, xq.sums) if quantize else (out, out, out)),
                                                           n_cols, BLOCK=BLOCK, QUANTIZE=quantize,
                                                           num_warps=1 if INTERPRET else 4)
    return (out, xq) if quantize else out
