"""A decode step over per-layer, per-KV-head lists of input slots: the step LoopServe's progressive selection
(engine.policies.progressive_decode) and the layer-budget policies (XKV, uniform, pyramid: engine.policies.budgets)
both run.

The lists are device tensors ([L, Hkv, S] int32, and a count of input slots per layer [L] long): one CUDA graph
serves the whole reply, and a new choice only rewrites the lists between replays. Every token of the reply so far
is listed after the input's chosen slots, so a reply always reads all of itself. Sliding-window layers (Gemma 3)
keep their window: they already read only `window` keys, and the decoder ignores lists for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend, attend_at
from kvchat.engine.model.cuda_graph import Replay, StepInputs
from kvchat.engine.model.decoder import Transformer


class SlotListDecode:
    """Decode after a prompt (slots [prompt_start, cache.length)) prefilled under `attend`, for a reply up to slot
    `capacity`, each global layer reading the input slots its lists name. Listed at first: every input slot the
    prompt saw (`candidates`). With `keep_queries`, each step's queries [L, H, D] are kept in a ring of that many
    tokens (`self.queries`), for a selection that looks at the reply's recent tokens."""

    def __init__(self, model: Transformer, cache: KVCache, prompt_start: int, capacity: int, attend: Attend = None,
                 capture: bool | None = None, keep_queries: int = 0):
        cfg = model.cfg
        self.model, self.cache = model, cache
        cache.reserve(capacity)
        model.reserve_rotations(cache.capacity)
        self.first = cache.length  # the reply's first slot: the input is slots [0, first)
        self.end = capacity  # slots the reply may fill: [first, end)
        device = model.device
        self.layers = [i for i in range(cfg.n_layers) if not model.layers[i].window]
        self.candidates = self._candidates(attend, prompt_start)  # [L, first] bool
        self.n_candidates = self.candidates.sum(1).tolist()
        self.every_slot = all(n == self.first for n in self.n_candidates)  # no view restricts any layer
        n_input = max(self.n_candidates) if self.first else 0
        width = max(n_input, 1) + (self.end - self.first)
        self.chosen = torch.zeros(cfg.n_layers, cfg.n_kv_heads, width, dtype=torch.int32, device=device)
        self.base = torch.zeros(cfg.n_layers, dtype=torch.long, device=device)  # input slots listed per layer
        self.first_slot = torch.tensor([self.first], dtype=torch.long, device=device)
        self.reply_slots = torch.arange(self.first, self.end, dtype=torch.int32, device=device)
        self.list_everything()
        self.keep_queries = keep_queries
        self.queries = torch.zeros(keep_queries, cfg.n_layers, cfg.n_heads, cfg.head_dim, dtype=model.dtype,
                                   device=device) if keep_queries else None  # a ring of the last tokens' queries
        self.n_out = 0
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

    def list_everything(self) -> None:
        """Every candidate slot in every layer's list (what the prompt saw)."""
        if self.every_slot:  # no view restricts a layer: every input slot, all layers at once (no wait a layer)
            cfg, device = self.model.cfg, self.chosen.device
            every = torch.arange(self.first, dtype=torch.int32, device=device)
            self.write_group(torch.arange(cfg.n_layers, device=device), every.expand(cfg.n_layers, cfg.n_kv_heads, -1))
            return
        for layer in range(self.model.cfg.n_layers):
            slots = self.candidates[layer].nonzero().flatten().to(torch.int32)
            self.write(layer, slots.expand(self.chosen.shape[1], -1))

    def write(self, layer: int, slots: Tensor) -> None:
        """Layer's lists: `slots` [Hkv, n] of the input, then the reply's slots."""
        n = slots.shape[1]
        self.chosen[layer, :, :n] = slots
        self.chosen[layer, :, n : n + self.reply_slots.numel()] = self.reply_slots
        self.base[layer] = n

    def write_group(self, at: Tensor, slots: Tensor) -> None:
        """`write` for the layers `at` at once: `slots` [G, Hkv, n]."""
        n = slots.shape[2]
        self.chosen[at, :, :n] = slots
        self.chosen[at, :, n : n + self.reply_slots.numel()] = self.reply_slots
        self.base[at] = n

    @torch.inference_mode()
    def _step(self) -> tuple[Tensor, Tensor | None]:
        m = self.model
        step = self.inputs.step(m)
        step.chosen = self.chosen
        step.n_chosen = self.base + (step.slot - self.first_slot + 1)  # the input's chosen, and the reply so far
        queries = self.query_list()
        h = m.run_layers(m.embed(self.inputs.token), None, self.cache, None, step=step, queries=queries)
        if queries is None:
            return m.head(h), None
        stacked = torch.stack([q.reshape(m.cfg.n_heads, m.cfg.head_dim) for q in queries])  # [L, H, D]
        self.watch(stacked)
        return m.head(h), stacked if self.keep_queries else None

    watches_queries = False  # whether `watch` sees each step's queries

    def query_list(self) -> list | None:
        """What the step's layers append their queries [1, H, D] to, in layer order (each just before its
        attention reads the lists), or None where nothing looks at them."""
        return [] if self.keep_queries or self.watches_queries else None

    def watch(self, queries: Tensor) -> None:
        """Inside the step (in its CUDA graph, so device work alone): the token's queries [L, H, D], where
        `watches_queries`; nothing by default."""

    def __call__(self, token: int) -> Tensor:
        """Append one token at the next slot and return its logits [V]."""
        slot = self.cache.length
        if slot >= self.end:
            raise RuntimeError("the reply outgrew its decode step")
        self.before_token()
        self.inputs.set(token, slot, slot)
        logits, queries = self._replay()
        if queries is not None:
            self.queries[self.n_out % self.keep_queries].copy_(queries)
        self.cache.length = slot + 1
        self.n_out += 1
        self.after_token()
        return logits[-1]

    def before_token(self) -> None:
        """Called before each token's step (a choice the previous token made due runs here); nothing by default."""

    def after_token(self) -> None:
        """Called after each token (a selection that is due runs here); nothing by default."""
