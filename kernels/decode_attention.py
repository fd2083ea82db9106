"""Decode attention: one new token's queries against a KV cache, split over the keys (flash-decoding).

A decode step has one query token, so attention is a matrix-vector product per head and bound by reading K and V.
SDPA's kernels put one thread block on each (KV head, query tile): for an 8B model (8 KV heads) at 32k tokens that
is 8 blocks on a 132-SM GPU, each walking 32k keys. Here the keys are split across many programs (grid: KV heads x
splits), each computing a partial softmax over its split; a second kernel merges the splits by their log-sum-exp.

* Grouped-query heads: the n_rep query heads sharing a KV head are the rows of one tile, so every K/V tile loaded
  serves all of them (MHA has one row, padded to the 16 rows tl.dot needs; MQA has all heads in one tile).
* The number of keys is read from a device tensor (`length`), and each program derives its share of them from it
  at run time: one captured CUDA graph serves every length up to the buffer's capacity, and the work stays spread
  over all splits at every length.
* `slots` (optional) lists the cache slots to attend to, in any order, and `length` then counts the listed ones:
  a policy's visible subset (Round Attention's kept rounds, a restricted view) in the same kernel. Slots [Hkv, C']
  give each KV head its own list (LoopServe's per-head selection), of the same length.
* `window` (optional): a sliding-window layer (Gemma 3) attends only to the last `window` of those keys, and the
  splits share out just them.

`decode_attention_ref` is the plain-torch definition the kernel is tested against.

Shapes: H query heads, Hkv KV heads (H = Hkv * n_rep), D head size, C cache capacity (slots), P splits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, MAX_HEAD_DIM, SUPPORTED_DTYPES, triton, triton_kernel_runs_on

if triton is not None:
    import triton.language as tl

# Query heads per KV head a tile holds at most (MQA with up to 128 query heads).
MAX_GROUP = 128
# The window given to the kernel when there is none: larger than any length, so it starts at key 0.
_NO_WINDOW = 2**31 - 1


def decode_attention_ref(q: Tensor, k: Tensor, v: Tensor, length: Tensor | int, slots: Tensor | None = None,
                         scale: float | None = None, window: int = 0, ring: int = 0) -> Tensor:
    """q [H, D], k / v [Hkv, C, D], length: the keys attended to (slots [0, length), or the first `length` entries
    of `slots`; with `window`, only the last `window` of them; with `ring`, slot s is at s % ring) -> [H, D] in
    q's dtype, computed in float32."""
    n_heads, head_dim = q.shape
    n_kv_heads = k.shape[0]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    n = int(length)
    first = max(0, n - window) if window else 0
    if slots is None:
        index = torch.arange(first, n, device=k.device).expand(n_kv_heads, -1)
        if ring:
            index = index % ring
    else:
        index = slots.to(k.device, torch.long).expand(n_kv_heads, -1)[:, first:n]
    gather = index[:, :, None].expand(-1, -1, head_dim)
    keys = k.gather(1, gather).float().repeat_interleave(n_heads // n_kv_heads, dim=0)  # [H, n, D]
    values = v.gather(1, gather).float().repeat_interleave(n_heads // n_kv_heads, dim=0)
    probs = torch.softmax(torch.einsum("hd,hnd->hn", q.float(), keys) * scale, dim=-1)  # [H, n]
    return torch.einsum("hn,hnd->hd", probs, values).to(q.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, length_ptr, slots_ptr, out_ptr, lse_ptr,
                      stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_sh,
                      n_rep, qk_scale_log2, window, ring,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      N_SPLITS: tl.constexpr, SUBSET: tl.constexpr, RING: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      DOT_IN_FP32: tl.constexpr):
        """Per (KV head, split): the n_rep rows' softmax-weighted sum of V over the split's keys, normalized within
        the split, and the split's log2-sum-exp2 of the scores; out [H, P, D], lse [H, P] (float32)."""
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        n_keys = tl.load(length_ptr).to(tl.int32)
        first = tl.maximum(n_keys - window, 0)
        # Every split gets the same whole number of key blocks of the current length (the last may get fewer).
        per_split = tl.cdiv(tl.cdiv(n_keys - first, N_SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, n_keys)

        rows = tl.arange(0, BLOCK_H)
        row_ok = rows < n_rep
        heads = kv_head * n_rep + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

        row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            key_ok = idx < hi
            if SUBSET:
                slot = tl.load(slots_ptr + kv_head * stride_sh + idx, mask=key_ok, other=0).to(tl.int64)
            elif RING:
                slot = (idx % ring).to(tl.int64)
            else:
                slot = idx.to(tl.int64)
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_head + slot[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_head + slot[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
            if DOT_IN_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [H_blk, N]
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            # The first block of a split holds at least one key, so new_max is finite from there on.
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            alpha = tl.exp2(row_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            row_max = new_max

        # An empty split (past the length) leaves lse = -inf, and the merge gives it no weight.
        has_keys = row_sum > 0
        out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
        lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        at = heads * N_SPLITS + split
        tl.store(out_ptr + at[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(lse_ptr + at, lse, mask=row_ok)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_oh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, N_SPLITS: tl.constexpr,
                      BLOCK_P: tl.constexpr):
        """Per query head: the splits' partial outputs weighted by their share of the softmax: out [H, D]."""
        head = tl.program_id(0)
        splits = tl.arange(0, BLOCK_P)
        split_ok = splits < N_SPLITS
        dims = tl.arange(0, BLOCK_D)
        lse = tl.load(lse_ptr + head * N_SPLITS + splits, mask=split_ok, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weight = tl.exp2(lse - top)  # the splits holding keys; at least one does, so top is finite
        part = tl.load(part_ptr + (head * N_SPLITS + splits[:, None]) * HEAD_DIM + dims[None, :],
                       mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def kernel_shape_reason(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device | str) -> str | None:
    """Why an attention kernel here (decode, sparse prefill) cannot run for this shape on this device, or None."""
    if not triton_kernel_runs_on(device):
        return "triton is not installed" if triton is None else f"no Triton kernels on {torch.device(device).type}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the kernel takes float32, float16, bfloat16)"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head size {head_dim} (the kernel takes up to {MAX_HEAD_DIM})"
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        return f"{n_heads} query heads over {n_kv_heads} KV heads"
    return None


def unsupported_reason(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> str | None:
    """Why `decode_attention` cannot run its kernel for this shape on this device, or None if it can."""
    reason = kernel_shape_reason(n_heads, n_kv_heads, head_dim, dtype, device)
    if reason:
        return reason
    if n_heads // n_kv_heads > MAX_GROUP:
        return f"{n_heads // n_kv_heads} query heads per KV head (the kernel takes up to {MAX_GROUP})"
    return None


def default_splits(n_kv_heads: int, capacity: int, device: torch.device) -> int:
    """Splits for a cache of `capacity` slots: about four programs per SM, and no more splits than key blocks
    (a shorter length leaves the later splits empty, which costs a program that returns at once). In the
    interpreter a few, so the tests cross splits without running for long. Measured on the H100 for the 8B shape
    (docs/probes/decode_tiles.py): 16-64 splits are within noise of each other from 8k to 64k; at 1k, 5 splits
    take twice as long as 16 or more."""
    if device.type != "cuda":
        return max(1, min(4, capacity // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(4 * sms / n_kv_heads), math.ceil(capacity / 64)))


def _tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): the keys per step and the launch shape."""
    if INTERPRET:
        return 32, 1, 1  # small blocks: the tests' lengths cross many of them
    if head_dim > 128 or dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 2


def _check(q: Tensor, k: Tensor, v: Tensor, length: Tensor, slots: Tensor | None) -> None:
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[1]:
        raise ValueError(f"decode attention takes q [H, D] and k, v [Hkv, C, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (k.dtype == v.dtype == q.dtype) or not (k.device == v.device == q.device == length.device):
        raise ValueError("q, k, v and length must share a device, and q, k, v a dtype")
    if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"length must be one int32/int64 on the device, got {length.dtype} {tuple(length.shape)}")
    if q.stride(1) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("the head dimension of q, k and v must be contiguous")
    if slots is not None and (slots.dim() not in (1, 2) or slots.device != q.device or slots.dtype not in
                              (torch.int32, torch.int64) or slots.stride(-1) != 1
                              or (slots.dim() == 2 and slots.shape[0] != k.shape[0])):
        raise ValueError("slots must be an int32/int64 tensor [C'] or [Hkv, C'] on q's device")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, length: Tensor, slots: Tensor | None = None,
                     scale: float | None = None, n_splits: int | None = None, window: int = 0,
                     ring: int = 0) -> Tensor:
    """Attention of one token's queries q [H, D] over a cache's k, v [Hkv, C, D] (views of the engine's cache
    are fine: only the head dimension must be contiguous) -> [H, D] in q's dtype.

    `length` (a one-element integer tensor on the device, read by the kernel, never by the host) is the number of
    keys: slots [0, length), or with `slots` [C'] (or [Hkv, C'], a list per KV head) the first `length` slots it
    lists; with `window` > 0 only the last `window` of those (a sliding-window layer), and with `ring` (at least
    `window`, no `slots`) slot s is at s % ring in k, v (a window layer's ring, engine.model.KVCache), so `length`
    may exceed C. Nothing here syncs with the
    device, so the call can be captured in a CUDA graph and replayed for any length up to C (or C'). Raises
    ValueError where `unsupported_reason` gives one (callers fall back to `decode_attention_ref`)."""
    _check(q, k, v, length, slots)
    if ring and (slots is not None or not 0 < window <= ring or ring != k.shape[1]):
        raise ValueError(f"a ring of {ring} slots takes a window of at most that, no slots, and k, v of {ring} slots")
    n_heads, head_dim = q.shape
    n_kv_heads, capacity, _ = k.shape
    reason = unsupported_reason(n_heads, n_kv_heads, head_dim, q.dtype, q.device)
    if reason:
        raise ValueError(f"decode attention kernel: unsupported {reason}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    n_rep = n_heads // n_kv_heads
    n_splits = n_splits or default_splits(n_kv_heads, capacity if slots is None else slots.shape[-1], q.device)
    block_n, warps, stages = _tiles(head_dim, q.dtype)
    if window:  # no more splits than the window has key blocks
        n_splits = min(n_splits, triton.cdiv(window, block_n))
    block_d = max(16, triton.next_power_of_2(head_dim))
    part = torch.empty(n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(n_heads, n_splits, dtype=torch.float32, device=q.device)
    _split_kernel[(n_kv_heads, n_splits)](
        q, k, v, length, length if slots is None else slots, part, lse,
        q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        slots.stride(0) if slots is not None and slots.dim() == 2 else 0, n_rep, scale * math.log2(math.e),
        int(window) or _NO_WINDOW, max(1, int(ring)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(n_rep)), BLOCK_N=block_n,
        N_SPLITS=n_splits, SUBSET=slots is not None, RING=bool(ring),
        # fp32: full-precision products, not TF32. The interpreter multiplies bfloat16 tiles wrongly in tl.dot
        # (kernels.round_scores), so there they are widened first.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRET and q.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages,
    )
    out = torch.empty(n_heads, head_dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(n_heads,)](part, lse, out, out.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d,
                              N_SPLITS=n_splits, BLOCK_P=triton.next_power_of_2(n_splits),
                              num_warps=1 if INTERPRET else 4)
    return out
