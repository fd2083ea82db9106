"""Round Attention (round-attention.txt): rounds are chosen at the watershed layer w from the attention the new
message pays them there; layers up to and including w attend to every round (their K/V of every round stays on the
device), the layers above w only to the chosen rounds and the new message itself (engine.kv.tiered moves just
those rounds' upper K/V to the device). The paper counts layers from 1: its lower group "1 ~ L_w" is our [0, w].
The watershed layer is the policy's parameter `watershed`, handed to it from the model's calibration
(engine.calibrate.watershed; app/session/policies.py makes or reads it) or given outright.

The first round is always kept: it holds the system prompt and the chat's first tokens, where every query puts its
spare attention (the attention sink), so it would win every choice and carry no information about relevance. The
strategies pick among the other rounds, from their mass renormalized to sum to 1.

With `progressive` (the default; LoopServe's progressive decode-time selection) each decoded token's query at w
also names its top round, which is brought in if missing: a small model often looks up a fact only when it writes
the answer, not while it reads the question (docs/benchmarks.md).

A recheck catches what both choices missed: a decoded token whose most likely next token has a probability below
`recheck_below` has its queries at the upper layers scored against every round's key bounds (engine.kv.key_bounds:
per block of 32 tokens, the minimum and maximum of the keys, kept on the device), and the rounds that could hold
at least `recheck_mass` of its attention at any upper layer are brought in and the token run again with them; at
most `max_rechecks` per reply. No round's K/V moves unless it is found.

The paper's three strategies pick from the per-round attention mass m (summing to 1 over the earlier rounds):
  threshold  rounds with m >= 0.1;
  topk       the k rounds of most mass (k a count, or a fraction of the rounds: 0.1 = top-10%);
  adaptive   rounds with m > mean(m) + 3 std(m).
At least the round of most mass is always kept, so no strategy leaves the upper layers with nothing of the chat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend, SplitAttend
from kvchat.engine.model.decoder import Transformer
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


@dataclass(eq=False)  # identity equality and hashing, as before policies were dataclasses
class RoundAttention(KVPolicy):
    name = "round"
    strategy = "topk"
    tiered = True

    watershed: int | None = None  # None: not yet handed in (calibration_needed says so)
    k: float = 0.1
    threshold: float = 0.1
    sigmas: float = 3.0
    progressive: bool = True
    max_idle: int = 16
    recheck_below: float = 0.99
    recheck_mass: float = 0.1
    max_rechecks: int = 8
    # the rounds chosen for the latest message (for stats and tests): state, not a parameter
    last_selection: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        k, threshold, max_idle = self.k, self.threshold, self.max_idle
        if k <= 0 or (k > 1 and k != int(k)):
            raise KvchatError(f"k must be a positive count of rounds or a fraction in (0, 1], not {k}")
        if not 0 < threshold < 1:
            raise KvchatError(f"the mass threshold must be in (0, 1), not {threshold}")
        if max_idle < 0:
            raise KvchatError(f"max_idle must be a count of messages (0: never drop), not {max_idle}")
        if not 0 <= self.recheck_below < 1:
            raise KvchatError(f"recheck_below is a probability in [0, 1) (0: never recheck), not "
                              f"{self.recheck_below}")
        if not 0 < self.recheck_mass < 1:
            raise KvchatError(f"recheck_mass must be in (0, 1), not {self.recheck_mass}")
        if self.max_rechecks < 0:
            raise KvchatError(f"max_rechecks must be a count of decoded tokens, not {self.max_rechecks}")

    def calibration_needed(self) -> tuple[str, ...]:
        return ("watershed",) if self.watershed is None else ()

    @property
    def split(self) -> int:
        """The first layer that sees only the chosen rounds."""
        return self.watershed + 1

    def choose(self, mass: Tensor) -> list[int]:
        """Rounds to keep [ascending] from every earlier round's mass [R] at the watershed layer: the first
        round, and the strategy's pick among the others."""
        if mass.numel() <= 1:
            return list(range(mass.numel()))
        rest = mass[1:].float()
        rest = rest / rest.sum().clamp_min(1e-30)
        return [0] + [r + 1 for r in select_rounds(rest, self.strategy, self.k, self.threshold, self.sigmas)]

    def check_model(self, model: Transformer) -> None:
        lw, cfg = self.watershed, model.cfg
        if lw is None or not 0 <= lw < cfg.n_layers - 1:
            raise KvchatError(f"watershed layer {lw} leaves no layer above it in the model's "
                              f"{cfg.n_layers} layers")
        if cfg.window(lw):
            # Rounds are chosen from the attention at L_w, and a sliding-window layer attends to nothing older than
            # its window (Gemma 3): only global layers can choose.
            usable = [i for i in cfg.global_layers if i < cfg.n_layers - 1]
            raise KvchatError(f"watershed layer {lw} is a sliding-window layer; choose a global one "
                              f"({', '.join(map(str, usable))})")

    @torch.inference_mode()
    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        if not round_starts or not new_tokens:
            return None
        if model is None:
            raise ValueError("Round Attention scores rounds with the model's queries: pass model=")
        self.check_model(model)
        lw, start = self.watershed, cache.length
        positions = torch.arange(start, start + len(new_tokens))
        # The new message's lower layers, as its prefill will compute them (same slots, same values).
        h = model.run_layers(model.embed(torch.tensor(new_tokens)), positions, cache, start, layers=range(lw))
        queries = model.layers[lw].queries(h, model.rotations(positions))
        starts = torch.tensor(round_starts, dtype=torch.long)
        mass = round_mass(queries, cache.layer(lw)[0, :, :start], starts).cpu()
        self.last_selection = self.choose(mass)
        bounds = round_starts + [start]
        upper = torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in self.last_selection])
        return SplitAttend(self.split, upper)


class RoundAttentionThreshold(RoundAttention):
    name = "round-threshold"
    strategy = "threshold"


class RoundAttentionTopK(RoundAttention):
    name = "round-topk"
    strategy = "topk"


class RoundAttentionAdaptive(RoundAttention):
    name = "round-adaptive"
    strategy = "adaptive"
