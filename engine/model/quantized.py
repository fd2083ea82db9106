"""A weight matrix kept on the device in its GGUF quantization, instead of dequantized at load.

A Q4_K_M file's matrices are 4.5–6.6 bits a weight; dequantized to bf16 they take 2.5–3.5× the memory and every
decode step reads 2.5–3.5× the bytes. Kept as the file's blocks (`raw`, uint8 [rows, row bytes]): a decode step's
one-row product runs kernels.quant_gemv, dequantizing in registers; a product of many rows (a prefill) dequantizes
a band of rows at a time into bf16 (kernels.quant_gemv.dequantize_rows, one kernel) and multiplies it with cuBLAS,
so no full bf16 copy of any matrix ever exists.
Matrices the decoder fuses (q, k, v; gate, up) stay separate parts, since a Q4_K_M file mixes types among them
(attn_v and ffn_down in Q6_K in some layers); each part writes its slice of the fused output.

Shapes: x [T, K]; the matrix [N, K] is the parts' rows stacked in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from torch import Tensor

from kvchat.engine.gguf.dequant import dequantize
from kvchat.kernels.quant_gemv import dequantize_rows, quant_gemv, quant_gemv_runs

# Rows dequantized at once by a many-row product: a band of at most this many weights (32 MiB of bf16), so the
# output matrix of a 128k vocabulary never exists whole in bf16.
BAND_ELEMENTS = 1 << 24


@dataclass
class QuantizedPart:
    raw: Tensor  # uint8 [rows, row bytes], the file's blocks
    qtype: GGMLQuantizationType

    @property
    def rows(self) -> int:
        return self.raw.shape[0]


class QuantizedMatrix:
    """[N, K] as GGUF blocks on the device; products come out in `dtype` (the model's activations)."""

    def __init__(self, parts: list[QuantizedPart], n_in: int, dtype: torch.dtype):
        for part in parts:
            block, size = GGML_QUANT_SIZES[part.qtype]
            if part.raw.dtype != torch.uint8 or part.raw.dim() != 2 or part.raw.shape[1] != n_in // block * size:
                raise ValueError(f"a {part.qtype.name} part of {n_in} columns needs rows of {n_in // block * size} "
                                 f"bytes, got {tuple(part.raw.shape)}")
        self.parts, self.n_in, self.dtype = parts, n_in, dtype
        self.n_out = sum(p.rows for p in parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].raw.device

    @property
    def nbytes(self) -> int:
        return sum(p.raw.numel() for p in self.parts)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x, W, bias) for x [T, K] -> [T, N] in x's dtype."""
        out = torch.empty(x.shape[0], self.n_out, dtype=x.dtype, device=x.device)
        start = 0
        for part in self.parts:
            stop = start + part.rows
            if x.shape[0] == 1 and quant_gemv_runs(x, part.raw, part.qtype):
                quant_gemv(x, part.raw, part.qtype, out=out[:, start:stop])
            else:
                band = max(1, BAND_ELEMENTS // self.n_in)
                for r in range(0, part.rows, band):
                    w = self._dequantized(part, r, min(r + band, part.rows), x.dtype)
                    torch.matmul(x, w.t(), out=out[:, start + r:start + r + w.shape[0]])
            start = stop
        return out if bias is None else out.add_(bias)

    def rows(self, ids: Tensor) -> Tensor:
        """The rows `ids` [T] dequantized, [T, K] in `dtype`: an embedding lookup reads T rows, not the table."""
        # A token table is one matrix (one part); no host-side test, so a captured decode step can embed too.
        (part,) = self.parts
        ids = ids.to(self.device)
        return dequantize(part.raw[ids].reshape(-1), part.qtype, (ids.shape[0], self.n_in), self.dtype)

    def _dequantized(self, part: QuantizedPart, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
        """Rows [r0, r1) in `dtype`: one Triton kernel where the type has one, on CUDA (in the CPU's interpreter the
        torch decoders are faster, and equal), else the torch decoders."""
        w = dequantize_rows(part.raw[r0:r1], part.qtype, dtype) if part.raw.is_cuda else None
        return w if w is not None else dequantize(part.raw[r0:r1].reshape(-1), part.qtype, (r1 - r0, self.n_in),
                                                  dtype)


def linear(x: Tensor, weight: Tensor | QuantizedMatrix, bias: Tensor | None = None) -> Tensor:
    """F.linear over either kind of weight."""
    if isinstance(weight, QuantizedMatrix):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)
