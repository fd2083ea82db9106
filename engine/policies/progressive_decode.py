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

The step is the full cache's decode step with a per-layer, per-head slot list ([L, Hkv, S], and a count per layer,
both device tensors): one CUDA graph serves the whole reply, and a new choice only rewrites the lists between
replays. The choice itself runs eagerly between replays, for all layers at once: kernels/slot_mass.py's two
passes over the keys (at 32k keys on the H100, 8B shape: 2.3–2.5 ms a choice, against ~20 ms in torch
layer by layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend, attend_at
from kvchat.engine.model.cuda_graph import Replay, StepInputs
from kvchat.engine.model.decoder import Transformer
from kvchat.kernels.slot_mass import slot_mass, triton_kernel_runs_on


class ProgressiveDecode:
    def __init__(self, model: Transformer, cache: KVCache, prompt_start: int, capacity: int, budget: int = 1024,
                 interval: int = 16, warmup: int = 16, attend: Attend = None, capture: bool | None = None,
                 pool: int = 1):
        if budget < 1 or interval < 1 or warmup < 1 or pool < 1:
            raise ValueError("budget, interval, warmup and pool must be at least 1")
        cfg = model.cfg
        self.model, self.cache = model, cache
        self.budget, self.interval, self.warmup, self.pool = budget, interval, warmup, pool
        cache.reserve(capacity)
        model.reserve_rotations(cache.capacity)
        self.first = cache.length  # the reply's first slot: the input is slots [0, first)
        self.end = capacity  # slots the reply may fill: [first, end)
        device = model.device
        self.layers = [i for i in range(cfg.n_layers) if not model.layers[i].window]
        self._groups = self._layer_groups(cfg.n_kv_heads * cfg.n_rep * interval * self.end * 4)
        self.candidates = self._candidates(attend, prompt_start)  # [L, first] bool
        self.n_candidates = self.candidates.sum(1).tolist()
        self._every_slot = all(n == self.first for n in self.n_candidates)  # no view restricts any layer
        n_input = max(self.n_candidates) if self.first else 0
        width = max(n_input, 1) + (self.end - self.first)
        self.chosen = torch.zeros(cfg.n_layers, cfg.n_kv_heads, width, dtype=torch.int32, device=device)
        self.base = torch.zeros(cfg.n_layers, dtype=torch.long, device=device)  # input slots listed per layer
        self.first_slot = torch.tensor([self.first], dtype=torch.long, device=device)
        self.reply_slots = torch.arange(self.first, self.end, dtype=torch.int32, device=device)
        self._list_everything()
        self.queries = torch.zeros(interval, cfg.n_layers, cfg.n_heads, cfg.head_dim, dtype=model.dtype,
                                   device=device)  # a ring of the last `interval` tokens' queries
        self.n_out = 0
        self.selections = 0
        self.inputs = StepInputs(device)
        # Warm-up runs really execute: point them at the reply's last slot, which no token holds yet.
        self.inputs.set(0, self.end - 1, self.end - 1)
        with cache.keeping_slot(self.end - 1):
            self._replay = Replay(self._step, device, device.type == "cuda" if capture is None else capture)

    def _candidates(self, attend: Attend, prompt_start: int) -> Tensor:
        """[L, first] bool: the input slots each layer's decode may attend to (the prompt's view of the history,
        and the prompt itself)."""
        n_layers, device = self.model.cfg.n_layers, self.model.device
        out = torch.zeros(n_layers, self.first, dtype=torch.bool, device=device)
        for layer in range(n_layers):
            seen = attend_at(attend, layer)
            if seen is None:
                out[layer] = True
            else:
                out[layer, seen.to(device, torch.long)] = True
                out[layer, prompt_start:] = True
        return out

    def _list_everything(self) -> None:
        """Every candidate slot in every layer's list (the warm-up tokens see what the prompt saw)."""
        for layer in range(self.model.cfg.n_layers):
            slots = self.candidates[layer].nonzero().flatten().to(torch.int32)
            self._write(layer, slots.expand(self.chosen.shape[1], -1))

    def _write(self, layer: int, slots: Tensor) -> None:
        """Layer's lists: `slots` [Hkv, n] of the input, then the reply's slots."""
        n = slots.shape[1]
        self.chosen[layer, :, :n] = slots
        self.chosen[layer, :, n : n + self.reply_slots.numel()] = self.reply_slots
        self.base[layer] = n

    @torch.inference_mode()
    def _step(self) -> tuple[Tensor, Tensor]:
        m = self.model
        step = self.inputs.step(m)
        step.chosen = self.chosen
        step.n_chosen = self.base + (step.slot - self.first_slot + 1)  # the input's chosen, and the reply so far
        queries: list[Tensor] = []
        h = m.run_layers(m.embed(self.inputs.token), None, self.cache, None, step=step, queries=queries)
        return m.head(h), torch.stack([q.reshape(m.cfg.n_heads, m.cfg.head_dim) for q in queries])

    def __call__(self, token: int) -> Tensor:
        """Append one token at the next slot and return its logits [V]; choose again when due."""
        slot = self.cache.length
        if slot >= self.end:
            raise RuntimeError("the reply outgrew its progressive decode step")
        self.inputs.set(token, slot, slot)
        logits, queries = self._replay()
        self.queries[self.n_out % self.interval].copy_(queries)
        self.cache.length = slot + 1
        self.n_out += 1
        if self.n_out >= self.warmup and (self.n_out - self.warmup) % self.interval == 0:
            self.select()
        return logits[-1]

    # Without the Triton kernel (kernels/slot_mass.py) the scores are materialized: the float32 scores of one group
    # of layers stay under this (the softmax doubles it for a moment).
    SCORE_BYTES = 256 << 20

    def _layer_groups(self, bytes_per_layer: int) -> list[tuple[list[int], Tensor]]:
        """`self.layers` cut into groups whose keys the cache holds side by side (one view each), and without the
        kernel small enough for SCORE_BYTES: (layers, the same as a device index)."""
        device = self.model.device
        most = len(self.layers) if triton_kernel_runs_on(device) else self.SCORE_BYTES // max(bytes_per_layer, 1)
        groups: list[list[int]] = []
        for layer in self.layers:
            if groups and len(groups[-1]) < most and self.cache.keys_of(groups[-1] + [layer], 1) is not None:
                groups[-1].append(layer)
            else:
                groups.append([layer])
        return [(g, torch.tensor(g, device=device)) for g in groups]

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
            candidates = None if self._every_slot else self.candidates[at]  # [G, first]: what each layer sees
            keys = self.cache.keys_of(layers, end)  # [G, Hkv, end, D], a view in the cache's dtype
            mass = slot_mass(window[at], keys, first, candidates, cfg.softmax_scale)
            if self.pool > 1:
                pooled = F.max_pool1d(mass.flatten(0, 1)[:, None], self.pool, stride=1, padding=self.pool // 2)
                mass = pooled[:, 0, :first].view(g, cfg.n_kv_heads, first)
            if candidates is not None:
                mass = mass.masked_fill(~candidates[:, None], -1.0)
            n_keep = [min(self.budget, self.n_candidates[layer]) for layer in layers]
            top = mass.topk(max(n_keep), dim=2).indices.to(torch.int32)  # [G, Hkv, k], largest first
            if len(set(n_keep)) == 1:
                self._write_group(at, top)
            else:
                for j, layer in enumerate(layers):
                    self._write(layer, top[j, :, : n_keep[j]])
        self.selections += 1

    def _write_group(self, at: Tensor, slots: Tensor) -> None:
        """`_write` for the layers `at` at once: `slots` [G, Hkv, n]."""
        n = slots.shape[2]
        self.chosen[at, :, :n] = slots
        self.chosen[at, :, n : n + self.reply_slots.numel()] = self.reply_slots
        self.base[at] = n
