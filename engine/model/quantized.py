"""A weight matrix kept on the device in its GGUF quantization, instead of dequantized at load.

A Q4_K_M file's matrices are 4.5–6.6 bits a weight; dequantized to bf16 they take 2.5–3.5× the memory and every
decode step reads 2.5–3.5× the bytes. Kept as the file's blocks (kernels.quant_gemv.QuantBlocks: the same bytes,
each field of a block in an array of its own, repacked once at load): a decode step's
one-row product runs kernels.quant_gemv, dequantizing in registers; a product of many rows (a prefill) dequantizes
a band of rows at a time into bf16 (kernels.quant_gemv.dequantize_rows, one kernel) and multiplies it with cuBLAS,
so no full bf16 copy of any matrix ever exists.
Matrices the decoder fuses (q, k, v; gate, up) are stacked into one part where their types agree (one kernel launch
for gate and up, and for q, k and v of one type), and stay separate parts where they differ, since a Q4_K_M file
mixes types among them (attn_v in Q6_K in some layers); each part writes its slice of the fused output.

A 16-bit model's one-row products quantize x to int8 once per product and take integer dot products
(kernels.quant_dot, llama.cpp's way: half the instructions a weight, docs/benchmarks.md, issue 41) for the types
with such a kernel; Q5_0 parts and float32 models keep the float GEMVs (kernels.quant_gemv), which round nothing
beyond the weights' own.

Shapes: x [T, K]; the matrix [N, K] is the parts' rows stacked in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.gguf.dequant import dequantize
from kvchat.kernels._triton import INTERPRET
from kvchat.kernels.quant_dot import QUANT_DOT_TYPES, X_GROUP, QuantX, quant_dot, quant_dot_runs, quantize_x
from kvchat.kernels.quant_gemv import QuantBlocks, dequantize_rows, quant_gemv, quant_gemv_runs

# Rows dequantized at once by a many-row product: a band of at most this many weights (32 MiB of bf16), so the
# output matrix of a 128k vocabulary never exists whole in bf16.
BAND_ELEMENTS = 1 << 24
# A band's rows are a multiple of this: each band's slice of the output then starts 16-byte aligned and fills
# cuBLAS's tiles. A band of down's 1,170 rows (2^24 / 14,336) sent cuBLAS to a 2-element-aligned sm80 kernel at
# ~0.6x the speed of the others: 125 of an 8k prefill's 318 ms on an H100 (docs/probes/quant_profile.py, 2026-11-27).
BAND_ROW_MULTIPLE = 128
# A prompt of at most SHORT_PREFILL tokens takes bands four times as large: its product launches a kernel and a
# GEMM per band from Python, and at 2k tokens on an H100 those ~960 launches, not the GPU, set the pace (a 2k
# prefill at 0.70x the bf16 path's, 2026-11-27). Its activations are at most half of a 4,096-token chunk's, which
# pays for the larger bands (engine.memory_plan.workspace_bytes plans the higher of the two).
SHORT_PREFILL = 2048
SHORT_BAND_ELEMENTS = 4 * BAND_ELEMENTS
# The activations' dtypes whose one-row products take the integer kernels (x rounded to int8 per 32 values).
INT8_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


class QuantizedMatrix:
    """[N, K] as GGUF blocks on the device, one QuantBlocks per part; products come out in x's dtype."""

    def __init__(self, parts: list[QuantBlocks], n_in: int, dtype: torch.dtype):
        for part in parts:
            if part.n_in != n_in:
                raise ValueError(f"a {part.qtype.name} part of {part.n_in} columns in a matrix of {n_in}")
        runs: list[list[QuantBlocks]] = []  # neighbours of one type, stacked: one launch per run
        for part in parts:
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        parts = [run[0] if len(run) == 1 else QuantBlocks.stack(run) for run in runs]
        self.parts, self.n_in, self.dtype = parts, n_in, dtype
        self.n_out = sum(p.n_out for p in parts)
        # One-row products of 16-bit x through kernels.quant_dot where a part's type has a kernel (off: the float
        # GEMVs for every part; the engine bench's comparison of the two).
        self.int8_activations = True

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def takes_int8(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a one-row product of x in `dtype` on `device` quantizes x for kernels.quant_dot (some part has
        such a kernel): a kernel that makes x may then quantize it too and hand it to `linear`."""
        return (self.int8_activations and dtype in INT8_ACTIVATION_DTYPES and (device.type == "cuda" or INTERPRET)
                and any(p.qtype in QUANT_DOT_TYPES for p in self.parts) and self.n_in % X_GROUP == 0)

    def linear(self, x: Tensor, bias: Tensor | None = None, xq: QuantX | None = None) -> Tensor:
        """F.linear(x, W, bias) for x [T, K] -> [T, N] in x's dtype; `xq`: one row of x already quantized (as
        kernels.quant_dot.quantize_x would), for the parts that take it."""
        out = torch.empty(x.shape[0], self.n_out, dtype=x.dtype, device=x.device)
        int8 = x.shape[0] == 1 and self.takes_int8(x.dtype, x.device)  # x quantized once for the parts that take it
        start = 0
        for part in self.parts:
            stop = start + part.n_out
            if int8 and quant_dot_runs(x, part):
                if xq is None:
                    xq = quantize_x(x)
                quant_dot(xq, part, out[:, start:stop])
            elif x.shape[0] == 1 and quant_gemv_runs(x, part):
                quant_gemv(x, part, out=out[:, start:stop])
            else:
                band = band_rows(self.n_in, x.shape[0])
                for r in range(0, part.n_out, band):
                    w = self._dequantized(part.row_slice(r, min(r + band, part.n_out)), x.dtype)
                    torch.matmul(x, w.t(), out=out[:, start + r:start + r + w.shape[0]])
            start = stop
        return out if bias is None else out.add_(bias)

    def rows(self, ids: Tensor) -> Tensor:
        """The rows `ids` [T] dequantized, [T, K] in `dtype`: an embedding lookup reads T rows, not the table."""
        # A token table is one matrix (one part); no host-side test, so a captured decode step can embed too.
        (part,) = self.parts
        rows = part.take(ids.to(self.device)).file_bytes()
        return dequantize(rows.reshape(-1), part.qtype, (ids.shape[0], self.n_in), self.dtype)

    def _dequantized(self, band: QuantBlocks, dtype: torch.dtype) -> Tensor:
        """A band of rows in `dtype`: one Triton kernel on CUDA (in the CPU's interpreter the torch decoders are
        faster, and equal), else the torch decoders."""
        w = dequantize_rows(band, dtype) if band.device.type == "cuda" else None
        return w if w is not None else dequantize(band.file_bytes().reshape(-1), band.qtype, (band.n_out, self.n_in),
                                                  dtype)


def band_rows(n_in: int, n_tokens: int = SHORT_PREFILL + 1) -> int:
    """Rows of a matrix n_in wide dequantized at once by a product with n_tokens rows of x."""
    rows = max(1, (SHORT_BAND_ELEMENTS if n_tokens <= SHORT_PREFILL else BAND_ELEMENTS) // n_in)
    return rows - rows % BAND_ROW_MULTIPLE if rows >= BAND_ROW_MULTIPLE else rows


def linear(x: Tensor, weight: Tensor | QuantizedMatrix, bias: Tensor | None = None, xq: QuantX | None = None
           ) -> Tensor:
    """F.linear over either kind of weight (`xq`: QuantizedMatrix.linear's)."""
    if isinstance(weight, QuantizedMatrix):
        return weight.linear(x, bias, xq)
    return F.linear(x, weight, bias)
