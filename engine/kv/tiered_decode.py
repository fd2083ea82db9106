"""A tiered cache's decode step (engine.kv.tiered) replayed from CUDA graphs: two replays, the lower tier then the
upper, with the host between them (engine.model.cuda_graph's Replay, Bound and StepInputs).

Shapes: d model width, H query heads, D head size, V vocabulary.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvchat.engine.model.cuda_graph import Bound, Replay, StepInputs

if TYPE_CHECKING:
    from kvchat.engine.kv.tiered import TieredKV


class TieredDecode:
    """A tiered cache's decode step as two replays (engine.model.cuda_graph): the lower tier (embedding and layers
    [0, split) over every round), then, once the host has looked at the token's query at w and perhaps brought a
    round in, the upper tier and the head over `upper`. The hidden state and the query at w pass between them in
    buffers of their own, so each replay is captured again only when its own cache's storage or the rotary table
    moved (growing `upper` for a round brought in recaptures the upper replay alone)."""

    def __init__(self, tiered: TieredKV, capture: bool):
        m = tiered.model
        # Held weakly: the tiered cache keeps this step (`_replayed`), and a strong reference back would keep a
        # dropped cache on the GPU until the cycle collector runs (engine.model.cuda_graph.Replay).
        self._tiered, self.capture = weakref.ref(tiered), capture
        self.inputs = StepInputs(m.device, n_caches=2)
        self.h = torch.zeros(1, m.cfg.d_model, device=m.device, dtype=m.dtype)
        self.query_w = torch.zeros(1, m.cfg.n_heads, m.cfg.head_dim, device=m.device, dtype=m.dtype)
        self._lower = self._upper = None
        self._lower_bound = self._upper_bound = Bound()

    @property
    def tiered(self) -> TieredKV:
        tiered = self._tiered()
        if tiered is None:
            raise RuntimeError("the tiered cache of this decode step is gone")
        return tiered

    def prepare(self) -> None:
        """Capture both replays before the reply's first step, as the full cache's graph is captured before its
        first token (else the first steps pay two captures: ~20% of a 32-token reply at 32k on an 8B model). The
        capture's warm-up runs write the next slots, which the first step then overwrites."""
        t = self.tiered
        p = t.lower.length
        self.inputs.set(0, p, p, t.upper_base + p - t.open_start)
        self._lower_replay()
        self._upper_replay()

    def run_lower(self) -> None:
        """Layers [0, split) for the token in `inputs`: its K/V into `lower`, h and query_w filled."""
        self._lower_replay()()

    def run_upper(self) -> tuple[Tensor, list[Tensor]]:
        """Layers [split, L) and the head over `upper`: logits [1, V] and the upper layers' queries."""
        return self._upper_replay()()

    def _lower_replay(self) -> Replay:
        t = self.tiered
        t.model.reserve_rotations(t.lower.capacity)
        if not self._lower_bound.holds(t.lower.kv, t.model.rope.c_table):
            self._lower = None  # free the old graph's memory before capturing the new one
            self._lower = Replay(self._lower_step, t.model.device, self.capture)
            self._lower_bound = Bound(t.lower.kv, t.model.rope.c_table)
        return self._lower

    def _upper_replay(self) -> Replay:
        t = self.tiered
        if not self._upper_bound.holds(t.upper.kv, t.model.rope.c_table):
            self._upper = None
            self._upper = Replay(self._upper_step, t.model.device, self.capture)
            self._upper_bound = Bound(t.upper.kv, t.model.rope.c_table)
        return self._upper

    @torch.inference_mode()
    def _lower_step(self) -> None:
        m, t, queries = self.tiered.model, self.tiered, []
        h = m.run_layers(m.embed(self.inputs.token), None, t.lower, None, layers=range(t.split),
                         step=self.inputs.step(m, 0), queries=queries)
        self.h.copy_(h)
        self.query_w.copy_(queries[-1])

    @torch.inference_mode()
    def _upper_step(self) -> tuple[Tensor, list[Tensor]]:
        m, t, queries = self.tiered.model, self.tiered, []
        h = m.run_layers(self.h, None, t.upper, None, layers=range(t.split, m.cfg.n_layers),
                         step=self.inputs.step(m, 1), queries=queries)
        return m.head(h), queries
