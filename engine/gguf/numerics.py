"""llama.cpp's CPU numerics, reproduced so that our logits can equal its logits.

For a matrix product with F16, BF16 or quantized weights, ggml's CPU back end first converts the *activations* to
the weight type's "vec_dot" type: F16 -> fp16, BF16 -> bf16, Q4_0/Q5_0/Q8_0 -> Q8_0 (blocks of 32, one fp16 scale),
K-quants -> Q8_K (blocks of 256, one fp32 scale). Exact dequantized math differs from that by up to ~1e-2 of the
largest logit; rounding the activations the same way brings the difference down to float summation order.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

Rounding = Callable[[Tensor], Tensor]


def _to_half(x: Tensor) -> Tensor:
    return x.to(torch.float16).to(x.dtype)


def _to_bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _to_q8_0(x: Tensor) -> Tensor:
    """ggml's x86 quantize_row_q8_0: per 32 values d = amax/127 (stored as fp16), q = round_half_even(x * 127/amax).
    The multiplier is 127/amax, not 1/d: the two differ in the last bit, which decides some roundings."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d16 = (amax / 127).to(torch.float16).float()
    return (torch.round(blocks * inv) * d16).reshape(x.shape).to(x.dtype)


def _to_q8_k(x: Tensor) -> Tensor:
    """ggml quantize_row_q8_K: per 256 values, iscale = -127/max (max = the signed value of largest |x|),
    q = min(127, round(iscale * x)), d = 1/iscale in fp32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 256)
    at = blocks.abs().argmax(-1, keepdim=True)
    signed_max = blocks.gather(-1, at)
    iscale = torch.where(signed_max != 0, -127.0 / signed_max, torch.zeros_like(signed_max))
    q = torch.clamp(torch.round(blocks * iscale), max=127)
    d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(x.shape).to(x.dtype)


_VEC_DOT_ROUNDING: dict[Q, Rounding | None] = {
    Q.F32: None, Q.F16: _to_half, Q.BF16: _to_bf16,
    Q.Q8_0: _to_q8_0, Q.Q4_0: _to_q8_0, Q.Q5_0: _to_q8_0,
    Q.Q4_K: _to_q8_k, Q.Q5_K: _to_q8_k, Q.Q6_K: _to_q8_k,
}


def input_rounding(qtypes: list[Q]) -> Rounding | None:
    """The activation rounding llama.cpp applies before multiplying by weights of these types (one fused matrix may
    hold several tensors; they must agree)."""
    kinds = {_VEC_DOT_ROUNDING[q] for q in qtypes}
    if len(kinds) != 1:
        # Tensors fused into one matrix whose llama.cpp roundings differ: keep exact math for that matrix.
        return None
    return kinds.pop()


def gelu_fp16_table(x: Tensor) -> Tensor:
    """GELU (tanh approximation) as ggml's CPU back end computes it: looked up in a table indexed by the fp16
    value of x and holding fp16 results (GGML_GELU_FP16), x for x >= 10 and 0 for x <= -10."""
    table = torch.nn.functional.gelu(_to_half(x.float()), approximate="tanh")
    y = _to_half(table)
    return torch.where(x >= 10, x.float(), torch.where(x <= -10, torch.zeros_like(y), y)).to(x.dtype)
