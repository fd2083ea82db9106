"""Key bounds: what a query could at most pay each round whose upper-layer K/V is not on the device.

For every block of BLOCK consecutive tokens of a round and every upper layer and KV head, the per-dimension minimum
and maximum of the block's keys (Quest's page summary, here per round's block). For a query q, no key of the block
scores above  sum_d max(q_d lo_d, q_d hi_d) = q . (lo + hi) / 2 + |q| . (hi - lo) / 2,  so a softmax over the
blocks' bounds (each weighted by its length) estimates the attention every round would get if it were visible,
erring on the side of a round's keys being close to the query. Rechecks (engine.kv.tiered) use it to find the
rounds a doubtful token reads without moving any round's K/V to the device; it costs 1/BLOCK of the upper keys.

Shapes: Lu upper layers, Hkv KV heads, n tokens, nb = ceil(n / BLOCK) blocks, D head size, H query heads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK = 32


def key_bounds(keys: Tensor) -> Tensor:
    """Keys [Lu, Hkv, n, D] of one round -> bounds [Lu, 2, Hkv, nb, D] (index 0 the minimum, 1 the maximum),
    on the keys' device and in their dtype (the segment layout with blocks for tokens, so the store keeps them)."""
    n = keys.shape[2]
    if n == 0:
        raise ValueError("a round without tokens has no key bounds")
    nb = math.ceil(n / BLOCK)
    # The last block is padded with its own last key, which changes neither its minimum nor its maximum.
    padded = keys[:, :, torch.arange(nb * BLOCK, device=keys.device).clamp_max(n - 1)]
    blocks = padded.unflatten(2, (nb, BLOCK))  # [Lu, Hkv, nb, BLOCK, D]
    return torch.stack([blocks.amin(3), blocks.amax(3)], dim=1)


def block_counts(n: int) -> Tensor:
    """Tokens in each of the blocks of a round of n tokens [nb]."""
    counts = torch.full((math.ceil(n / BLOCK),), BLOCK)
    counts[-1] = n - BLOCK * (len(counts) - 1)
    return counts


class BoundsTable:
    """Every closed round's bounds side by side on the device, in chat order: [Lu, 2, Hkv, NB, D] (NB all blocks),
    so one product per layer scores every round. A round whose bounds are not known yet holds zeros until `fill`."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        # grown by doubling, as KVCache is: appending a round never copies the others
        self._storage = torch.zeros((n_layers, 2, n_kv_heads, 64, head_dim), dtype=dtype, device=device)
        self.offsets = [0]  # round r's blocks are [offsets[r], offsets[r + 1])
        self.lengths: list[int] = []  # tokens per round
        self.known: list[bool] = []
        self._index: tuple[Tensor, Tensor] | None = None  # each block's log length and round, built when scored

    @property
    def bounds(self) -> Tensor:
        """Every round's bounds [Lu, 2, Hkv, NB, D] (a view)."""
        return self._storage[:, :, :, : self.offsets[-1]]

    @property
    def n_rounds(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return self.bounds.numel() * self.bounds.element_size()

    def append(self, n_tokens: int, bounds: Tensor | None) -> None:
        """A round of n_tokens after the others, with its bounds [Lu, 2, Hkv, nb, D] (any device) or None."""
        nb, at = math.ceil(n_tokens / BLOCK), self.offsets[-1]
        if bounds is not None:
            self._check(bounds, nb)
        self._reserve(at + nb)
        block = self._storage[:, :, :, at : at + nb]
        if bounds is None:
            block.zero_()
        else:
            block.copy_(bounds)
        self.offsets.append(at + nb)
        self.lengths.append(n_tokens)
        self.known.append(bounds is not None)
        self._index = None

    def fill(self, r: int, bounds: Tensor) -> None:
        self._check(bounds, self.offsets[r + 1] - self.offsets[r])
        self._storage[:, :, :, self.offsets[r] : self.offsets[r + 1]] = bounds.to(self._storage.device)
        self.known[r] = True

    def truncate(self, n_rounds: int) -> None:
        del self.lengths[n_rounds:], self.known[n_rounds:], self.offsets[n_rounds + 1 :]
        self._index = None

    def fits(self, n_tokens: int, bounds: Tensor) -> bool:
        """Whether `bounds` has the shape of a round of n_tokens's bounds in this table."""
        return tuple(bounds.shape) == self._shape(math.ceil(n_tokens / BLOCK))

    def round(self, r: int) -> Tensor | None:
        """Round r's bounds [Lu, 2, Hkv, nb, D], or None if not known."""
        return self.bounds[:, :, :, self.offsets[r] : self.offsets[r + 1]] if self.known[r] else None

    def round_shares(self, q: Tensor, layers: slice = slice(None), skip_first: bool = True) -> Tensor:
        """One token's queries [n, H, D] at the n upper layers `layers` (counted from the split; default all) ->
        each round's estimated share [n, R] of the attention over the closed rounds, per layer, summed over heads
        and normalized to 1; the first round (the attention sink, which every choice keeps) left out with
        `skip_first`."""
        lo, hi = self.bounds[layers, 0], self.bounds[layers, 1]  # [n, Hkv, NB, D]
        n_layers, hkv, d = lo.shape[0], lo.shape[1], lo.shape[3]
        qg = q.to(lo.dtype).view(n_layers, hkv, -1, d)  # [n, Hkv, n_rep, D]
        # no key of a block scores above q . mid + |q| . half_width
        bound = (qg @ ((lo + hi) / 2).transpose(2, 3) + qg.abs() @ ((hi - lo) / 2).transpose(2, 3)).float()
        log_count, owner = self._scoring_index()
        p = torch.softmax(bound / math.sqrt(d) + log_count, dim=-1).sum((1, 2))  # [n, NB]
        share = torch.zeros(n_layers, self.n_rounds, device=p.device).index_add_(1, owner, p)
        if skip_first:
            share[:, 0] = 0
        return share / share.sum(1, keepdim=True).clamp_min(1e-30)

    def round_share(self, q: Tensor, upper_layer: int, skip_first: bool = True) -> Tensor:
        """`round_shares` of one query [H, D] at upper layer `upper_layer`: [R]."""
        return self.round_shares(q[None], slice(upper_layer, upper_layer + 1), skip_first)[0]

    def _scoring_index(self) -> tuple[Tensor, Tensor]:
        if self._index is None:
            device = self.bounds.device
            log_count = torch.cat([block_counts(n) for n in self.lengths]).float().log().to(device)
            blocks = torch.tensor(self.offsets[1:]) - torch.tensor(self.offsets[:-1])
            owner = torch.repeat_interleave(torch.arange(self.n_rounds), blocks).to(device)
            self._index = log_count, owner
        return self._index

    def _shape(self, nb: int) -> tuple[int, ...]:
        return (*self._storage.shape[:3], nb, self._storage.shape[4])

    def _check(self, bounds: Tensor, nb: int) -> None:
        if tuple(bounds.shape) != self._shape(nb):
            raise ValueError(f"key bounds of shape {list(bounds.shape)} where {list(self._shape(nb))} belong")

    def _reserve(self, n_blocks: int) -> None:
        if n_blocks > self._storage.shape[3]:
            grown = self._storage.new_zeros(self._shape(max(n_blocks, 2 * self._storage.shape[3])))
            grown[:, :, :, : self.offsets[-1]] = self.bounds
            self._storage = grown


def round_share_ref(q: Tensor, keys: Tensor, round_starts: list[int], skip_first: bool = True) -> Tensor:
    """What `round_share` estimates, exactly: the share [R] of query [H, D]'s attention over keys [Hkv, S, D]
    (S = all closed rounds) that each round gets, summed over heads, normalized (tests compare the two)."""
    hkv, d = keys.shape[0], keys.shape[2]
    qg = q.float().view(hkv, -1, d)
    p = torch.softmax(qg @ keys.float().transpose(1, 2) / math.sqrt(d), dim=-1).sum((0, 1))  # [S]
    bounds = round_starts + [keys.shape[1]]
    share = torch.stack([p[bounds[r]:bounds[r + 1]].sum() for r in range(len(round_starts))])
    if skip_first:
        share[0] = 0
    return share / share.sum().clamp_min(1e-30)
