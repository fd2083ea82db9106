"""LouisKV's slot choice in one kernel: per layer and KV head, the `n` listed slots whose unit scores best (pooled
over `pool` neighbouring slots), in ascending order (engine.kv.units.slots_of_best_units; issue 44).

In torch the choice is ~8 passes over the same per-slot scores (256 rows of ~32,500 slots at 32k on the 8B shape):
gather each slot's unit score, max-pool, build int64 keys, a top-n, gather the slots, sort. The kernel gives each
row one program, which needs no top-n at all: only the n-th best key (a radix select), then every slot above it
and the lowest-positioned ones equal to it, written in order.

A slot's key is the bit pattern of its pooled score as an int32 (a non-negative float's bits order as it does;
negative scores count as 0, and -0.0 as 0.0): the n-th largest key T is found a digit of RADIX_BITS bits at a time,
most significant first, from a histogram of the digits of the keys that share the digits found so far. Then the
slots with key > T are all chosen, and of those with key == T the first ones by position, as many as the budget
has left: exactly the order `slots_of_best_units_ref` ranks by (the score, then the lower position).

Passes over a row (one program's): 1. each slot's pooled score (its own and its neighbours' units' scores, from
`member` and the row's `scores`, which stay in L1), written as keys to an int32 scratch row, with the histogram of
their first digit; 2-4. the histograms of the next digits, from the scratch (L2-resident: 130 KB a row); 5. the
chosen slots written at a running count. Everything has a fixed shape and no host sync: the launch is capturable in
a CUDA graph (engine.policies.unit_retrieval chooses inside one).

`slots_of_best_units_ref` below is the plain-torch definition it is tested against.

Shapes: G layers, Hkv KV heads (G * Hkv rows), U units, N listed slots, n chosen per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, triton, triton_kernel_runs_on

if triton is not None:
    import triton.language as tl

# Digits of the radix select: 4 passes of 8-bit histograms over keys of 31 bits (the sign bit is 0). Wider digits
# would save a pass but cost more per key: triton's histogram spends ~log2(bins) ballots and bins / 32 popcounts
# per 32 keys.
RADIX_BITS = 8
KEY_BITS = 32  # a multiple of RADIX_BITS, >= 31: the keys as RADIX_BITS-bit digits, the top ones 0


def slots_of_best_units_ref(scores: Tensor, member: Tensor, slots: Tensor, n: int, pool: int = 1) -> Tensor:
    """The `n` listed slots (of `slots` [N], ascending) of the best-scoring units per layer and KV head ([G, Hkv, U]
    scores, each slot's unit [G, Hkv, N]) -> [G, Hkv, min(n, N)] int32, ascending: slots ranked by their unit's
    score, ties to the lower slot (whole units first, the last one cut at the budget). With `pool` > 1 (odd) a slot
    is ranked by the best unit within pool // 2 listed slots of it (the neighbours of a chosen slot come with it)."""
    n = min(n, slots.numel())
    per_slot = scores.gather(2, member.long())  # [G, Hkv, N]
    g, h, total = per_slot.shape
    if pool > 1:
        per_slot = torch.nn.functional.max_pool1d(per_slot.reshape(g * h, 1, total), pool, stride=1,
                                                  padding=pool // 2).view(g, h, total)
    # The order of a stable sort (the score, then the position: a unit's slots come in order, lowest first), as one
    # top-n over int64 keys: a non-negative float's bits order as it does, and the low half breaks ties to the lower
    # position. At 32k on the 8B shape (256 rows of ~32,500 slots) on an H100: 0.54 ms for the keys and their
    # top-n, where the stable sort took 0.73 ms; a top-n of the scores alone, then the ties at the n-th resolved by
    # positions in fixed shapes, took longer (0.89 ms in all against 0.80; docs/benchmarks.md, "LouisKV").
    bits = (per_slot.float().clamp_min(0) + 0.0).view(torch.int32).long()  # + 0.0: no -0.0
    position = torch.arange(total - 1, -1, -1, device=per_slot.device)  # the lower slot, the larger key
    order = torch.topk((bits << 32) | position, n, dim=2, sorted=False).indices
    return slots[order].sort(dim=2).values.to(torch.int32)


if triton is not None:

    @triton.jit
    def _narrowed(histogram, prefix, rank, RADIX_BITS: tl.constexpr, BINS: tl.constexpr):
        """One digit of the n-th largest key: of the keys sharing `prefix` (their digit counts in `histogram`
        [BINS = 2 ** RADIX_BITS]), the digit of the `rank`-th largest (1-based). Returns the prefix with that digit,
        the rank the n-th key has among the keys sharing it (the keys of larger digits taken out), and how many
        keys share it."""
        digits = tl.arange(0, BINS)
        at_or_above = tl.sum(histogram, 0) - tl.cumsum(histogram, 0) + histogram  # [BINS]: keys of digit >= each
        digit = tl.max(tl.where(at_or_above >= rank, digits, -1), 0)  # >= 0: all keys counted have digit >= 0
        above = tl.sum(tl.where(digits > digit, histogram, 0), 0)
        sharing = tl.sum(tl.where(digits == digit, histogram, 0), 0)
        return (prefix << RADIX_BITS) | digit, rank - above, sharing

    @triton.jit
    def _unit_choice_kernel(scores_ptr, member_ptr, slots_ptr, keys_ptr, out_ptr, n_kv_heads, n_listed, n_chosen,
                            stride_sg, stride_sh, stride_mg, stride_mh, stride_mn, POOL: tl.constexpr,
                            RADIX_BITS: tl.constexpr, BINS: tl.constexpr, KEY_BITS: tl.constexpr,
                            BLOCK: tl.constexpr):
        """Row program_id(0) (layer x KV head): its n_chosen best listed slots, ascending, into out [rows,
        n_chosen] int32; keys [rows, n_listed] int32 is its scratch."""
        row = tl.program_id(0)
        layer, kv_head = row // n_kv_heads, row % n_kv_heads
        score_row = scores_ptr + layer.to(tl.int64) * stride_sg + kv_head.to(tl.int64) * stride_sh
        member_row = member_ptr + layer.to(tl.int64) * stride_mg + kv_head.to(tl.int64) * stride_mh
        key_row = keys_ptr + row.to(tl.int64) * n_listed
        digits = tl.arange(0, BINS)
        # Every histogram counts all of a pass's n_walked slots: those it should not (beyond the row, or not sharing
        # the prefix found so far) as digit 0, taken out after the pass (histogram's own mask needs triton >= 3.4).
        n_walked = tl.cdiv(n_listed, BLOCK) * BLOCK

        # Pass 1: the keys, and the histogram of their first digit.
        histogram = tl.zeros([BINS], tl.int32)
        for start in range(0, n_listed, BLOCK):
            positions = start + tl.arange(0, BLOCK)
            in_row = positions < n_listed
            pooled = tl.full([BLOCK], float("-inf"), tl.float32)
            # max_pool1d's window: pool // 2 listed slots either side, none beyond the row's ends (its -inf padding)
            for offset in tl.static_range(POOL):
                neighbour = positions + (offset - POOL // 2)
                inside = (neighbour >= 0) & (neighbour < n_listed)
                unit = tl.load(member_row + neighbour * stride_mn, mask=inside, other=0)
                pooled = tl.maximum(pooled, tl.load(score_row + unit, mask=inside, other=float("-inf")))
            # the reference's clamp_min(0) + 0.0: a negative score or -0.0 is 0.0, whose bits are 0
            keys = tl.where(pooled > 0, pooled.to(tl.int32, bitcast=True), 0)
            tl.store(key_row + positions, keys, mask=in_row)
            histogram += tl.histogram(tl.where(in_row, keys >> (KEY_BITS - RADIX_BITS), 0), BINS)
        histogram -= tl.where(digits == 0, n_walked - n_listed, 0)
        prefix, rank, n_sharing = _narrowed(histogram, tl.zeros([], tl.int32), n_chosen, RADIX_BITS, BINS)
        tl.debug_barrier()  # the scratch row written above is read below by other threads of this program

        # Passes 2..: each next digit, among the keys that share the digits found so far.
        for level in tl.static_range(1, KEY_BITS // RADIX_BITS):
            shift = KEY_BITS - (level + 1) * RADIX_BITS  # a constexpr, as static_range's `level` is
            histogram = tl.zeros([BINS], tl.int32)
            for start in range(0, n_listed, BLOCK):
                positions = start + tl.arange(0, BLOCK)
                in_row = positions < n_listed
                keys = tl.load(key_row + positions, mask=in_row, other=0)
                sharing = in_row & ((keys >> (shift + RADIX_BITS)) == prefix)
                histogram += tl.histogram(tl.where(sharing, (keys >> shift) & (BINS - 1), 0), BINS)
            histogram -= tl.where(digits == 0, n_walked - n_sharing, 0)
            prefix, rank, n_sharing = _narrowed(histogram, prefix, rank, RADIX_BITS, BINS)
        threshold = prefix  # the n-th largest key; `rank` of the keys equal to it are chosen, the lowest positions

        # Last pass: every key above the threshold and the first `rank` equal to it, at a running count.
        chosen_before = tl.zeros([], tl.int32)
        equal_before = tl.zeros([], tl.int32)
        out_row = out_ptr + row.to(tl.int64) * n_chosen
        for start in range(0, n_listed, BLOCK):
            positions = start + tl.arange(0, BLOCK)
            in_row = positions < n_listed
            keys = tl.load(key_row + positions, mask=in_row, other=-1)  # -1: below every key, 0 included
            equal = (keys == threshold).to(tl.int32)
            equal_order = equal_before + tl.cumsum(equal, 0) - equal  # [BLOCK]: equal keys before each
            chosen = ((keys > threshold) | ((equal != 0) & (equal_order < rank))).to(tl.int32)
            at = chosen_before + tl.cumsum(chosen, 0) - chosen  # [BLOCK]: each chosen slot's place in the list
            slot = tl.load(slots_ptr + positions, mask=chosen != 0, other=0)
            tl.store(out_row + at, slot.to(tl.int32), mask=chosen != 0)
            chosen_before += tl.sum(chosen, 0)
            equal_before += tl.sum(equal, 0)


def _check(scores: Tensor, member: Tensor, slots: Tensor, n: int, pool: int) -> None:
    """One-sentence ValueErrors for malformed inputs (shapes and dtypes only: nothing that reads the GPU)."""
    if scores.dim() != 3 or not scores.is_floating_point():
        raise ValueError(f"scores must be a float [G, Hkv, U] tensor, got {tuple(scores.shape)} {scores.dtype}")
    if member.dim() != 3 or member.shape[:2] != scores.shape[:2] or member.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"member must be an int [G, Hkv, N] tensor beside scores {tuple(scores.shape)}, got "
                         f"{tuple(member.shape)} {member.dtype}")
    if slots.dim() != 1 or slots.numel() != member.shape[2] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be an int [N] tensor of member's N = {member.shape[2]}, got "
                         f"{tuple(slots.shape)} {slots.dtype}")
    if scores.device != member.device or slots.device != member.device:
        raise ValueError(f"scores, member and slots must share one device, got {scores.device}, {member.device} "
                         f"and {slots.device}")
    if n < 0 or pool < 1 or pool % 2 == 0:
        raise ValueError(f"n must be >= 0 and pool odd and >= 1, got n={n}, pool={pool}")


def _slots_of_best_units_triton(scores: Tensor, member: Tensor, slots: Tensor, n: int, pool: int) -> Tensor:
    g, h, n_listed = member.shape
    out = torch.empty(g, h, n, dtype=torch.int32, device=member.device)
    if n == 0 or g * h == 0:
        return out
    scores = scores.float()
    if scores.stride(2) != 1:
        scores = scores.contiguous()
    keys = torch.empty(g * h, n_listed, dtype=torch.int32, device=member.device)  # the rows' scratch
    _unit_choice_kernel[(g * h,)](
        scores, member, slots.contiguous(), keys, out, h, n_listed, n, scores.stride(0), scores.stride(1),
        member.stride(0), member.stride(1), member.stride(2), POOL=pool, RADIX_BITS=RADIX_BITS,
        BINS=1 << RADIX_BITS, KEY_BITS=KEY_BITS, BLOCK=256 if INTERPRET else 2048, num_warps=8)
    return out


def slots_of_best_units(scores: Tensor, member: Tensor, slots: Tensor, n: int, pool: int = 1) -> Tensor:
    """`slots_of_best_units_ref`'s lists, exactly (scores [G, Hkv, U] float, member [G, Hkv, N] int, slots [N] int
    ascending -> [G, Hkv, min(n, N)] int32), through the Triton kernel where `triton_kernel_runs_on(member.device)`,
    else the reference. Scores are not NaN."""
    _check(scores, member, slots, n, pool)
    n = min(n, slots.numel())
    if not triton_kernel_runs_on(member.device):
        return slots_of_best_units_ref(scores, member, slots, n, pool)
    return _slots_of_best_units_triton(scores, member, slots, n, pool)


def benchmark(n_rows: tuple[int, int] = (32, 8), n_listed: int = 32500, n_units: int = 2070, n: int = 1024,
              pool: int = 7, device: str = "cuda") -> dict:
    """Milliseconds of `slots_of_best_units` and of `slots_of_best_units_ref` on random softmax scores shaped like
    one choice at 32k on the 8B shape."""
    from triton.testing import do_bench

    gen = torch.Generator(device=device).manual_seed(0)
    g, h = n_rows
    scores = torch.softmax(torch.randn(g, h, n_units, device=device, generator=gen), -1)
    member = torch.randint(0, n_units, (g, h, n_listed), device=device, generator=gen)
    slots = torch.arange(n_listed, device=device) + 4
    return dict(rows=g * h, n_listed=n_listed, n_units=n_units, n=n, pool=pool,
                kernel_ms=do_bench(lambda: slots_of_best_units(scores, member, slots, n, pool)),
                reference_ms=do_bench(lambda: slots_of_best_units_ref(scores, member, slots, n, pool)))
