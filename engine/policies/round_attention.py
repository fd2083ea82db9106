"""Round Attention (round-attention.txt): rounds are chosen once, at the watershed layer L_w, from the attention the
new message pays them there; layers below L_w attend to every round, layers from L_w up only to the chosen rounds
(and the new message itself).

The paper's three strategies pick from the per-round attention mass m (summing to 1 over the earlier rounds):
  threshold  rounds with m >= 0.1;
  topk       the k rounds of most mass (k a count, or a fraction of the rounds: 0.1 = top-10%);
  adaptive   rounds with m > mean(m) + 3 std(m).
At least the round of most mass is always kept, so no strategy leaves the upper layers with nothing of the chat.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvchat.engine.model import Attend, KVCache, SplitAttend, Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.errors import KvchatError
from kvchat.kernels.round_scores import round_mass

STRATEGIES = ("threshold", "topk", "adaptive")


def select_rounds(mass: Tensor, strategy: str, k: float = 0.1, threshold: float = 0.1,
                  sigmas: float = 3.0) -> list[int]:
    """Indices (ascending) of the rounds `strategy` keeps, from their attention mass [R]."""
    n = mass.numel()
    if n == 0:
        return []
    if strategy == "threshold":
        keep = (mass >= threshold).nonzero().flatten().tolist()
    elif strategy == "topk":
        count = max(1, min(n, round(k) if k >= 1 else math.ceil(k * n)))
        keep = torch.topk(mass, count).indices.tolist()
    elif strategy == "adaptive":
        std = mass.std(unbiased=False) if n > 1 else torch.tensor(0.0)
        keep = (mass > mass.mean() + sigmas * std).nonzero().flatten().tolist()
    else:
        raise KvchatError(f"unknown round selection strategy {strategy!r} (accepted: {', '.join(STRATEGIES)})")
    return sorted(set(keep) | {int(mass.argmax())})


class RoundAttention(KVPolicy):
    name = "round"
    strategy = "topk"

    def __init__(self, watershed: int | None = None, k: float = 0.1, threshold: float = 0.1, sigmas: float = 3.0):
        if k <= 0 or (k > 1 and k != int(k)):
            raise KvchatError(f"k must be a positive count of rounds or a fraction in (0, 1], not {k}")
        if not 0 < threshold < 1:
            raise KvchatError(f"the mass threshold must be in (0, 1), not {threshold}")
        self.watershed, self.k, self.threshold, self.sigmas = watershed, k, threshold, sigmas
        self.last_selection: list[int] = []  # the rounds chosen for the latest message (for stats and tests)

    @classmethod
    def create(cls, engine=None, progress=None, **options) -> "RoundAttention":
        """`progress(done, total)` hears about the calibration a model without one gets on first use."""
        policy = cls(**options)
        if policy.watershed is None:
            if engine is None:
                raise KvchatError(f"the {cls.name} KV policy needs a model to calibrate its watershed layer")
            from kvchat.engine.calibration import ensure_calibration
            from kvchat.storage.fingerprint import model_fingerprint

            policy.watershed = ensure_calibration(engine, model_fingerprint(engine.path), progress).watershed
        return policy

    @torch.inference_mode()
    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        if not round_starts or not new_tokens:
            return None
        if model is None:
            raise ValueError("Round Attention scores rounds with the model's queries: pass model=")
        lw = self.watershed
        if lw is None or not 0 < lw < model.cfg.n_layers:
            raise KvchatError(f"watershed layer {lw} is not inside the model's {model.cfg.n_layers} layers")
        start = cache.length
        positions = torch.arange(start, start + len(new_tokens))
        # The new message's lower layers, as its prefill will compute them (same slots, same values).
        h = model.run_layers(model.embed(torch.tensor(new_tokens)), positions, cache, start, layers=range(lw))
        queries = model.layers[lw].queries(h, model.rope(positions))
        starts = torch.tensor(round_starts, dtype=torch.long)
        mass = round_mass(queries, cache.kv[lw, 0, :, :start], starts).cpu()
        self.last_selection = select_rounds(mass, self.strategy, self.k, self.threshold, self.sigmas)
        bounds = round_starts + [start]
        upper = torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in self.last_selection])
        return SplitAttend(lw, upper)


class RoundAttentionThreshold(RoundAttention):
    name = "round-threshold"
    strategy = "threshold"


class RoundAttentionTopK(RoundAttention):
    name = "round-topk"
    strategy = "topk"


class RoundAttentionAdaptive(RoundAttention):
    name = "round-adaptive"
    strategy = "adaptive"
