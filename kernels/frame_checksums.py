"""Frames' position-weighted checksums in one kernel (issue 44's lazy resume checks each unit frame it reads).

A frame is a run of rows of 16-bit words, back to back with the others; its checksums are, over its words w_i (i
the word's place in the frame, from 0), sum (i + 1) * w_i and sum (i + 1)^2 * w_i modulo 2^64 (storage.unit_frames
defines them for the file format; this is the same arithmetic, checked against it in tests/test_frame_checksums.py).
The torch way takes ~14 small kernels a layer (each row's frame and place, a float64 product, the per-frame sums):
~38 ms of a 32k chat's first token on the 8B shape, 32 layers of ~1,000 frames (H200, 2026-11-29). Here one
program a frame walks its words in blocks, in int64, which wraps modulo 2^64 as the definition does.

`frame_checksums_ref` is the plain-torch definition the kernel is tested against.

Shapes: R rows of W words (a row: one token's K or V of one head), F frames.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton, triton_kernel_runs_on

if triton is not None:
    import triton.language as tl

BLOCK_WORDS = 1024  # words a program sums at a time (a 16-token bfloat16 frame of head size 128: 4 blocks)


def frame_checksums_ref(words: Tensor, first_row: Tensor, rows: Tensor) -> Tensor:
    """words [R, W] int16; frame f is rows [first_row[f], first_row[f] + rows[f]) -> [F, 2] int64: its two sums."""
    n_frames, width = len(rows), words.shape[1]
    out = torch.zeros(n_frames, 2, dtype=torch.int64, device=words.device)
    for f, (a, n) in enumerate(zip(first_row.tolist(), rows.tolist())):
        w = words[a : a + n].reshape(-1).to(torch.int64)
        place = torch.arange(1, n * width + 1, dtype=torch.int64, device=words.device)
        out[f, 0] = (place * w).sum()
        out[f, 1] = (place * place * w).sum()
    return out


if triton is not None:

    @triton.jit
    def _frame_checksums_kernel(words_ptr, first_ptr, rows_ptr, out_ptr, width, BLOCK: tl.constexpr):
        f = tl.program_id(0).to(tl.int64)
        start = tl.load(first_ptr + f).to(tl.int64) * width  # the frame's first word
        n_words = tl.load(rows_ptr + f).to(tl.int64) * width
        lin = tl.zeros([BLOCK], dtype=tl.int64)
        sq = tl.zeros([BLOCK], dtype=tl.int64)
        offsets = tl.arange(0, BLOCK).to(tl.int64)
        for block in range(0, n_words, BLOCK):
            at = block + offsets
            ok = at < n_words
            w = tl.load(words_ptr + start + at, mask=ok, other=0).to(tl.int64)
            place = at + 1
            lin += place * w
            sq += place * place * w
        tl.store(out_ptr + 2 * f, tl.sum(lin, axis=0))
        tl.store(out_ptr + 2 * f + 1, tl.sum(sq, axis=0))


def frame_checksums(words: Tensor, first_row: Tensor, rows: Tensor) -> Tensor:
    """`frame_checksums_ref` in one kernel where triton runs (CUDA, or its interpreter), else the reference:
    words [R, W] int16 contiguous, first_row and rows [F] integer, on the words' device."""
    if words.dim() != 2 or words.dtype != torch.int16 or not words.is_contiguous():
        raise ValueError(f"frame checksums take words [R, W] int16 contiguous, got {tuple(words.shape)} "
                         f"{words.dtype}")
    if first_row.shape != rows.shape or first_row.dim() != 1:
        raise ValueError("one first row and one row count a frame")
    if not triton_kernel_runs_on(words.device):
        return frame_checksums_ref(words, first_row, rows)
    out = torch.empty(len(rows), 2, dtype=torch.int64, device=words.device)
    if len(rows):
        _frame_checksums_kernel[(len(rows),)](words, first_row.contiguous(), rows.contiguous(), out,
                                              words.shape[1], BLOCK=BLOCK_WORDS if not INTERPRET else 64,
                                              num_warps=4)
    return out
