"""Per-slot attention mass for LoopServe's progressive decode: how much attention the reply's latest tokens pay to
each slot of the input, per layer and KV head.

Every `interval` tokens the progressive decode (engine/policies/progressive_decode.py) keeps, per layer and KV head, the
input slots that the last T decoded tokens attended to most. That needs, for every input slot, the softmax
probabilities over all keys (input and reply so far, causal) summed over the T tokens and the n_rep query heads
sharing the KV head. In torch that is a [G, Hkv, n_rep * T, S] float32 score tensor read and written half a dozen
times (134 MB per layer at 64k keys for the 8B shape); the kernel never materializes it, and does all layers of a
group in one launch. `slot_mass_ref` below is the plain-torch definition it is tested against.

Shapes: G layers, T query tokens (the reply's last T, at slots S - T .. S - 1), H query heads, Hkv KV heads
(H = Hkv * n_rep), S keys (slots [0, S)), D head size, N input slots (the mass is wanted for slots [0, N),
N <= S - T).

Layout (as kernels/round_scores.py, whose tile helpers, in kernels/_triton.py, it shares): query rows grouped by
KV head (row r is token r // n_rep, query head g * n_rep + r % n_rep), so one key tile serves all of them; the grid
is (row blocks, layer x KV head, key splits). Two passes: `_row_stats_kernel` gives each row's max and sum of exp
over its split (masked: a row sees key j only if j <= its own slot, and an input slot only if `visible` says so),
torch merges the splits into one log-sum-exp per row, and `_input_mass_kernel` recomputes the scores of the input
slots alone, normalizes them and adds each tile's column sums into the [G, Hkv, N] output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvchat.kernels._triton import (
    INTERPRET,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    merge_splits,
    next_power_of_2,
    split_length,
    triton,
    triton_kernel_runs_on,
)

if triton is not None:
    import triton.language as tl

    from kvchat.kernels._triton import load_query_rows, online_softmax_step, scores_log2


def slot_mass_ref(q: Tensor, k: Tensor, n_input: int, visible: Tensor | None = None,
                  scale: float | None = None) -> Tensor:
    """q [G, T, H, D] (token t at slot S - T + t), k [G, Hkv, S, D], visible [G, N] bool or None (every input
    slot) -> [G, Hkv, N] float32: per layer and KV head, the softmax probabilities (over the keys each token may
    see: itself and before, the hidden input slots left out) of input slots [0, N), summed over tokens and the
    KV head's query heads."""
    return slot_probabilities_ref(q, k, n_input, visible, scale).sum((2, 3))


def slot_probabilities_ref(q: Tensor, k: Tensor, n_input: int, visible: Tensor | None = None,
                           scale: float | None = None) -> Tensor:
    """`slot_mass_ref` before its sum: [G, Hkv, rep, T, N] float32, each query head of the KV head's group and each
    token apart (docs/probes/xkv_score_variants.py sums them other ways)."""
    n_layers, n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    rep = n_heads // n_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped = q.view(n_layers, n_tokens, n_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4)  # [G, Hkv, rep, T, D]
    # float32 products (a float32 cache's own dtype, no copy), as the kernel accumulates them: half-precision
    # scores would be rounded to ~1e-3 of their size before the softmax.
    scores = grouped.reshape(n_layers, n_kv_heads, rep * n_tokens, head_dim).float() @ k.float().transpose(2, 3)
    slots = torch.arange(n_keys, device=q.device)
    seen = slots[None, :] <= (n_keys - n_tokens + torch.arange(n_tokens, device=q.device))[:, None]  # [T, S]
    seen = seen.expand(n_layers, -1, -1)
    if visible is not None:
        seen = seen & torch.cat([visible, visible.new_ones(n_layers, n_keys - n_input)], 1)[:, None]
    scores = scores.view(n_layers, n_kv_heads, rep, n_tokens, n_keys).mul_(scale)
    scores = scores.masked_fill_(~seen[:, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1)[..., :n_input]


if triton is not None:

    @triton.jit
    def _program_tile(q_ptr, k_ptr, vis_ptr, n_kv_heads, n_rows, n_rep, stride_qg, stride_qt, stride_qh, stride_qd,
                      stride_kg, stride_kh, stride_vg, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr):
        """This program's (layer x KV head), its query rows (which exist, and their [BLOCK_M, BLOCK_D] tile), its
        KV head's keys and its layer's visibility row."""
        row_block, layer_head = tl.program_id(0), tl.program_id(1)
        layer, kv_head = layer_head // n_kv_heads, layer_head % n_kv_heads
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        q = load_query_rows(q_ptr + layer.to(tl.int64) * stride_qg, rows, row_ok, kv_head, n_rep,
                             stride_qt, stride_qh, stride_qd, HEAD_DIM, BLOCK_D)
        k_head_ptr = k_ptr + layer.to(tl.int64) * stride_kg + kv_head.to(tl.int64) * stride_kh
        return layer_head, rows, row_ok, q, k_head_ptr, vis_ptr + layer * stride_vg

    @triton.jit
    def _row_stats_kernel(q_ptr, k_ptr, vis_ptr, row_max_ptr, row_sum_ptr,
                          stride_qg, stride_qt, stride_qh, stride_qd, stride_kg, stride_kh, stride_ks, stride_kd,
                          stride_vg, n_kv_heads, n_rows, n_tokens, n_keys, n_input, keys_per_split, n_rep,
                          qk_scale_log2, HAS_VISIBLE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        """Pass 1: per row, the max (log2 domain) and sum of exp2(score - max) over the keys of this split the row
        sees; written to row_max / row_sum [G * Hkv, n_splits, n_rows]."""
        layer_head, rows, row_ok, q, k_head_ptr, vis_row_ptr = _program_tile(
            q_ptr, k_ptr, vis_ptr, n_kv_heads, n_rows, n_rep, stride_qg, stride_qt, stride_qh, stride_qd, stride_kg,
            stride_kh, stride_vg, HEAD_DIM, BLOCK_D, BLOCK_M)
        split = tl.program_id(2)
        row_slot = n_keys - n_tokens + rows // n_rep  # the last key each row sees
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, n_keys)
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        for block_start in range(split_start, split_end, BLOCK_N):
            keys = block_start + tl.arange(0, BLOCK_N)
            key_ok = keys < split_end
            if HAS_VISIBLE:
                shown = tl.load(vis_row_ptr + keys, mask=keys < n_input, other=1)
                key_ok = key_ok & (shown != 0)
            scores = scores_log2(q, k_head_ptr, keys, key_ok, stride_ks, stride_kd, qk_scale_log2,
                                  HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_IN_FP32)
            # A row may see none of a block's keys (hidden input slots, or reply slots after its own).
            scores = tl.where(keys[None, :] <= row_slot[:, None], scores, float("-inf"))
            row_max, row_sum = online_softmax_step(row_max, row_sum, scores)
        out = (layer_head * tl.num_programs(2) + split) * n_rows + rows
        tl.store(row_max_ptr + out, row_max, mask=row_ok)
        tl.store(row_sum_ptr + out, row_sum, mask=row_ok)

    @triton.jit
    def _input_mass_kernel(q_ptr, k_ptr, vis_ptr, row_lse_ptr, mass_ptr,
                           stride_qg, stride_qt, stride_qh, stride_qd, stride_kg, stride_kh, stride_ks, stride_kd,
                           stride_vg, n_kv_heads, n_rows, n_input, keys_per_split, n_rep, qk_scale_log2,
                           HAS_VISIBLE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        """Pass 2: the probabilities exp2(score - lse) of this program's rows over its split of the input slots
        (every row comes after every input slot, so only `visible` masks), summed over the rows into
        mass [G * Hkv, N]."""
        layer_head, rows, row_ok, q, k_head_ptr, vis_row_ptr = _program_tile(
            q_ptr, k_ptr, vis_ptr, n_kv_heads, n_rows, n_rep, stride_qg, stride_qt, stride_qh, stride_qd, stride_kg,
            stride_kh, stride_vg, HEAD_DIM, BLOCK_D, BLOCK_M)
        split = tl.program_id(2)
        # Padding rows get lse = +inf, so their probabilities are exp2(-inf) = 0.
        row_lse = tl.load(row_lse_ptr + layer_head * n_rows + rows, mask=row_ok, other=float("inf"))
        out_ptr = mass_ptr + layer_head.to(tl.int64) * n_input
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, n_input)
        for block_start in range(split_start, split_end, BLOCK_N):
            keys = block_start + tl.arange(0, BLOCK_N)
            key_ok = keys < split_end
            if HAS_VISIBLE:
                shown = tl.load(vis_row_ptr + keys, mask=key_ok, other=0)
                key_ok = key_ok & (shown != 0)
            scores = scores_log2(q, k_head_ptr, keys, key_ok, stride_ks, stride_kd, qk_scale_log2,
                                  HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_IN_FP32)
            probs = tl.sum(tl.exp2(scores - row_lse[:, None]), axis=0)
            tl.atomic_add(out_ptr + keys, probs, mask=keys < split_end, sem="relaxed")


def _check_inputs(q: Tensor, k: Tensor, n_input: int, visible: Tensor | None, scale: float | None) -> None:
    """One-sentence ValueErrors for every malformed input."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [G, T, H, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(k, Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [G, Hkv, S, D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q and k must share one float dtype and device, got {q.dtype}/{q.device} and "
                         f"{k.dtype}/{k.device}")
    n_layers, n_tokens, n_heads, head_dim = q.shape
    if k.shape[0] != n_layers or k.shape[3] != head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (head size at most {MAX_HEAD_DIM})")
    if n_layers == 0 or n_tokens == 0 or k.shape[1] == 0 or n_heads % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} needs layers, tokens, and query heads a multiple of k's KV heads")
    if not 0 <= n_input <= k.shape[2] - n_tokens:
        raise ValueError(f"the {n_input} input slots must come before the {n_tokens} tokens' own ({k.shape[2]} keys)")
    if visible is not None and (visible.dtype != torch.bool or tuple(visible.shape) != (n_layers, n_input)
                                or visible.device != q.device):
        raise ValueError(f"visible must be a bool [{n_layers}, {n_input}] tensor on {q.device}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")


def _slot_mass_triton(q: Tensor, k: Tensor, n_input: int, visible: Tensor | None, scale: float) -> Tensor:
    n_layers, n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    n_rep = n_heads // n_kv_heads
    n_rows = n_tokens * n_rep
    block_m = 32 if INTERPRET else min(128, max(16, next_power_of_2(n_rows)))
    block_n = 64  # <= _triton.KEY_SPLIT_QUANTUM: no split ends inside a key block but at the last key
    block_d = max(16, next_power_of_2(head_dim))  # tl.dot needs every side >= 16
    n_row_blocks = math.ceil(n_rows / block_m)
    heads = n_layers * n_kv_heads
    vis = visible.to(torch.uint8) if visible is not None else q.new_empty(1, 1, dtype=torch.uint8)
    # The query tile and the key tiles in flight must fit shared memory: fewer stages for wide fp32 heads.
    stages = 3 if q.element_size() * block_d * (block_m + 2 * block_n) <= 96 * 1024 else 2
    common = dict(
        stride_qg=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2), stride_qd=q.stride(3),
        stride_kg=k.stride(0), stride_kh=k.stride(1), stride_ks=k.stride(2), stride_kd=k.stride(3),
        stride_vg=vis.stride(0), n_kv_heads=n_kv_heads, n_rows=n_rows, n_rep=n_rep,
        qk_scale_log2=scale * math.log2(math.e), HAS_VISIBLE=visible is not None,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRET and q.dtype == torch.bfloat16,  # as round_scores: the interpreter's bf16 dot
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=stages,
    )
    split = split_length(n_row_blocks * heads, n_keys, q.device)
    n_splits = math.ceil(n_keys / split)
    row_max = torch.empty(heads, n_splits, n_rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    _row_stats_kernel[(n_row_blocks, heads, n_splits)](
        q, k, vis, row_max, row_sum, n_tokens=n_tokens, n_keys=n_keys, n_input=n_input, keys_per_split=split,
        **common)
    row_lse = merge_splits(row_max, row_sum)  # [G * Hkv, n_rows]; every row sees its own key: finite
    mass = torch.zeros(n_layers, n_kv_heads, n_input, dtype=torch.float32, device=q.device)
    if n_input:
        split = split_length(n_row_blocks * heads, n_input, q.device)
        _input_mass_kernel[(n_row_blocks, heads, math.ceil(n_input / split))](
            q, k, vis, row_lse, mass, n_input=n_input, keys_per_split=split, **common)
    return mass


def slot_mass(q: Tensor, k: Tensor, n_input: int, visible: Tensor | None = None,
              scale: float | None = None) -> Tensor:
    """`slot_mass_ref`'s meaning (q [G, T, H, D], k [G, Hkv, S, D], any strides; -> [G, Hkv, N] float32), through
    the Triton kernel where `triton_kernel_runs_on(q.device)`, else the reference. float32, float16 and bfloat16,
    accumulated in float32; head sizes up to 256."""
    _check_inputs(q, k, n_input, visible, scale)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    if not triton_kernel_runs_on(q.device):
        return slot_mass_ref(q, k, n_input, visible, scale)
    return _slot_mass_triton(q, k, n_input, visible, scale)


def benchmark(n_layers: int = 32, n_tokens: int = 16, n_keys: int = 32768, n_heads: int = 32, n_kv_heads: int = 8,
              head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict:
    """Milliseconds of `slot_mass` and of `slot_mass_ref` (one layer at a time, as its memory allows) on random
    inputs shaped like a decode's choice."""
    from triton.testing import do_bench

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n_layers, n_tokens, n_heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(n_layers, n_kv_heads, n_keys, head_dim, device=device, dtype=dtype, generator=gen)
    n_input = n_keys - 2 * n_tokens
    return dict(n_layers=n_layers, n_tokens=n_tokens, n_keys=n_keys, n_heads=n_heads, n_kv_heads=n_kv_heads,
                head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                kernel_ms=do_bench(lambda: slot_mass(q, k, n_input)),
                reference_ms=do_bench(lambda: [slot_mass_ref(q[i : i + 1], k[i : i + 1], n_input)
                                               for i in range(n_layers)]))
