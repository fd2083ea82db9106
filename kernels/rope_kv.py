"""RoPE on a decode token's fused q/k/v projection, with its K and V written straight into the KV cache: one kernel
instead of the ~10 that the float32 rotation (casts, the partner gather, multiplies, adds) and two index copies
launch per layer. The rotation is engine.model.RotaryTable's: each rotated element becomes x * C + partner(x) * S
in float32 with per-position tables C and S, so both pair layouts (ggml's normal: (2i, 2i+1); NeoX:
(i, i + rope_dim/2)) and partial rotary dimensions come from the same tables.

`rope_kv_ref` is the plain-torch definition the kernel is tested against.

Shapes: H / Hkv query / KV heads, D head size, C cache capacity, P positions in the tables.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton

if triton is not None:
    import triton.language as tl


def partner_index(head_dim: int, rope_dim: int, neox: bool, device=None) -> Tensor:
    """For each element of a head, the other member of its rotated pair (itself past rope_dim): [D] long."""
    d = torch.arange(head_dim, device=device)
    paired = (d + rope_dim // 2) % rope_dim if neox else d ^ 1
    return torch.where(d < rope_dim, paired, d)


def rope_kv_ref(qkv: Tensor, c_table: Tensor, s_table: Tensor, position: Tensor, kv: Tensor, slot: Tensor,
                n_heads: int, rope_dim: int, neox: bool) -> Tensor:
    """qkv [1, (H + 2 Hkv) D] -> rotated q [H, D]; rotated k and v written to kv [2, Hkv, C, D] at `slot`."""
    n_kv_heads, head_dim = kv.shape[1], kv.shape[3]
    x = qkv.view(-1, head_dim)  # [H + 2 Hkv, D]
    rotated = x[: n_heads + n_kv_heads].float()
    partner = rotated[:, partner_index(head_dim, rope_dim, neox, x.device)]
    p = position.long()
    rotated = (rotated * c_table[p] + partner * s_table[p]).to(x.dtype)
    kv[0].index_copy_(1, slot.long(), rotated[n_heads:, None])
    kv[1].index_copy_(1, slot.long(), x[n_heads + n_kv_heads :, None])
    return rotated[:n_heads]


if triton is not None:

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, c_ptr, s_ptr, position_ptr, slot_ptr, q_ptr, kv_ptr,
                        stride_kv, stride_head, stride_slot, n_heads, n_kv_heads,
                        HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
        head = tl.program_id(0)  # one of q's H, k's Hkv, v's Hkv heads, in qkv's order
        dims = tl.arange(0, BLOCK_D)
        ok = dims < HEAD_DIM
        x = tl.load(qkv_ptr + head * HEAD_DIM + dims, mask=ok, other=0.0)
        if head < n_heads + n_kv_heads:
            if NEOX:
                partner = (dims + ROPE_DIM // 2) % ROPE_DIM
            else:
                partner = dims ^ 1
            partner = tl.where(dims < ROPE_DIM, partner, dims)
            xp = tl.load(qkv_ptr + head * HEAD_DIM + partner, mask=ok, other=0.0)
            position = tl.load(position_ptr).to(tl.int64)
            c = tl.load(c_ptr + position * HEAD_DIM + dims, mask=ok, other=0.0)
            s = tl.load(s_ptr + position * HEAD_DIM + dims, mask=ok, other=0.0)
            y = (x.to(tl.float32) * c + xp.to(tl.float32) * s).to(x.dtype)
        else:
            y = x
        if head < n_heads:
            tl.store(q_ptr + head * HEAD_DIM + dims, y, mask=ok)
        else:
            slot = tl.load(slot_ptr).to(tl.int64)
            is_v = head >= n_heads + n_kv_heads
            kv_head = head - n_heads - is_v.to(tl.int32) * n_kv_heads
            at = kv_ptr + is_v.to(tl.int64) * stride_kv + kv_head.to(tl.int64) * stride_head + slot * stride_slot
            tl.store(at + dims, y, mask=ok)


def rope_kv(qkv: Tensor, c_table: Tensor, s_table: Tensor, position: Tensor, kv: Tensor, slot: Tensor,
            n_heads: int, rope_dim: int, neox: bool) -> Tensor:
    """`rope_kv_ref` in one kernel (positions and slot are read on the device: graph-safe)."""
    n_kv_heads, head_dim = kv.shape[1], kv.shape[3]
    if qkv.numel() != (n_heads + 2 * n_kv_heads) * head_dim or not qkv.is_contiguous() or kv.stride(3) != 1:
        raise ValueError(f"rope_kv takes one token's contiguous qkv [1, (H + 2 Hkv) D] and a cache with contiguous "
                         f"heads; got {tuple(qkv.shape)} for H={n_heads}, Hkv={n_kv_heads}, D={head_dim}")
    if c_table.dtype != torch.float32 or c_table.shape[1] != head_dim or not c_table.is_contiguous():
        raise ValueError("the rotary tables must be contiguous float32 [P, D]")
    q = torch.empty(n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(n_heads + 2 * n_kv_heads,)](
        qkv, c_table, s_table, position, slot, q, kv, kv.stride(0), kv.stride(1), kv.stride(2), n_heads, n_kv_heads,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, NEOX=neox, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if INTERPRET else 2)
    return q
