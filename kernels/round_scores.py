"""Per-round attention mass: how much of the new message's attention each earlier dialogue round receives.

Round Attention picks the rounds that matter to a new message from the attention its tokens pay, at the watershed
layer, to each earlier round: softmax over all keys, then the probabilities summed over query heads and query rows
within each round's span of keys. Only the per-round sums are needed, so the kernel never materializes the [T, S]
attention matrix; `round_mass_ref` below is the plain-torch definition it is tested against.

Shapes: T query tokens, H query heads, Hkv KV heads (H = Hkv * n_rep, grouped-query attention), S keys, D head
size, R rounds.

Layout of the Triton path (`round_mass`):

* Query rows are grouped by KV head: the n_rep query heads that share KV head g, times the T tokens, make one
  matrix of T * n_rep rows against the same keys. One loaded key block then serves all of them, and a single
  decode-like token (T = 1) still fills n_rep rows of a tile instead of one.
* The grid is (row blocks, KV heads, key splits). A new message is short (T of tens to hundreds) while the history
  is long (S up to tens of thousands), so a grid over row blocks and heads alone would give a few dozen programs on
  a GPU with 132 SMs, each walking all S keys. Splitting the keys (as flash-decoding does) restores parallelism.
* Two kernels, the two passes of the brief: `_row_stats_kernel` computes each row's running max and sum of exp
  over its split (flash-attention's m_i and l_i); torch merges the splits into one log-sum-exp per row (a
  [Hkv, T * n_rep] tensor); `_key_mass_kernel` recomputes the scores, normalizes them with that log-sum-exp and
  adds each key block's column sums (the probabilities summed over the block's rows) into an [S] float32 vector
  with atomics. Per-key atomics rather than per-round ones: a block's BLOCK_N keys mostly belong to one round, and
  BLOCK_N atomic adds to one address serialize, while adds to distinct keys do not contend within a block.
* The [S] per-key mass is reduced into rounds in torch by differences of a float64 cumulative sum at the round
  starts: exact enough (53-bit mantissa for sums of at most T * H), deterministic, and O(S) on a tiny vector.

The Triton bootstrap and the tile, split and online-softmax helpers these kernels share with kernels/slot_mass.py
are in kernels/_triton.py.
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
    tuning_time,
    tl,
    triton,
    triton_kernel_runs_on,
)

if triton is not None:
    from kvchat.kernels._triton import load_query_rows, online_softmax_step, scores_log2


def round_mass_ref(q: Tensor, k: Tensor, round_starts: Tensor, scale: float | None = None) -> Tensor:
    """q [T, H, D], k [Hkv, S, D], round_starts [R] (ascending slot indices, the first 0; round r holds keys
    [starts[r], starts[r+1]) and the last ends at S) -> [R] float32, summing to 1: the mean over query rows and heads
    of each round's share of the softmax over all S keys."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rep = n_heads // n_kv_heads
    keys = k.float().repeat_interleave(rep, dim=0)  # [H, S, D]
    logits = torch.einsum("thd,hsd->hts", q.float(), keys) * scale  # [H, T, S]
    probs = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [S]
    bounds = torch.cat([round_starts.to(torch.long).cpu(), torch.tensor([n_keys])])
    sums = torch.stack([probs[bounds[r]:bounds[r + 1]].sum() for r in range(len(bounds) - 1)])
    return (sums / (n_tokens * n_heads)).to(torch.float32)


if triton is not None:
    # (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M = 16 suits a short message (T * n_rep of a few rows);
    # 128 x 128 suits long ones; configurations that do not fit (D = 256 in fp32) fail to compile and the
    # autotuner skips them. Under the interpreter, autotuning would run every configuration in Python, so there
    # is exactly one, small enough that the tests' shapes still cross row-tile, key-block and split boundaries.
    if INTERPRET:
        _TILES = [(32, 64, 1, 1)]
    else:
        _TILES = [(16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
    _CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in _TILES]

    def _shared_memory_estimate(config: triton.Config, element_size: int, block_d: int) -> int:
        """Bytes of shared memory the tile needs: the query tile and num_stages - 1 key tiles in flight (what
        triton 3.9 reports for these kernels on sm_90)."""
        m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        return element_size * block_d * (m + (config.num_stages - 1) * n)

    def _prune_tiles(configs, named_args, **kwargs):
        """Drop row tiles taller than the rows there (only masked work), and tiles whose shared memory exceeds the
        GPU's (float32 with D = 256: they would fail only after tens of seconds of compiling); keep at least one."""
        args = {**named_args, **kwargs}  # the autotuner passes keyword arguments apart
        q = args["q_ptr"]
        limit = math.inf
        if q.device.type == "cuda":
            limit = getattr(torch.cuda.get_device_properties(q.device), "shared_memory_per_block_optin", math.inf)
        fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, args["rows_bucket"])
                   and _shared_memory_estimate(c, q.element_size(), args["BLOCK_D"]) <= limit]
        return fitting or configs[:1]

    # The tuning key is bucketed (powers of two of the row count and split length) rather than the raw (T, S):
    # S grows with every message of a chat, and keying on it would re-tune on every call. D is exact.
    # Timed by tuning_time: no 256 MiB buffer allocated for the first tuning run, inside a GPU memory budget.
    _AUTOTUNE = dict(configs=_CONFIGS, key=["rows_bucket", "split_bucket", "HEAD_DIM"],
                     prune_configs_by={"early_config_prune": _prune_tiles}, do_bench=tuning_time)

    @triton.autotune(**_AUTOTUNE)
    @triton.jit
    def _row_stats_kernel(q_ptr, k_ptr, row_max_ptr, row_sum_ptr,
                          stride_qt, stride_qh, stride_qd, stride_kh, stride_ks, stride_kd,
                          n_rows, n_keys, keys_per_split, n_rep, qk_scale_log2,
                          rows_bucket, split_bucket,  # autotuning key only
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pass 1: per row, the max (log2 domain) and the sum of exp2(score - max) over this program's key split;
        written to row_max / row_sum [Hkv, n_splits, n_rows]."""
        row_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        q = load_query_rows(q_ptr, rows, row_ok, kv_head, n_rep, stride_qt, stride_qh, stride_qd,
                             HEAD_DIM, BLOCK_D)
        k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, n_keys)
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        for block_start in range(split_start, split_end, BLOCK_N):
            keys = block_start + tl.arange(0, BLOCK_N)
            scores = scores_log2(q, k_head_ptr, keys, keys < split_end, stride_ks, stride_kd, qk_scale_log2,
                                  HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_IN_FP32)
            row_max, row_sum = online_softmax_step(row_max, row_sum, scores)
        out = (kv_head * tl.num_programs(2) + split) * n_rows + rows
        tl.store(row_max_ptr + out, row_max, mask=row_ok)
        tl.store(row_sum_ptr + out, row_sum, mask=row_ok)

    @triton.autotune(**_AUTOTUNE, reset_to_zero=["key_mass_ptr"])  # tuning runs accumulate into key_mass too
    @triton.jit
    def _key_mass_kernel(q_ptr, k_ptr, row_lse_ptr, key_mass_ptr,
                         stride_qt, stride_qh, stride_qd, stride_kh, stride_ks, stride_kd,
                         n_rows, n_keys, keys_per_split, n_rep, qk_scale_log2,
                         rows_bucket, split_bucket,  # autotuning key only
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pass 2: probabilities exp2(score - lse) of this program's rows and key split, summed over the rows,
        added into key_mass [S]."""
        row_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        q = load_query_rows(q_ptr, rows, row_ok, kv_head, n_rep, stride_qt, stride_qh, stride_qd,
                             HEAD_DIM, BLOCK_D)
        # Padding rows get lse = +inf, so their probabilities are exp2(-inf) = 0 without another select.
        row_lse = tl.load(row_lse_ptr + kv_head * n_rows + rows, mask=row_ok, other=float("inf"))
        k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, n_keys)
        for block_start in range(split_start, split_end, BLOCK_N):
            keys = block_start + tl.arange(0, BLOCK_N)
            key_ok = keys < split_end
            scores = scores_log2(q, k_head_ptr, keys, key_ok, stride_ks, stride_kd, qk_scale_log2,
                                  HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_IN_FP32)
            probs = tl.exp2(scores - row_lse[:, None])
            tl.atomic_add(key_mass_ptr + keys, tl.sum(probs, axis=0), mask=key_ok, sem="relaxed")


def _check_inputs(q: Tensor, k: Tensor, round_starts: Tensor, scale: float | None) -> list[int]:
    """One-sentence ValueErrors for every malformed input; returns the round starts as Python ints."""
    for name, value in (("q", q), ("k", k), ("round_starts", round_starts)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"k must be [Hkv, S, D], got shape {tuple(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys, k_head_dim = k.shape
    if n_tokens == 0 or n_heads == 0:
        raise ValueError(f"q needs at least one token and one head, got shape {tuple(q.shape)}")
    if n_kv_heads == 0 or n_keys == 0:
        raise ValueError(f"k needs at least one head and one key, got shape {tuple(k.shape)}")
    if k_head_dim != head_dim:
        raise ValueError(f"q and k must have the same head size, got {head_dim} and {k_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head size must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of KV heads ({n_kv_heads})")
    if round_starts.dim() != 1 or round_starts.numel() == 0:
        raise ValueError(f"round_starts must be a non-empty 1-D tensor, got shape {tuple(round_starts.shape)}")
    if round_starts.dtype.is_floating_point or round_starts.dtype.is_complex or round_starts.dtype == torch.bool:
        raise ValueError(f"round_starts must hold integers, got {round_starts.dtype}")
    starts = round_starts.tolist()  # the values are needed here anyway: one small device-to-host copy
    if starts[0] != 0:
        raise ValueError(f"round_starts must begin at 0, got {starts[0]}")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"round_starts must be strictly ascending (every round holds a key), got {starts}")
    if starts[-1] >= n_keys:
        raise ValueError(f"round_starts must be below the number of keys {n_keys}, got a start at {starts[-1]}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return starts


def _round_mass_triton(q: Tensor, k: Tensor, starts: list[int], scale: float,
                       keys_per_split: int | None = None) -> Tensor:
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys, _ = k.shape
    n_rep = n_heads // n_kv_heads
    n_rows = n_tokens * n_rep
    if keys_per_split is None:
        keys_per_split = split_length(math.ceil(n_rows / 64) * n_kv_heads, n_keys, q.device)  # 64-row tiles
    n_splits = math.ceil(n_keys / keys_per_split)
    common = dict(
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_kh=k.stride(0), stride_ks=k.stride(1), stride_kd=k.stride(2),
        n_rows=n_rows, n_keys=n_keys, keys_per_split=keys_per_split, n_rep=n_rep,
        qk_scale_log2=scale * math.log2(math.e),
        rows_bucket=min(next_power_of_2(n_rows), 256), split_bucket=min(next_power_of_2(keys_per_split), 4096),
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),  # tl.dot needs every side >= 16
        # fp32 inputs: full-precision products, not TF32 (whose 10-bit mantissa would cost ~1e-3 of the scores).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit integer patterns in tl.dot (seen in
        # triton 3.9), so there the tiles are widened first; products of bfloat16 values are exact in float32,
        # so the numbers are those of the GPU's bfloat16 dot with float32 accumulation.
        DOT_IN_FP32=INTERPRET and q.dtype == torch.bfloat16,
    )

    def grid(meta):
        return (triton.cdiv(n_rows, meta["BLOCK_M"]), n_kv_heads, n_splits)

    row_max = torch.empty(n_kv_heads, n_splits, n_rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    _row_stats_kernel[grid](q, k, row_max, row_sum, **common)
    row_lse = merge_splits(row_max, row_sum)  # [Hkv, n_rows]

    key_mass = torch.zeros(n_keys, dtype=torch.float32, device=q.device)
    _key_mass_kernel[grid](q, k, row_lse, key_mass, **common)

    prefix = torch.zeros(n_keys + 1, dtype=torch.float64, device=q.device)
    torch.cumsum(key_mass, dim=0, dtype=torch.float64, out=prefix[1:])
    bounds = torch.tensor(starts + [n_keys], dtype=torch.long, device=q.device)
    round_sums = prefix[bounds[1:]] - prefix[bounds[:-1]]
    return (round_sums / (n_tokens * n_heads)).to(torch.float32)


def round_mass(q: Tensor, k: Tensor, round_starts: Tensor, scale: float | None = None) -> Tensor:
    """q [T, H, D], k [Hkv, S, D], round_starts [R] (ascending slot indices, the first 0) -> [R] float32 summing to
    1: each round's share of the softmax over all S keys, averaged over query rows and heads; `round_mass_ref`'s
    meaning. Runs the Triton kernel where `triton_kernel_runs_on(q.device)`, else `round_mass_ref`. float32,
    float16 and bfloat16 inputs (any strides), accumulated in float32; head sizes up to 256."""
    starts = _check_inputs(q, k, round_starts, scale)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if not triton_kernel_runs_on(q.device):
        return round_mass_ref(q, k, round_starts, scale)
    return _round_mass_triton(q, k, starts, scale)


def benchmark(n_tokens: int = 64, n_keys: int = 32768, n_heads: int = 32, n_kv_heads: int = 8, head_dim: int = 128,
              n_rounds: int = 64, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
              with_reference: bool = True) -> dict:
    """Times `round_mass` (after its autotuning) on random inputs, and `round_mass_ref` where asked and where its
    two float32 [H, T, S] tensors fit in half the free memory: milliseconds, and the tiles the autotuner chose."""
    from triton.testing import do_bench

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n_tokens, n_heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(n_kv_heads, n_keys, head_dim, device=device, dtype=dtype, generator=gen)
    starts = torch.linspace(0, n_keys, n_rounds + 1, device=device)[:-1].long().unique()
    round_mass(q, k, starts)  # autotune outside the timing
    result = dict(n_tokens=n_tokens, n_keys=n_keys, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                  n_rounds=len(starts), dtype=str(dtype).removeprefix("torch."),
                  kernel_ms=do_bench(lambda: round_mass(q, k, starts)),
                  stats_tiles=str(_row_stats_kernel.best_config), mass_tiles=str(_key_mass_kernel.best_config))
    if with_reference and 2 * n_heads * n_tokens * n_keys * 4 < 0.5 * torch.cuda.mem_get_info(device)[0]:
        result["reference_ms"] = do_bench(lambda: round_mass_ref(q, k, starts))
    return result


if __name__ == "__main__":
    # python -m kvchat.kernels.round_scores: a few shapes of Llama 3.1 8B (32 / 8 heads, D = 128) and Qwen2.5 0.5B
    # (14 / 2 heads, D = 64) on the current GPU.
    shapes = [dict(n_tokens=t, n_keys=s, n_heads=h, n_kv_heads=hkv, head_dim=d)
              for h, hkv, d in ((32, 8, 128), (14, 2, 64)) for t in (1, 64, 512) for s in (4096, 32768)]
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            print(benchmark(**shape, dtype=dtype))
