"""Vertical-slash sparse prefill attention (LoopServe §5.1; the index layout of MInference's kernel).

A prefill of T new tokens (cache slots [start, start + T)) over N = start + T keys computes, per query head, only
the attention entries on the head's chosen lines: vertical lines (key slots every later query reads, a separator, a
fact) and slash lines (a fixed distance between query and key: the local band, a repeated span). Which lines, is
chosen online per head by engine.policies.sparse_prefill from a few sampled query rows.

How the lines become work, per head h and query block m (BLOCK query rows):

* A slash at distance d crosses query block m in key blocks m + floor((start - d) / BLOCK) and the one after: the
  same two *block diagonals* (key block - query block) for every m. Slashes are therefore kept as block diagonals
  (`slash_diagonals`; engine.policies.sparse_prefill chooses diagonals directly, since a diagonal is the unit of work),
  and every key block on a chosen one is computed whole (a superset of the slashes: never less accurate). The
  diagonals holding each row's own slot are always there, so every row sees at least itself.
* Vertical lines are gathered key slots, BLOCK at a time, skipping those a computed block already covers (the
  block mask says which) and those after a row (causality).

`SparseIndex` holds both for a whole prefill; `sparse_prefill_attention` is the Triton kernel (grid: query blocks x
query heads, an online softmax over the blocks, then the gathered columns); `sparse_prefill_ref` is the plain-torch
definition of the same attention (the same block-expanded mask) that the kernel is tested against.

Shapes: T new tokens, H query heads, Hkv KV heads (H = Hkv * n_rep), D head size, N keys, M = ceil(T / BLOCK)
query blocks, KB = ceil(N / BLOCK) key blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton
from kvchat.kernels.decode_attention import kernel_shape_reason as unsupported_reason

if triton is not None:
    import triton.language as tl


def block_size(head_dim: int) -> int:
    """Query rows and keys per tile: 64 (32 for head size 256, whose tiles would not fit in shared memory); 16 in
    the interpreter, so the tests cross many blocks at small sizes."""
    if INTERPRET:
        return 16
    return 64 if head_dim <= 128 else 32


@dataclass(frozen=True)
class SparseIndex:
    start: int  # the slot of the first new token
    n_queries: int  # T
    block: int
    block_idx: Tensor  # [H, M, max_blocks] int32: key blocks computed whole, ascending (padded)
    block_count: Tensor  # [H, M] int32
    block_mask: Tensor  # [H, M, KB] int8: 1 where block_idx lists the block (the column pass skips those keys)
    cols: Tensor  # [H, max_cols] int32: vertical key slots, ascending, padded with N
    col_count: Tensor  # [H, M] int32: how many of cols a query block may see (those up to its last row)

    @property
    def n_keys(self) -> int:
        return self.start + self.n_queries

    def head_density(self) -> Tensor:
        """[H] float: each head's computed key entries (blocks whole, columns each) over the causal entries a dense
        prefill computes (whole blocks can make it a little over 1)."""
        t, b = self.n_queries, self.block
        computed = self.block_count.double().sum(1) * b * b + self.col_count.double().sum(1) * b
        return computed / max(t * self.start + t * (t + 1) / 2, 1.0)

    def density(self) -> float:
        """The heads' mean share of the dense work, at most 1."""
        return min(1.0, self.head_density().mean().item())


def n_diagonals(n_queries: int, n_keys: int, block: int) -> int:
    """Block diagonals delta = key block - query block run from -(M - 1) to KB - 1: M + KB - 1 of them (index
    delta + M - 1)."""
    return -(-n_queries // block) + -(-n_keys // block) - 1


def slash_diagonals(slashes: Tensor, start: int, n_queries: int, block: int) -> Tensor:
    """slashes [H, N] bool (distances d = query slot - key slot) -> the block diagonals [H, M + KB - 1] they cross:
    a slash at distance d meets query block m in key blocks (start + m * block - d) // block and the one holding
    its last row, the same two diagonals for every m."""
    n_heads, n_keys = slashes.shape
    n_qblocks = -(-n_queries // block)
    d = torch.arange(n_keys, device=slashes.device)
    lo = torch.div(start - d, block, rounding_mode="floor") + n_qblocks - 1
    hi = torch.div(start + block - 1 - d, block, rounding_mode="floor") + n_qblocks - 1
    out = torch.zeros(n_heads, n_diagonals(n_queries, n_keys, block), dtype=torch.bool, device=slashes.device)
    heads, dist = slashes.nonzero(as_tuple=True)
    ok_lo, ok_hi = (lo[dist] >= 0) & (lo[dist] < out.shape[1]), (hi[dist] >= 0) & (hi[dist] < out.shape[1])
    out[heads[ok_lo], lo[dist][ok_lo]] = True
    out[heads[ok_hi], hi[dist][ok_hi]] = True
    return out


def build_index(verticals: Tensor, diagonals: Tensor, start: int, n_queries: int, block: int,
                dense: Tensor | None = None) -> SparseIndex:
    """verticals [H, N] bool (key slots chosen as vertical lines), diagonals [H, M + KB - 1] bool (block
    diagonals computed whole: slashes, `slash_diagonals`), dense [H] bool (heads computed densely) -> the
    kernel's index. The diagonal blocks holding each row's own slot are always added."""
    n_heads, n_keys = verticals.shape
    if n_keys != start + n_queries or diagonals.shape != (n_heads, n_diagonals(n_queries, n_keys, block)):
        raise ValueError(f"lines must be [H, {start + n_queries}] and [H, "
                         f"{n_diagonals(n_queries, start + n_queries, block)}] for {n_queries} queries after slot "
                         f"{start} in blocks of {block}")
    device = verticals.device
    n_qblocks, n_kblocks = -(-n_queries // block), -(-n_keys // block)
    diagonals = diagonals.clone()
    for own in {start // block, (start + block - 1) // block}:  # every row sees itself (a short chunk: one)
        if own < n_kblocks:
            diagonals[:, own + n_qblocks - 1] = True
    m = torch.arange(n_qblocks, device=device)
    kb = torch.arange(n_kblocks, device=device)
    last_row_block = torch.div(start + torch.clamp((m + 1) * block, max=n_queries) - 1, block, rounding_mode="floor")
    causal = kb[None, :] <= last_row_block[:, None]  # [M, KB]
    mask = diagonals[:, kb[None, :] - m[:, None] + n_qblocks - 1] & causal[None]  # [H, M, KB]
    if dense is not None:
        mask |= dense[:, None, None] & causal[None]
    count = mask.sum(-1)
    max_blocks = max(int(count.max()), 1)
    order = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :max_blocks]
    # Columns: the chosen slots ascending; a query block sees those up to its last row.
    if dense is not None:
        verticals = verticals & ~dense[:, None]
    max_cols = max(int(verticals.sum(-1).max()), 1)
    slots = torch.where(verticals, torch.arange(n_keys, device=device)[None, :], n_keys)
    cols = torch.sort(slots, dim=-1).values[:, :max_cols].contiguous()
    last_row = start + torch.clamp((m + 1) * block, max=n_queries) - 1
    col_count = torch.searchsorted(cols, last_row[None, :].expand(n_heads, -1).contiguous(), right=True)
    return SparseIndex(start, n_queries, block, order.to(torch.int32).contiguous(), count.to(torch.int32),
                       mask.to(torch.int8).contiguous(), cols.to(torch.int32), col_count.to(torch.int32))


def dense_index(n_heads: int, start: int, n_queries: int, block: int, device: torch.device) -> SparseIndex:
    """Every causal block: the kernel then computes dense attention (tests, and heads that fall back)."""
    n_keys = start + n_queries
    none = torch.zeros(n_heads, n_keys, dtype=torch.bool, device=device)
    diagonals = torch.zeros(n_heads, n_diagonals(n_queries, n_keys, block), dtype=torch.bool, device=device)
    return build_index(none, diagonals, start, n_queries, block,
                       dense=torch.ones(n_heads, dtype=torch.bool, device=device))


def visible_mask(index: SparseIndex) -> Tensor:
    """[H, T, N] bool: which keys each new token attends to under the index (the blocks whole, the listed columns,
    never a later slot)."""
    b, t, n = index.block, index.n_queries, index.n_keys
    device = index.block_mask.device
    rows = torch.arange(t, device=device)
    keys = torch.arange(n, device=device)
    qblock = rows // b
    mask = index.block_mask.bool()[:, qblock][:, :, keys // b]  # [H, T, N]
    n_heads = mask.shape[0]
    chosen = torch.zeros(n_heads, qblock.max().item() + 1, n + 1, dtype=torch.bool, device=device)
    heads = torch.arange(n_heads, device=device)
    for m in range(chosen.shape[1]):
        ok = torch.arange(index.cols.shape[1], device=device)[None, :] < index.col_count[:, m : m + 1]
        chosen[heads[:, None].expand_as(ok)[ok], m, index.cols.long()[ok]] = True
    mask |= chosen[:, qblock, :n]
    return mask & (keys[None, :] <= index.start + rows[:, None])[None]


def sparse_prefill_ref(q: Tensor, k: Tensor, v: Tensor, index: SparseIndex, scale: float | None = None) -> Tensor:
    """q [T, H, D], k / v [Hkv, N, D] -> [T, H, D] in q's dtype, computed in float32 over visible_mask(index)."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    n_rep = n_heads // k.shape[0]
    keys = k.float().repeat_interleave(n_rep, dim=0)  # [H, N, D]
    values = v.float().repeat_interleave(n_rep, dim=0)
    scores = torch.einsum("thd,hnd->htn", q.float(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~visible_mask(index), float("-inf")), dim=-1)
    return torch.einsum("htn,hnd->thd", probs, values).to(q.dtype)


if triton is not None:

    @triton.jit
    def _attend_slots(q, k_head, v_head, slots, slot_ok, row_slot, dims, dim_ok, stride_kn, stride_vn,
                      row_max, row_sum, acc, qk_scale_log2, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        # One online-softmax step of the query tile over the keys at `slots` (those with `slot_ok`), causally.
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_head + slots[:, None].to(tl.int64) * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + slots[:, None].to(tl.int64) * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        ok = slot_ok[None, :] & (slots[None, :] <= row_slot[:, None])
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(ok, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf: subtract 0 there, so it gets exp2(-inf) = 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp2(row_max - safe_max)
        p = tl.exp2(scores - safe_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return new_max, row_sum, acc

    @triton.jit
    def _sparse_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_idx_ptr, block_count_ptr, block_mask_ptr,
                               cols_ptr, col_count_ptr,
                               stride_qt, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_ot, stride_oh,
                               start, n_queries, n_keys, n_rep, n_qblocks, n_kblocks, max_blocks, max_cols,
                               qk_scale_log2,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                               DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        qb = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // n_rep
        rows = qb * BLOCK + tl.arange(0, BLOCK)
        row_ok = rows < n_queries
        row_slot = start + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        at = head * n_qblocks + qb
        row_max = tl.full([BLOCK], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)

        n_blocks = tl.load(block_count_ptr + at)
        for j in range(0, n_blocks):
            kb = tl.load(block_idx_ptr + at.to(tl.int64) * max_blocks + j)
            keys = kb * BLOCK + tl.arange(0, BLOCK)
            row_max, row_sum, acc = _attend_slots(q, k_head, v_head, keys, keys < n_keys, row_slot, dims, dim_ok,
                                                  stride_kn, stride_vn, row_max, row_sum, acc, qk_scale_log2,
                                                  DOT_PRECISION, DOT_IN_FP32)

        n_cols = tl.load(col_count_ptr + at)
        for c0 in range(0, n_cols, BLOCK):
            idx = c0 + tl.arange(0, BLOCK)
            col_ok = idx < n_cols
            slot = tl.load(cols_ptr + head.to(tl.int64) * max_cols + idx, mask=col_ok, other=0)
            covered = tl.load(block_mask_ptr + at.to(tl.int64) * n_kblocks + slot // BLOCK, mask=col_ok, other=1)
            row_max, row_sum, acc = _attend_slots(q, k_head, v_head, slot, col_ok & (covered == 0), row_slot, dims,
                                                  dim_ok, stride_kn, stride_vn, row_max, row_sum, acc,
                                                  qk_scale_log2, DOT_PRECISION, DOT_IN_FP32)

        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def sparse_prefill_attention(q: Tensor, k: Tensor, v: Tensor, index: SparseIndex,
                             scale: float | None = None) -> Tensor:
    """Attention of new tokens q [T, H, D] over k, v [Hkv, >= N, D] (cache views: only the head dimension must be
    contiguous) under `index` -> [T, H, D] in q's dtype. Raises ValueError where `unsupported_reason` gives one."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"sparse prefill takes q [T, H, D] and k, v [Hkv, N, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    n_new, n_heads, head_dim = q.shape
    if n_new != index.n_queries or k.shape[1] < index.n_keys:
        raise ValueError(f"the index is for {index.n_queries} queries over {index.n_keys} keys; got {n_new} over "
                         f"{k.shape[1]}")
    if index.block != block_size(head_dim):
        raise ValueError(f"the index's blocks are {index.block} keys; head size {head_dim} needs "
                         f"{block_size(head_dim)}")
    reason = unsupported_reason(n_heads, k.shape[0], head_dim, q.dtype, q.device)
    if reason:
        raise ValueError(f"sparse prefill kernel: unsupported {reason}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("the head dimension of q, k and v must be contiguous")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.empty_like(q)
    n_qblocks, n_kblocks = index.block_count.shape[1], index.block_mask.shape[2]
    _sparse_prefill_kernel[(n_qblocks, n_heads)](
        q, k, v, out, index.block_idx, index.block_count, index.block_mask, index.cols, index.col_count,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        index.start, n_new, index.n_keys, n_heads // k.shape[0], n_qblocks, n_kblocks, index.block_idx.shape[2],
        index.cols.shape[1], scale * math.log2(math.e),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK=index.block,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRET and q.dtype == torch.bfloat16,
        num_warps=1 if INTERPRET else 4, num_stages=1 if INTERPRET else 2,
    )
    return out
