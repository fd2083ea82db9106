"""Choosing the next token: greedy at temperature 0, else top-k, then top-p, then temperature, from a seeded
generator so a given seed replays the same reply."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvchat.errors import KvchatError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        if not 0.0 <= self.temperature <= 100.0:
            raise KvchatError(f"temperature must be between 0 and 100, not {self.temperature}")
        if self.top_k < 0:
            raise KvchatError(f"top-k must be 0 (off) or positive, not {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvchatError(f"top-p must be in (0, 1], not {self.top_p}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params.validate()
        self._gen = None
        if not params.greedy:
            # Sampling happens on the CPU: a CPU generator replays identically on every device.
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: Tensor) -> int:
        """logits [V] (any device) -> token id."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        return int(sample(logits.float().cpu(), self.params, self._gen))


def sample(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> Tensor:
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return torch.multinomial(probs, 1, generator=generator)[0]
