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
the chat at no cost in memory. A chat stored merged at once (`kvchat merge`) probes every round's end: where a
sliding-window layer (Gemma 3) no longer holds what a round's probe rows read (its ring has moved on, or a restore
loaded it trimmed), the chat is run again and probed as it goes (`replay_probes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

PROBE_ROWS = 16
REPLAY_CHUNK = 4096  # tokens a replay of the chat runs through the layers at once (as prefill's chunks)
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

    def add_probes(self, model, cache, probes: list[tuple[int, list[int]]], tokens: list[int] | None = None,
                   windows_from: int = 0) -> None:
        """A probe at each (end slot of a full cache, the tokens just before it: its last PROBE_ROWS are probed).

        A probe whose rows' sliding windows (Gemma 3) reach K/V the cache does not hold, a ring that has moved past
        them or, below `windows_from`, zeros a restore loaded from trimmed segments, is made on a replay of the
        chat's `tokens` (from slot 0: `replay_probes`), and without them left out. Without sliding windows every
        probe is made on the cache, as it always was."""
        held, replayed = [], []
        for end, tail in probes:
            tail = tail[-PROBE_ROWS:]
            (held if windows_held(model.cfg, cache, end - len(tail), windows_from) else replayed).append((end, tail))
        for end, tail in held:
            probed = probe_layers(model, cache, end, tail)
            if probed is not None:
                self.add(*probed)
        if replayed and tokens is not None:
            for probed in replay_probes(model, cache, tokens, replayed):
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


def windows_held(cfg, cache, start: int, windows_from: int = 0) -> bool:
    """Whether `cache` holds every sliding-window K/V that query rows from slot `start` on read (keys from
    start - window + 1 on): not in a ring that has moved past them, nor below `windows_from` (zeros, where a restore
    loaded trimmed segments). Always, without sliding windows."""
    if not cfg.sliding_window:
        return True
    first = max(0, start - cfg.sliding_window + 1)
    return first >= windows_from and (not getattr(cache, "ring_size", 0) or cache.holds_window(start))


@torch.inference_mode()
def replay_probes(model, cache, tokens: list[int],
                  probes: list[tuple[int, list[int]]]) -> list[tuple[Tensor, Tensor]]:
    """`probe_layers` at each (end slot of `cache`, the probed tokens just before it), made on the chat's `tokens`
    run again from slot 0 in rings of their own: each probe while the rings still hold its rows' windows.

    A probe at a round's end reads in a sliding-window layer only the keys its window reaches; a chat's cache no
    longer holds them for its early rounds (its rings keep the last window and RING_SLACK; a restore loads those
    layers trimmed to what the chat's end reads), and they depend on the hidden states of every layer below, so they
    are computed again. The replay runs in stretches of up to REPLAY_CHUNK tokens, each as far as the rings can go
    and still hold the windows of the probes ending in it (about RING_SLACK tokens past the first), which are then
    probed. It shares the cache's global layers (KVCache.fork_ring): their K/V of each stretch is put back as it was
    once the stretch is probed, and the cache's rings are not touched, so the cache is left as it was (its global
    layers bit for bit). A cache without rings (or too small to hold `tokens`) is replayed in a ring cache of its
    own."""
    cfg = model.cfg
    pending = sorted((p for p in probes if 0 < p[0] <= len(tokens)), key=lambda p: p[0])
    if not pending:
        return []
    last = pending[-1][0]
    shared = bool(getattr(cache, "ring_size", 0)) and last <= cache.capacity
    replay = cache.fork_ring() if shared else model.new_cache(last, ring=True)
    replay.length = 0
    at, out = 0, []
    while pending:
        end, tail = pending[0]
        # the rings then hold slots [stop - ring_size, stop): from the first key the next probe's rows read
        reach = max(0, end - len(tail) - cfg.sliding_window + 1) + replay.ring_size
        stop = min(at + REPLAY_CHUNK, max(end, reach), last)
        saved = replay.kv[:, :, :, at:stop].clone() if shared else None
        h = model.embed(torch.tensor(tokens[at:stop], dtype=torch.long))
        model.run_layers(h, torch.arange(at, stop), replay, at)
        replay.length = stop
        while pending and pending[0][0] <= stop:
            end, tail = pending.pop(0)
            if windows_held(cfg, replay, end - len(tail)):  # (a ring always does, but one shorter than its rows)
                probed = probe_layers(model, replay, end, tail)
                if probed is not None:
                    out.append(probed)
        if saved is not None:
            replay.kv[:, :, :, at:stop] = saved  # the global layers' K/V as the cache holds them
        at = stop
    return out


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
