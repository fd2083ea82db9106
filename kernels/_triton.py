"""The Triton bootstrap every kernel in kernels/ shares: the import guard, the interpreter switch, the shape and
dtype gates, and the tile and online-softmax helpers of the two-pass attention-mass kernels (kernels.round_scores,
kernels.slot_mass).

triton ships Linux wheels only; without it `triton` and `tl` are None and every kernel's entry point takes its torch
reference path. With TRITON_INTERPRET=1 set before the process starts, the kernels run on the CPU in triton's
interpreter (the tests' way of checking them without a GPU).

Shapes (the mass kernels): T query tokens, H query heads, Hkv KV heads (H = Hkv * n_rep), S keys, D head size.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships Linux wheels only; elsewhere every call takes the torch path
    triton = None
    tl = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Keys are split into chunks of a multiple of this (>= the largest BLOCK_N, so no split ends inside a key block
# except at S) and never shorter, so that each program walks a few key blocks rather than one.
KEY_SPLIT_QUANTUM = 256


def _interpreting() -> bool:
    """Whether triton runs kernels in its interpreter. Read once, at import, because that is when `triton.jit`
    itself decides between compiling and interpreting: setting TRITON_INTERPRET later changes nothing."""
    if triton is None:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # triton < 3.4 has no knobs module
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRET = _interpreting()


def triton_kernel_runs_on(device: torch.device | str) -> bool:
    """Whether the kernels run their Triton path for tensors on this device (else their torch reference): on CUDA
    when triton is installed, and on any device in triton's interpreter (TRITON_INTERPRET=1 at import)."""
    if triton is None:
        return False
    return INTERPRET or torch.device(device).type == "cuda"


def tuning_time(kernel_call, quantiles=None, runs: int = 7):
    """The autotuner's timing of one configuration (triton.autotune's `do_bench`): milliseconds by CUDA events, the
    median (or the `quantiles`) of `runs` calls after one warm-up. Unlike triton.testing.do_bench it allocates
    nothing: that one clears the L2 cache between runs by writing a 256 MiB buffer, which a first tuning run inside
    a tight GPU memory budget (--gpu-memory, issue 41) could not allocate. The timings are of a warm L2 (50 MB on
    an H100): the tiles' order, which is all the autotuner reads, is what matters."""
    kernel_call()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel_call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    if quantiles is None:
        return times[len(times) // 2]
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_length(n_programs: int, n_keys: int, device: torch.device) -> int:
    """Keys per split: split the keys until the grid (`n_programs` per split: row tiles x heads) has a few programs
    per SM, each split a multiple of KEY_SPLIT_QUANTUM keys and at least that long."""
    most_splits = math.ceil(n_keys / KEY_SPLIT_QUANTUM)
    if device.type == "cuda":
        target_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        n_splits = min(most_splits, math.ceil(target_programs / n_programs))
    else:  # the interpreter runs programs one by one: the splitting costs nothing, and the tests cross splits
        n_splits = most_splits
    return math.ceil(math.ceil(n_keys / n_splits) / KEY_SPLIT_QUANTUM) * KEY_SPLIT_QUANTUM


def merge_splits(row_max: Tensor, row_sum: Tensor) -> Tensor:
    """The splits' statistics ([heads, n_splits, n_rows], log2 domain) merged into one log2-sum-exp2 per row:
    [heads, n_rows]."""
    overall_max = row_max.amax(dim=1, keepdim=True)
    row_lse = overall_max + torch.log2((row_sum * torch.exp2(row_max - overall_max)).sum(dim=1, keepdim=True))
    return row_lse.squeeze(1).contiguous()


if triton is not None:

    @triton.jit
    def load_query_rows(q_ptr, rows, row_ok, kv_head, n_rep, stride_qt, stride_qh, stride_qd,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows r of KV head g are (token r // n_rep, query head g * n_rep + r % n_rep): [BLOCK_M, BLOCK_D]."""
        dims = tl.arange(0, BLOCK_D)
        token = rows // n_rep
        head = kv_head * n_rep + rows % n_rep
        ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
        return tl.load(ptrs, mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)

    @triton.jit
    def scores_log2(q, k_head_ptr, keys, key_ok, stride_ks, stride_kd, qk_scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DOT_IN_FP32: tl.constexpr):
        """Scores of a [BLOCK_M] x [BLOCK_N] tile in the log2 domain (scale * log2(e) folded in, so exp2 gives
        the softmax numerators), -inf for keys outside the split: [BLOCK_M, BLOCK_N] float32."""
        dims = tl.arange(0, BLOCK_D)
        k_ptrs = k_head_ptr + keys[None, :] * stride_ks + dims[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]
        k_t = tl.load(k_ptrs, mask=key_ok[None, :] & (dims[:, None] < HEAD_DIM), other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale_log2
        return tl.where(key_ok[None, :], scores, float("-inf"))

    @triton.jit
    def online_softmax_step(row_max, row_sum, scores):
        """One key block into each row's running max and sum of exp2 (flash attention's m_i and l_i). A row may see
        none of the block's keys (all -inf: masked keys): its max is kept finite for the update, so that
        exp2(-inf - max) gives 0 rather than NaN."""
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.sum(tl.exp2(scores - safe_max[:, None]), axis=1)
        return new_max, row_sum
