"""LoopServe's online sparse prefill (§5.1, Algorithm 5): new tokens attend only along the lines that hold their
attention.

Per layer and query head, a uniform sample of the new tokens' query rows (48, as the paper) is scored against
every key; from those rows, the attention mass on each vertical line (a key column) and each slash band (a block
diagonal: the slashes a kernel block covers, the unit the kernel computes) is summed, and lines are taken in order
of mass per unit of work until they hold `alpha` of the sampled rows' attention (the paper's greedy, where
an entry on both a chosen vertical and a chosen diagonal counts once: each sampled entry is credited to the first
chosen line through it). The
chosen lines become kernels.sparse_prefill's block/column index; the new tokens' attention is then computed there
only. Nothing is learned offline: the lines are chosen again for every prefill chunk and layer (Observation 2,
patterns move with the input).

A head falls back to dense attention where its lines would cost more than `max_density` of the dense work (the
index would save little) or its sampled scores are not finite. Below `min_keys` keys the whole prefill is dense:
selection and a sparse kernel cost more than they save on short contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvchat.kernels.sparse_prefill import (
    SparseIndex,
    block_size,
    build_index,
    sparse_prefill_attention,
    sparse_prefill_ref,
    unsupported_reason,
)

# Keys from which a prefill chunk's attention is sparse once sparse prefill is on. The engine leaves it off: on the
# H100 (2026-11-23, docs/benchmarks.md "LoopServe") the kernel beats dense SDPA from 32k keys at the densities of
# structured attention, but with the selection's cost the whole prefill is still slower at every length measured
# (random-weight 8B: every head falls back to dense; gemma-3-270m: 0.68x). The `loopserve` policy turns it on.
DEFAULT_MIN_KEYS = 32768


@dataclass
class SparseStats:
    """What the sparse prefills of a run did: calls, heads that fell back to dense, and the computed share of the
    dense causal work (mean over calls)."""

    calls: int = 0
    dense_heads: int = 0
    heads: int = 0
    density_sum: float = 0.0

    @property
    def density(self) -> float:
        return self.density_sum / self.calls if self.calls else 1.0

    def as_dict(self) -> dict:
        return {"calls": self.calls, "density": round(self.density, 4), "dense_heads": self.dense_heads,
                "heads": self.heads}


@dataclass
class SparsePrefill:
    alpha: float = 0.955  # the attention mass the chosen lines must hold (the paper's main setting)
    samples: int = 48  # sampled query rows per chunk
    min_keys: int = DEFAULT_MIN_KEYS
    max_density: float = 0.6
    stats: SparseStats = field(default_factory=SparseStats)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.samples < 1 or self.min_keys < 0 or not 0.0 < self.max_density <= 1.0:
            raise ValueError("samples must be >= 1, min_keys >= 0 and max_density in (0, 1]")

    def applies(self, n_new: int, n_keys: int) -> bool:
        return n_keys >= max(self.min_keys, 1) and n_new > 1

    def attend(self, q: Tensor, kv: Tensor, start: int, scale: float, layer: int | None = None) -> Tensor | None:
        """New tokens' queries q [T, H, D] (slots [start, start + T)) over a layer's cache kv [2, Hkv, C, D] whose
        slots [0, start + T) hold every key -> attention output [T, H * D], or None where every head fell back to
        dense (the caller's dense attention is then faster than the kernel's). Every layer alike (`layer` unused)."""
        n_new, n_heads, head_dim = q.shape
        keys, values = kv[0, :, : start + n_new], kv[1, :, : start + n_new]
        index = self.index(q, keys, start, scale)
        if index is None:
            return None
        if unsupported_reason(n_heads, keys.shape[0], head_dim, q.dtype, q.device) is None:
            out = sparse_prefill_attention(q, keys, values, index, scale)
        else:  # the CPU without Triton: the same attention in plain torch (quality runs, not speed)
            out = sparse_prefill_ref(q, keys, values, index, scale)
        return out.reshape(n_new, n_heads * head_dim)

    def index(self, q: Tensor, keys: Tensor, start: int, scale: float) -> SparseIndex | None:
        """The chunk's index, or None where every head falls back to dense."""
        block = block_size(q.shape[2])
        verticals, diagonals, dense = select_lines(q, keys, start, self.alpha, self.samples, scale, block)
        index = build_index(verticals, diagonals, start, q.shape[0], block, dense)
        dense = dense | (index.head_density() > self.max_density)
        n_dense = int(dense.sum())
        self.stats.calls += 1
        self.stats.heads += q.shape[1]
        self.stats.dense_heads += n_dense
        if n_dense == q.shape[1]:
            self.stats.density_sum += 1.0
            return None
        if n_dense:
            index = build_index(verticals, diagonals, start, q.shape[0], block, dense)
        self.stats.density_sum += index.density()
        return index


def sample_rows(n_new: int, samples: int, device: torch.device) -> Tensor:
    """Up to `samples` query rows spread evenly over [0, n_new), the last row always among them."""
    if n_new <= samples:
        return torch.arange(n_new, device=device)
    return torch.linspace(0, n_new - 1, samples, device=device).round().long().unique()


def select_lines(q: Tensor, keys: Tensor, start: int, alpha: float, samples: int, scale: float,
                 block: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, H, D], keys [Hkv, N, D] (N = start + T) -> verticals [H, N] bool (key slots), diagonals
    [H, M + KB - 1] bool (block diagonals: slashes as the kernel computes them), dense [H] bool (heads whose
    sampled scores were not finite).

    A line's cost is the work the kernel does for it: a vertical, one key for every new row that can see it; a
    block diagonal, `block` keys for every row of the query blocks it crosses (inside the causal region)."""
    n_new, n_heads, _ = q.shape
    n_kv_heads, n_keys, _ = keys.shape
    n_rep = n_heads // n_kv_heads
    device = q.device
    n_qblocks, n_kblocks = -(-n_new // block), -(-n_keys // block)
    rows = sample_rows(n_new, samples, device)
    cols = torch.arange(n_keys, device=device)
    causal = cols[None, :] <= (start + rows)[:, None]  # [S, N]
    diagonal = (cols // block)[None, :] - (rows // block)[:, None] + n_qblocks - 1  # [S, N]
    len_v = torch.where(cols < start, n_new, n_keys - cols).float()  # new rows that can see each key
    m = torch.arange(n_qblocks, device=device)
    rows_in = (torch.clamp((m + 1) * block, max=n_new) - m * block).float()  # [M]
    last_kb = torch.div(start + torch.clamp((m + 1) * block, max=n_new) - 1, block, rounding_mode="floor")
    kb = torch.arange(n_kblocks, device=device)
    inside = (kb[None, :] <= last_kb[:, None]).float() * rows_in[:, None] * block  # [M, KB]: work per block
    len_d = torch.zeros(n_qblocks + n_kblocks - 1, dtype=torch.float32, device=device)
    len_d.index_add_(0, (kb[None, :] - m[:, None] + n_qblocks - 1).flatten(), inside.flatten())
    # Grouped by KV head (the n_rep query heads sharing one are rows of one product: no repeated keys), in the
    # cache's dtype; KV heads at a time so the [heads, S, N] scores stay within ~256 MB.
    q_rows = q[rows].view(rows.numel(), n_kv_heads, n_rep, -1).permute(1, 2, 0, 3)  # [Hkv, n_rep, S, D]
    chunk = max(1, 2**26 // (n_rep * rows.numel() * n_keys))
    parts = [_select_heads(q_rows[g : g + chunk], keys[g : g + chunk], causal, diagonal, len_v, len_d, alpha, scale)
             for g in range(0, n_kv_heads, chunk)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _select_heads(q_rows: Tensor, keys: Tensor, causal: Tensor, diagonal: Tensor, len_v: Tensor, len_d: Tensor,
                  alpha: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """q_rows [g, n_rep, S, D] and keys [g, N, D] of g KV heads -> the lines of their g * n_rep query heads."""
    n_groups, n_rep, n_samples, head_dim = q_rows.shape
    n_heads = n_groups * n_rep
    n_keys, n_diag = keys.shape[1], len_d.numel()
    scores = (q_rows.reshape(n_groups, n_rep * n_samples, head_dim) @ keys.transpose(1, 2)).float()
    scores = scores.view(n_heads, n_samples, n_keys).mul_(scale).masked_fill_(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    bad = ~torch.isfinite(probs).all(-1).all(-1)  # [h]
    probs = torch.nan_to_num(probs, nan=0.0).reshape(n_heads, -1)
    flat_diagonal = diagonal.reshape(1, -1).expand(n_heads, -1)
    w_v = probs.view(n_heads, n_samples, n_keys).sum(1)  # [h, N]
    w_d = torch.zeros(n_heads, n_diag, dtype=torch.float32, device=keys.device)
    w_d.scatter_add_(1, flat_diagonal, probs)
    # Mass per unit of work, verticals then diagonals (a diagonal with no causal work has no mass either).
    ratio = torch.cat([w_v / len_v, w_d / len_d.clamp(min=1.0)], dim=1)
    order = ratio.argsort(dim=1, descending=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(n_keys + n_diag, device=keys.device).expand(
        n_heads, -1))
    rank_v, rank_d = rank[:, :n_keys], rank[:, n_keys:]
    # Each sampled entry is covered first by the better-ranked of its vertical and its diagonal.
    first = torch.minimum(rank_v[:, None, :], rank_d.gather(1, flat_diagonal).view(n_heads, n_samples, n_keys))
    covered = torch.zeros(n_heads, n_keys + n_diag, dtype=torch.float32, device=keys.device)
    covered.scatter_add_(1, first.view(n_heads, -1), probs)
    cumulative = covered.cumsum(1)
    if alpha >= 1.0:  # every line holding any mass
        need = (covered > 0).cumsum(1).argmax(1, keepdim=True)
    else:
        need = torch.searchsorted(cumulative, (alpha * cumulative[:, -1:]).contiguous())  # [h, 1]: lines - 1
    return rank_v <= need, rank_d <= need, bad
