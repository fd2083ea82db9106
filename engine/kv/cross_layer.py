"""Cross-layer KV merging (Krul §4, MiniCache's merge): two layers' K/V of the same tokens stored as one.

For every token, KV head and K or V, the two layers' vectors x_i, x_j [D] share one direction: the SLERP of their
normalised directions (t = 0.5: the normalised sum), and each layer keeps its own length. Tokens whose directions
differ most are kept as they were (MiniCache's retention): a fixed share `retain` of the round's tokens, ranked by
the largest angular distance over heads and K/V, plus any token whose vectors cannot be merged (one of them zero,
or the two opposite).

The merged form of a pair is one tensor shaped like two layers of K/V, so it is stored as a segment like any other
([2, 2, Hkv, n + m, D] for n tokens, m of them retained):
    [0, :, :, :n]      layer i's merged vectors: the shared direction times |x_i| (zeros where retained)
    [1, :, :, :n, 0]   |x_j| / |x_i|: layer j's merged vector is layer i's times this
    [1, :, :, :n, 1]   1 where the token is retained, else 0 (the rest of the row is 0: it compresses to nothing)
    [0 / 1, :, :, n:]  the retained tokens' own vectors of layer i / j, in token order
Storing layer i's merged vector rather than the unit direction makes the merge exact when the two layers are equal:
the direction times the length rounds back to x_i in the cache's dtype, and the ratio is exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Tokens whose two vectors are this close to opposite, or one of them this short, are retained, not merged.
OPPOSITE_COS = -0.999
TINY_NORM = 1e-20
MAX_RATIO = 1e4  # a length ratio beyond this would not survive fp16


@dataclass(frozen=True, order=True)
class LayerPair:
    """Two layers whose K/V are stored merged (low < high)."""

    low: int
    high: int

    def __post_init__(self):
        if not 0 <= self.low < self.high:
            raise ValueError(f"a merged pair needs two layers, lower first: {self.low}, {self.high}")

    def __str__(self) -> str:
        return f"{self.low}+{self.high}"

    @classmethod
    def parse(cls, text: str) -> "LayerPair":
        low, high = text.split("+")
        return cls(int(low), int(high))


def slerp(a: Tensor, b: Tensor, t: float = 0.5) -> Tensor:
    """Spherical interpolation between unit vectors a, b [..., D] (float32): the unit vector at t of the way."""
    if t == 0.5:  # the midpoint of the arc is the normalised sum: exact, and cheap
        mid = a + b
        return mid / mid.norm(dim=-1, keepdim=True).clamp_min(TINY_NORM)
    cos = (a * b).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.acos(cos)
    sin = torch.sin(omega)
    close = sin.abs() < 1e-6  # nearly the same direction: the straight line is the arc
    wa = torch.where(close, torch.full_like(sin, 1 - t), torch.sin((1 - t) * omega) / sin.clamp_min(1e-12))
    wb = torch.where(close, torch.full_like(sin, t), torch.sin(t * omega) / sin.clamp_min(1e-12))
    out = wa * a + wb * b
    return out / out.norm(dim=-1, keepdim=True).clamp_min(TINY_NORM)


def retained_count(n_tokens: int, retain: float) -> int:
    return min(n_tokens, math.ceil(retain * n_tokens))


def merge_pair(kv_i: Tensor, kv_j: Tensor, retain: float = 0.05, t: float = 0.5) -> Tensor:
    """Two layers' K/V [2, Hkv, n, D] of the same tokens -> their merged form [2, 2, Hkv, n + m, D] (module
    docstring), in their dtype and on their device."""
    if kv_i.shape != kv_j.shape or kv_i.dim() != 4 or kv_i.shape[0] != 2:
        raise ValueError(f"merge_pair takes two [2, Hkv, n, D] K/V of one shape, not {list(kv_i.shape)} and "
                         f"{list(kv_j.shape)}")
    if not 0 <= retain <= 1:
        raise ValueError(f"the retained share is in [0, 1], not {retain}")
    x, y = kv_i.float(), kv_j.float()
    n_x, n_y = x.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)  # [2, Hkv, n, 1]
    a, b = x / n_x.clamp_min(TINY_NORM), y / n_y.clamp_min(TINY_NORM)
    cos = (a * b).sum(-1)  # [2, Hkv, n]
    both_zero = (n_x[..., 0] <= TINY_NORM) & (n_y[..., 0] <= TINY_NORM)
    ratio = n_y / n_x.clamp_min(TINY_NORM)
    degenerate = ~both_zero & ((n_x[..., 0] <= TINY_NORM) | (n_y[..., 0] <= TINY_NORM) | (cos < OPPOSITE_COS)
                               | (ratio[..., 0] > MAX_RATIO))
    distance = torch.where(both_zero, torch.zeros_like(cos), torch.acos(cos.clamp(-1, 1)) / math.pi)
    n_tokens = x.shape[2]
    per_token = distance.amax(dim=(0, 1))  # [n]: the worst head and K/V decides
    keep = torch.zeros(n_tokens, dtype=torch.bool, device=x.device)
    count = retained_count(n_tokens, retain)
    if count:
        keep[torch.topk(per_token, count).indices] = True
    keep |= degenerate.any(dim=(0, 1))
    merged = slerp(a, b, t) * n_x  # layer i's merged vectors
    out = x.new_zeros(2, *x.shape[:2], n_tokens + int(keep.sum()), x.shape[3])
    out[0, :, :, :n_tokens] = torch.where(keep[:, None], 0.0, merged)
    out[1, :, :, :n_tokens, 0] = torch.where(keep | both_zero, 0.0, ratio[..., 0])
    out[1, :, :, :n_tokens, 1] = keep.float()
    out[0, :, :, n_tokens:] = x[:, :, keep]
    out[1, :, :, n_tokens:] = y[:, :, keep]
    return out.to(kv_i.dtype)


def unmerge_pair(merged: Tensor, n_tokens: int) -> Tensor:
    """The merged form of a pair -> the two layers' K/V [2 (layer i, j), 2, Hkv, n, D], in its dtype."""
    if merged.dim() != 5 or merged.shape[0] != 2 or merged.shape[1] != 2 or not \
            n_tokens <= merged.shape[3] <= 2 * n_tokens:
        raise ValueError(f"not the merged form of {n_tokens} tokens: {list(merged.shape)}")
    first = merged[0, :, :, :n_tokens]
    flags = merged[1, :, :, :n_tokens, 1]
    keep = flags[0, 0] > 0.5  # [n]; the same for every head and K/V
    if int(keep.sum()) != merged.shape[3] - n_tokens:
        raise ValueError("the merged form's retained tokens do not match its flags")
    out = torch.empty(2, *first.shape, dtype=merged.dtype, device=merged.device)
    out[0] = first
    out[1] = (first.float() * merged[1, :, :, :n_tokens, :1].float()).to(merged.dtype)
    out[0, :, :, keep] = merged[0, :, :, n_tokens:]
    out[1, :, :, keep] = merged[1, :, :, n_tokens:]
    return out


def approximate_pair(kv_i: Tensor, kv_j: Tensor, retain: float = 0.05, t: float = 0.5) -> Tensor:
    """What a restore gives back for two layers stored merged: [2, 2, Hkv, n, D]."""
    return unmerge_pair(merge_pair(kv_i, kv_j, retain, t), kv_i.shape[2])


def merge_in_cache(cache, pairs: list[LayerPair], start: int, end: int, retain: float = 0.05) -> Tensor:
    """Replace slots [start, end) of every pair's two layers by what a restore of them stored merged gives back
    (in place); returns the originals [len(pairs), 2, 2, Hkv, n, D] for `restore_in_cache`."""
    saved = []
    for pair in pairs:
        k_i, k_j = cache.layer(pair.low)[:, :, start:end], cache.layer(pair.high)[:, :, start:end]
        saved.append(torch.stack([k_i.clone(), k_j.clone()]))
        approx = approximate_pair(k_i, k_j, retain)
        k_i.copy_(approx[0])
        k_j.copy_(approx[1])
    return torch.stack(saved) if saved else torch.empty(0)


def restore_in_cache(cache, pairs: list[LayerPair], start: int, saved: Tensor) -> None:
    """Put back what `merge_in_cache` replaced."""
    for pair, kv in zip(pairs, saved):
        end = start + kv.shape[3]
        cache.layer(pair.low)[:, :, start:end] = kv[0]
        cache.layer(pair.high)[:, :, start:end] = kv[1]
