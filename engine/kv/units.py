"""Retrieval units of a chat's K/V (LouisKV, ../shared/papers/louiskv-design-notes.md; its baseline Quest): groups of
input slots that a decode step reads or leaves out together, each summarized by a few keys, so that choosing what
to read costs one product per unit rather than per slot.

Per global layer and KV head, every slot of a span belongs to one unit (`member`), and each unit has a summary:
- `cluster_units` (LouisKV's input units): the span's keys in k-means clusters of about `tokens_per_cluster` keys
  (kernels/kmeans.py), each summarized by its centroid, the mean of its keys — so q . centroid is exactly the mean
  of q . k over the cluster. Clusters are per layer and KV head: slots that one head finds alike another may not.
- `page_units` (Quest's pages): runs of `page` consecutive slots, each summarized by the per-dimension minimum and
  maximum of its keys, whose bound sum_d max(q_d lo_d, q_d hi_d) no key of the page exceeds.

`unit_scores` turns a query into a score per unit and KV head: per query head, a softmax over the units of
q . summary x scale (the centroid's product, or the page's bound), averaged over the query heads sharing the KV
head (one choice per KV group, since K/V are read per KV head). `slots_of_best_units` ranks every slot by its unit's
score (ties: the lower slot) and keeps the best `n` per KV head: whole units in order of score, the last one cut to
fill the budget exactly, so every head of a layer reads the same number of slots (what a decode step's slot lists
need).

Shapes: G global layers, Hkv KV heads, H query heads, n slots of a span, U units, D head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.kernels import unit_choice
from kvchat.kernels.kmeans import DEFAULT_ITERATIONS, kmeans

TOKENS_PER_CLUSTER = 16


@dataclass
class Units:
    """The units of slots [start, end): per layer and KV head each slot's unit, and each unit's summary keys."""

    start: int
    end: int
    member: Tensor  # [G, Hkv, n] int64: the unit (in [0, U)) of each slot
    summary: Tensor  # [G, Hkv, U, S, D] float32: S summary keys per unit (1: a centroid; 2: a page's min and max)

    @property
    def n_units(self) -> int:
        return self.summary.shape[2]


# e4m3's largest finite value: each centroid's scale maps its largest component there.
E4M3_MAX = 448.0


def centroids_in_8_bits(centroids: Tensor) -> tuple[Tensor, Tensor]:
    """Centroids [..., D] as a chat stores them: each divided by a bfloat16 scale of its own (its largest component
    / 448) and rounded to float8_e4m3fn. Returns (the e4m3 bits as uint8 [..., D], the scales [...] bfloat16).

    Why 8 bits: a lazy resume reads a chat's units before its first token (~100 MB of a 32k chat's at the 8B shape
    in bfloat16, a quarter of what it read from disk: docs/benchmarks.md); e4m3 with a scale per unit halves them
    and chose as well on real weights (gemma-3-270m at 8k, KL 0.0070 / 0.0055 at 1,024 / 2,048 slots against
    bfloat16's 0.0094 / 0.0055; the embedded model's recall the same, 175/396: docs/probes/louiskv_fidelity.py)."""
    centroids = centroids.float()  # (the scale in float32 first: in float16 a small one underflows to 0)
    scale = (centroids.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12).to(torch.bfloat16)
    scaled = (centroids / scale.float()[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale


def centroids_of_8_bits(bits: Tensor, scale: Tensor) -> Tensor:
    """`centroids_in_8_bits`' inverse: float32 [..., D] from the e4m3 bits [..., D] uint8 and the scales [...]."""
    return bits.view(torch.float8_e4m3fn).float() * scale.float()[..., None]


def in_stored_precision(centroids: Tensor) -> Tensor:
    """Centroids [..., D] rounded as a chat stores them (`centroids_in_8_bits`), kept as float32, so the replies of
    the session that built them read the centroids a reopened chat reads. Rounding them again gives the same bits:
    the largest component of each comes back as 448 x its scale exactly (a bfloat16 scale's rounding moves it by
    at most 2^-8, and e4m3's neighbours of 448 are 416 and none), so the same scale and the same bits follow."""
    return centroids_of_8_bits(*centroids_in_8_bits(centroids))


def cluster_units(keys: Tensor, start: int, tokens_per_cluster: int = TOKENS_PER_CLUSTER,
                  iterations: int = DEFAULT_ITERATIONS) -> Units:
    """Keys [G, Hkv, n, D] of slots [start, start + n) in ceil(n / tokens_per_cluster) clusters per layer and KV
    head. A cluster that ends up empty keeps a centroid no slot points to: it is never read."""
    g, h, n, d = keys.shape
    k = max(1, math.ceil(n / tokens_per_cluster))
    centroids, assign, _ = kmeans(keys.reshape(g * h, n, d), k, iterations)
    return Units(start, start + n, assign.view(g, h, n), in_stored_precision(centroids.view(g, h, k, 1, d)))


def segment_units(keys: Tensor, start: int, cuts: Tensor | None, longest: int) -> Units:
    """Keys [G, Hkv, n, D] of a reply's slots [start, start + n) in contiguous segments (LouisKV's output units): a
    segment starts where the layer's trigger fired while the reply was written (`cuts` [G, n] bool, True where a
    token begins a new segment; None: no trigger was watched, segments of `longest` slots) and runs at most
    `longest` slots. Each segment's summary is the mean of its keys, per KV head; a layer with fewer segments than
    another leaves the rest of its centroids unused (no slot points to them)."""
    g, h, n, d = keys.shape
    index = torch.arange(n, device=keys.device)
    starts = torch.zeros(g, n, dtype=torch.bool, device=keys.device)
    starts[:, 0] = True
    if cuts is not None:
        starts |= cuts.to(keys.device, torch.bool)
    # a segment longer than `longest` starts again every `longest` slots from its own first slot
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # [G, n]: each slot's segment's first slot
    starts |= ((index - first) % longest) == 0
    member = starts.long().cumsum(1) - 1  # [G, n]
    n_units = int(member[:, -1].max()) + 1
    sums = keys.new_zeros(g, h, n_units, d, dtype=torch.float32)
    sums.scatter_add_(2, member[:, None, :, None].expand(g, h, n, d), keys.float())
    counts = torch.zeros(g, n_units, device=keys.device).scatter_add_(1, member, torch.ones(g, n, device=keys.device))
    centroids = sums / counts.clamp_min(1)[:, None, :, None]
    return Units(start, start + n, member[:, None].expand(g, h, n).contiguous(),
                 in_stored_precision(centroids[:, :, :, None]))


def round_units(keys: Tensor, start: int, reply_at: int, cuts: Tensor | None = None,
                tokens_per_cluster: int = TOKENS_PER_CLUSTER, iterations: int = DEFAULT_ITERATIONS,
                longest: int | None = None) -> Units:
    """A round's units (LouisKV): keys [G, Hkv, n, D] of slots [start, start + n), the user's message (and the chat
    template's tokens around it) up to `reply_at` in k-means clusters, the reply from there in segments at the
    trigger's `cuts` ([G, reply tokens] bool, or None) of at most `longest` slots (default: twice the clusters'
    size). The message's units come first."""
    n = keys.shape[2]
    at = min(max(reply_at - start, 0), n)
    longest = longest or 2 * tokens_per_cluster
    parts = []
    if at:
        parts.append(cluster_units(keys[:, :, :at], start, tokens_per_cluster, iterations))
    if at < n:
        parts.append(segment_units(keys[:, :, at:], start + at, cuts, longest))
    if len(parts) == 1:
        return parts[0]
    summary, member, _ = joined(parts)
    return Units(start, start + n, member, summary)


def sliced(units: Units, start: int, end: int) -> Units:
    """The units of slots [start, end) within `units`' span: every summary, the members of those slots alone (a unit
    with none left is never read)."""
    if not units.start <= start < end <= units.end:
        raise ValueError(f"slots [{start}, {end}) are not within [{units.start}, {units.end})")
    if (start, end) == (units.start, units.end):
        return units
    return Units(start, end, units.member[:, :, start - units.start : end - units.start], units.summary)


def page_units(keys: Tensor, start: int, page: int = TOKENS_PER_CLUSTER) -> Units:
    """Keys [G, Hkv, n, D] of slots [start, start + n) in pages of `page` consecutive slots (the last one shorter)."""
    g, h, n, d = keys.shape
    pages = math.ceil(n / page)
    padded = keys[:, :, torch.arange(pages * page, device=keys.device).clamp_max(n - 1)].float()  # last key repeated
    blocks = padded.view(g, h, pages, page, d)
    summary = torch.stack([blocks.amin(3), blocks.amax(3)], dim=3)  # [G, Hkv, P, 2, D]
    member = (torch.arange(n, device=keys.device) // page).expand(g, h, n)
    return Units(start, start + n, member, summary)


def unit_bounds(keys: Tensor, units: Units) -> Units:
    """`units` summarized by the per-dimension minimum and maximum of their member keys (keys [G, Hkv, n, D] of the
    units' span), as Quest summarizes a page: q . k of no member exceeds the bound. A unit with no member keeps an
    empty range (min +inf, max -inf), which `unit_scores` never chooses."""
    g, h, n, d = keys.shape
    index = units.member[..., None].expand(g, h, n, d)
    lo = keys.new_full((g, h, units.n_units, d), math.inf, dtype=torch.float32)
    hi = keys.new_full((g, h, units.n_units, d), -math.inf, dtype=torch.float32)
    lo.scatter_reduce_(2, index, keys.float(), "amin")
    hi.scatter_reduce_(2, index, keys.float(), "amax")
    return Units(units.start, units.end, units.member, torch.stack([lo, hi], dim=3))


def joined(units: list[Units]) -> tuple[Tensor, Tensor, Tensor]:
    """Several spans' units as one set: (summaries [G, Hkv, U, S, D], each listed slot's unit [G, Hkv, N], the slots
    [N] long), units numbered across the spans."""
    summaries, members, slots, offset = [], [], [], 0
    for u in units:
        summaries.append(u.summary)
        members.append(u.member + offset)
        slots.append(torch.arange(u.start, u.end, device=u.member.device))
        offset += u.n_units
    return torch.cat(summaries, 2), torch.cat(members, 2), torch.cat(slots)


def unit_scores(q: Tensor, summary: Tensor, scale: float) -> Tensor:
    """q [G, H, D] (one token's queries at each global layer), summaries [G, Hkv, U, S, D] -> [G, Hkv, U] float32:
    per query head a softmax over the units of q . centroid (S = 1) or of the bound sum_d max(q_d lo_d, q_d hi_d)
    (S = 2) times `scale`, averaged over the KV head's query heads. Several tokens' queries score together as more
    query heads: [G, H * T, D] with each head's T rows side by side."""
    g, n_heads, d = q.shape
    n_kv = summary.shape[1]
    grouped = q.float().view(g, n_kv, n_heads // n_kv, d)  # [G, Hkv, rep, D]
    if summary.shape[3] == 1:
        logits = grouped @ summary[:, :, :, 0].transpose(2, 3)  # [G, Hkv, rep, U]
    else:
        lo, hi = summary[:, :, :, 0], summary[:, :, :, 1]
        qd = grouped[:, :, :, None, :]  # [G, Hkv, rep, 1, D]
        logits = torch.maximum(qd * lo[:, :, None], qd * hi[:, :, None]).sum(-1)
        # a unit with no member (unit_bounds: an empty range, lo > hi) is never chosen
        logits = logits.masked_fill((lo[..., 0] > hi[..., 0])[:, :, None, :], -math.inf)
    return torch.softmax(logits * scale, dim=-1).mean(2)


def slots_of_best_units(scores: Tensor, member: Tensor, slots: Tensor, n: int, pool: int = 1) -> Tensor:
    """The `n` listed slots (of `slots` [N], ascending) of the best-scoring units per layer and KV head ([G, Hkv, U]
    scores, each slot's unit [G, Hkv, N]) -> [G, Hkv, n] int32, ascending: slots ranked by their unit's score, ties
    to the lower slot (whole units first, the last one cut at the budget). With `pool` > 1 (odd) a slot is ranked by
    the best unit within pool // 2 listed slots of it (the neighbours of a chosen slot come with it).

    On CUDA one Triton kernel makes the choice (kernels/unit_choice.py: a radix select of each row's n-th best, no
    host sync, so it runs inside the choice's CUDA graph); elsewhere its plain-torch reference, the same lists."""
    return unit_choice.slots_of_best_units(scores, member, slots, n, pool)
