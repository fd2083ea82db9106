"""Per-chat attention statistics that choose which layers' K/V to merge (Krul §4.2 and §5).

Two statistics per layer, both from the attention of a few *late* query rows (the last `rows` tokens before a point
in the chat: the end of a new message, the end of a reply), never from every causal row: averaged over all rows of
a causal matrix even uniform attention puts ~1/3 of its mass on the first and last 10% of what each row sees.

- the I-R share: the mass those rows put on the first 10% and the last 10% of the tokens before them (Krul's
  "Initial-Recent" pattern; a layer below `gamma` is input-sensitive and never merged);
- the attention profile: each row's attention pooled into 100 buckets of the keys' relative position, averaged over
  heads (head h of one layer has nothing to do with head h of another), from which the Euclidean distance between
  every two layers' profiles is accumulated.

`probe_layers` runs the probe rows again through every layer (saving and putting back their K/V, so the cache is
unchanged) to get each layer's queries, then scores them one layer at a time: the device holds [H, rows, S] scores
of one layer at most, never an attention matrix of the chat. A chat adds a probe at each new message and each reply
(prefill and decode, Krul §5) and keeps only the sums (`LayerStats`: L + L² numbers), so the statistics grow with
the chat at no cost in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

PROBE_ROWS = 16
BUCKETS = 100  # relative key positions in 1% steps: the 10% edges fall on bucket edges
EDGE_BUCKETS = 10


@dataclass
class LayerStats:
    n_layers: int
    probes: int = 0
    edge_mass: list[float] = field(default_factory=list)  # per layer: sum over probes of the I-R share
    distance: list[list[float]] = field(default_factory=list)  # [L][L]: sum over probes of profile distances

    def __post_init__(self):
        if not self.edge_mass:
            self.edge_mass = [0.0] * self.n_layers
        if not self.distance:
            self.distance = [[0.0] * self.n_layers for _ in range(self.n_layers)]
        if len(self.edge_mass) != self.n_layers or len(self.distance) != self.n_layers or \
                any(len(row) != self.n_layers for row in self.distance):
            raise ValueError(f"layer statistics of the wrong size for {self.n_layers} layers")

    def add(self, edge: Tensor, profiles: Tensor) -> None:
        """One probe: the I-R share [L] and the attention profiles [L, rows, BUCKETS]."""
        flat = profiles.double().flatten(1)
        dist = torch.cdist(flat[None], flat[None])[0]  # [L, L]
        self.probes += 1
        self.edge_mass = [a + float(b) for a, b in zip(self.edge_mass, edge.double())]
        self.distance = [[a + float(b) for a, b in zip(row, new)] for row, new in zip(self.distance, dist)]

    def add_probes(self, model, cache, probes: list[tuple[int, list[int]]]) -> None:
        """A probe at each (end slot of a full cache, the tokens just before it: its last PROBE_ROWS are probed)."""
        for end, tail in probes:
            probed = probe_layers(model, cache, end, tail[-PROBE_ROWS:])
            if probed is not None:
                self.add(*probed)

    def merge(self, other: "LayerStats") -> "LayerStats":
        """The statistics of both (pooling chats)."""
        if other.n_layers != self.n_layers:
            raise ValueError("layer statistics of models with different layer counts")
        return LayerStats(self.n_layers, self.probes + other.probes,
                          [a + b for a, b in zip(self.edge_mass, other.edge_mass)],
                          [[a + b for a, b in zip(r, s)] for r, s in zip(self.distance, other.distance)])

    def ir_share(self) -> list[float]:
        n = max(self.probes, 1)
        return [v / n for v in self.edge_mass]

    def mean_distance(self) -> list[list[float]]:
        n = max(self.probes, 1)
        return [[v / n for v in row] for row in self.distance]

    def as_dict(self) -> dict:
        return {"n_layers": self.n_layers, "probes": self.probes, "edge_mass": [round(v, 6) for v in self.edge_mass],
                "distance": [[round(v, 6) for v in row] for row in self.distance]}

    @classmethod
    def from_dict(cls, raw: dict) -> "LayerStats":
        stats = cls(int(raw["n_layers"]), int(raw["probes"]), [float(v) for v in raw["edge_mass"]],
                    [[float(v) for v in row] for row in raw["distance"]])
        if stats.probes < 0 or not all(math.isfinite(v) for v in stats.edge_mass):
            raise ValueError("layer statistics with negative or non-finite values")
        return stats


def bucket_index(n_keys: int, device) -> Tensor:
    """[n_keys]: the relative-position bucket of each key (key t of n in bucket floor(BUCKETS * t / n))."""
    return (torch.arange(n_keys, device=device) * BUCKETS // max(n_keys, 1)).clamp_max(BUCKETS - 1)


@torch.inference_mode()
def probe_layers(model, cache, end: int, tail: list[int]) -> tuple[Tensor, Tensor] | None:
    """(I-R share [L], profiles [L, rows, BUCKETS]) of the query rows of `tail`, the tokens at slots
    [end - len(tail), end) of a full cache (slot = position); None when fewer than twice as many tokens precede
    them. The cache is left as it was."""
    rows = len(tail)
    start = end - rows
    if rows < 1 or start < 2 * rows or end > cache.length:
        return None
    cfg, layers = model.cfg, range(model.cfg.n_layers)
    saved = cache.read(layers, start, end)
    queries: list[Tensor] = []
    h = model.embed(torch.tensor(tail, dtype=torch.long))
    model.run_layers(h, torch.arange(start, end), cache, start, queries=queries)
    cache.write(layers, start, saved)  # the probe's recomputed K/V are put back bit for bit
    edge, profiles = [], []
    for layer, q in enumerate(queries):
        probs = _late_attention(cache, layer, q, start, end, cfg)  # [rows, end] (head mean)
        profiles.append(_pool(probs, end))
        edge.append(_edge_share(probs, start))
    return torch.stack(edge).cpu(), torch.stack(profiles).cpu()


def _late_attention(cache, layer: int, q: Tensor, start: int, end: int, cfg) -> Tensor:
    """Head-mean attention probabilities [rows, end] of queries q [rows, H, D] at positions [start, end)."""
    # A sliding-window layer's keys from the first its rows can see (a ring cache holds no earlier ones).
    first = max(0, start - cfg.window(layer) + 1) if cfg.window(layer) else 0
    keys = cache.span(layer, first, end)[0].float()  # [Hkv, end - first, D]
    n_rep = cfg.n_heads // cfg.n_kv_heads
    qh = q.float().transpose(0, 1).reshape(cfg.n_kv_heads, n_rep * q.shape[0], -1)  # [Hkv, rep*rows, D]
    scores = torch.bmm(qh, keys.transpose(1, 2)) * cfg.softmax_scale  # [Hkv, rep*rows, end - first]
    scores = scores.view(cfg.n_kv_heads, n_rep, q.shape[0], end - first)
    pos = torch.arange(start, end, device=keys.device)[:, None]
    key_pos = torch.arange(first, end, device=keys.device)[None, :]
    visible = key_pos <= pos
    if cfg.window(layer):
        visible &= key_pos > pos - cfg.window(layer)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # [rows, end - first]
    return torch.nn.functional.pad(probs, (first, 0))  # [rows, end]: nothing before the window


def _pool(probs: Tensor, end: int) -> Tensor:
    """[rows, end] -> [rows, BUCKETS]: mass per relative-position bucket."""
    out = probs.new_zeros(probs.shape[0], BUCKETS)
    return out.index_add_(1, bucket_index(end, probs.device), probs)


def _edge_share(probs: Tensor, start: int) -> Tensor:
    """Mean over rows of the mass on the first and last 10% of the keys each row sees (its causal prefix)."""
    shares = []
    for r in range(probs.shape[0]):
        seen = start + r + 1
        edge = max(1, math.ceil(seen * EDGE_BUCKETS / BUCKETS))
        row = probs[r, :seen]
        shares.append(row[:edge].sum() + row[seen - edge:].sum() if seen > 2 * edge else row.sum())
    return torch.stack(shares).mean()
