"""SwiGLU's silu(gate) * up over the fused gate/up projection, in one kernel rather than two (a slice-and-silu and a
multiply): decode steps launch one per layer. Computed in float32 and rounded once.

`silu_mul_ref` is the plain-torch definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton

if triton is not None:
    import triton.language as tl

BLOCK = 1024


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2F] (gate first) -> silu(gate) * up [T, F] in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: Tensor) -> Tensor:
    """`silu_mul_ref` in one kernel: gate_up [T, 2F] contiguous."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul takes a contiguous [T, 2F]; got {tuple(gate_up.shape)}")
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, BLOCK))](gate_up, out, n_cols, BLOCK=BLOCK,
                                                           num_warps=1 if INTERPRET else 4)
    return out
