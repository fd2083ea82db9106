"""LoopServe's progressive decode-time KV selection (§5.2, Algorithm 6).

A reply's first `warmup` tokens (16, the paper's) attend to everything the prompt saw. From then on, every
`interval` tokens (n_d = 16), the queries of the last `interval` tokens choose, per layer and KV head, the `budget`
(B = 1024) slots of the input (history and prompt) that received most of their attention; decoding attends to
those and to every token of the reply so far, until the next choice. The paper's observation behind it: what the
answer's recent tokens attend to predicts what its next tokens need better than the prompt's last window does,
wherever the question sits in the message.

Adaptations, said here once:
* The choice is per KV head (the mass of the n_rep query heads sharing it, summed), because K/V are stored per KV
  head: a per-query-head choice would read each KV head's slots n_rep times.
* Sliding-window layers (Gemma 3) keep their window: they already read only `window` keys.
* Under a restricted view (a round policy's SplitAttend), a layer chooses among the slots it may see: the
  composition of Round Attention (which rounds) with LoopServe (which tokens of them).
* `pool` (7 in the policy): a slot's mass is the largest within `pool // 2` slots of it before the top-B, as
  SnapKV pools its scores, so the neighbours of a slot that draws attention are kept with it. Without it a value
  of several tokens loses its later tokens (the attention that will copy them comes only as the reply reaches
  them): on the embedded model of 2026-11-23, 11 of 95 two-question answers were lost ("Stai" for "Stella"), on
  the one shipped 2026-11-24, 26; with it, at most one (docs/benchmarks.md).

The step is engine.policies.slot_lists' (the full cache's decode step with a per-layer, per-head slot list, one CUDA
graph for the whole reply, a new choice only rewriting the lists between replays). The choice itself runs eagerly
between replays, for all layers at once: kernels/slot_mass.py's two
passes over the keys (at 32k keys on the H100, 8B shape: 2.3–2.5 ms a choice, against ~20 ms in torch
layer by layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.policies.slot_lists import SlotListDecode
from kvchat.kernels.slot_mass import slot_mass, triton_kernel_runs_on


class ProgressiveDecode(SlotListDecode):
    def __init__(self, model: Transformer, cache: KVCache, prompt_start: int, capacity: int, budget: int = 1024,
                 interval: int = 16, warmup: int = 16, attend: Attend = None, capture: bool | None = None,
                 pool: int = 1, layer_budgets: list[int] | None = None):
        if budget < 1 or interval < 1 or warmup < 1 or pool < 1:
            raise ValueError("budget, interval, warmup and pool must be at least 1")
        self.budget, self.interval, self.warmup, self.pool = budget, interval, warmup, pool
        # per layer instead of `budget` (engine.policies.budgets: XKV's budgets, chosen again as the reply goes)
        self.layer_budgets = layer_budgets
        self.selections = 0
        super().__init__(model, cache, prompt_start, capacity, attend, capture, keep_queries=interval)
        cfg = model.cfg
        self._groups = layer_groups(model, cache, self.layers,
                                    cfg.n_kv_heads * cfg.n_rep * interval * self.end * 4, self.SCORE_BYTES)

    def after_token(self) -> None:
        if self.n_out >= self.warmup and (self.n_out - self.warmup) % self.interval == 0:
            self.select()

    # Without the Triton kernel (kernels/slot_mass.py) the scores are materialized: the float32 scores of one group
    # of layers stay under this (the softmax doubles it for a moment).
    SCORE_BYTES = 256 << 20

    @torch.inference_mode()
    def select(self) -> None:
        """Per layer and KV head, the `budget` input slots the last `interval` tokens attended to most."""
        cfg = self.model.cfg
        n_win = min(self.n_out, self.interval)
        end, first = self.cache.length, self.first
        ring = [(self.n_out - n_win + i) % self.interval for i in range(n_win)]
        window = self.queries[ring].transpose(0, 1)  # [L, n_win, H, D]
        for layers, at in self._groups:
            g = len(layers)
            candidates = None if self.every_slot else self.candidates[at]  # [G, first]: what each layer sees
            keys = self.cache.keys_of(layers, end)  # [G, Hkv, end, D], a view in the cache's dtype
            mass = slot_mass(window[at], keys, first, candidates, cfg.softmax_scale)
            if self.pool > 1:
                pooled = F.max_pool1d(mass.flatten(0, 1)[:, None], self.pool, stride=1, padding=self.pool // 2)
                mass = pooled[:, 0, :first].view(g, cfg.n_kv_heads, first)
            if candidates is not None:
                mass = mass.masked_fill(~candidates[:, None], -1.0)
            n_keep = [min(self.budget if self.layer_budgets is None else self.layer_budgets[layer],
                          self.n_candidates[layer]) for layer in layers]
            top = mass.topk(max(n_keep), dim=2).indices.to(torch.int32)  # [G, Hkv, k], largest first
            if len(set(n_keep)) == 1:
                self.write_group(at, top)
            else:
                for j, layer in enumerate(layers):
                    self.write(layer, top[j, :, : n_keep[j]])
        self.selections += 1


def layer_groups(model: Transformer, cache: KVCache, layers: list[int], bytes_per_layer: int,
                 score_bytes: int) -> list[tuple[list[int], Tensor]]:
    """`layers` cut into groups whose keys the cache holds side by side (one view each), and without the Triton
    kernel small enough for `score_bytes`: (layers, the same as a device index)."""
    device = model.device
    most = len(layers) if triton_kernel_runs_on(device) else score_bytes // max(bytes_per_layer, 1)
    groups: list[list[int]] = []
    for layer in layers:
        if groups and len(groups[-1]) < most and cache.keys_of(groups[-1] + [layer], 1) is not None:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [(g, torch.tensor(g, device=device)) for g in groups]
