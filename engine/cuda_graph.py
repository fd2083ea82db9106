"""Decode steps replayed from a captured CUDA graph.

Eager decode launches ~25 kernels per layer from Python; for an 8B model that host work, not the GPU, sets the
speed. The step is captured once for a cache of fixed capacity and replayed per token: one launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.engine.model import DecodeStep, KVCache, Transformer


class GraphedDecode:
    def __init__(self, model: Transformer, cache: KVCache, capacity: int):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.model, self.cache = model, cache
        cache.reserve(capacity)  # the graph is bound to this storage: it must not grow while in use
        model.rope.reserve(cache.capacity)
        self.kv_storage = cache.kv
        dev = model.device
        self._token = torch.zeros(1, dtype=torch.long, device=dev)
        self._position = torch.zeros(1, dtype=torch.long, device=dev)
        # Warm-up runs really execute: point them at the last slot, which no token holds yet.
        self._slot = torch.full((1,), cache.capacity - 1, dtype=torch.long, device=dev)
        self._slots = torch.arange(cache.capacity, device=dev)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(dev).wait_stream(side)
        # thread_local: a KV writer thread may be using the GPU on its own stream while we capture.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self._logits = self._step()

    @torch.inference_mode()
    def _step(self) -> Tensor:
        m = self.model
        step = DecodeStep(self._slot, self._slots <= self._slot, m.rope.gather(self._position))
        h = m.run_layers(m.embed(self._token), None, self.cache, None, step=step)
        return m.head(h)

    def __call__(self, token: int, position: int | None = None) -> Tensor:
        """Append one token at the next slot (its position defaults to the slot) and return its logits [V]."""
        if self.cache.kv is not self.kv_storage or self.cache.length >= self.cache.capacity:
            raise RuntimeError("the KV cache outgrew the captured decode graph")
        slot = self.cache.length
        self._token.fill_(token)
        self._position.fill_(slot if position is None else position)
        self._slot.fill_(slot)
        self.graph.replay()
        self.cache.length = slot + 1
        return self._logits[-1]
