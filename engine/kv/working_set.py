"""A reply's working set under per-layer KV budgets (XKV, issue 43): each layer's K/V in a tensor of its own that
holds only what that layer reads — the input slots its budget keeps (each KV head its own, gathered in slot order),
then room for the reply — so the device holds the sum of the layers' budgets, not every layer times the chat.

Slots are per layer. Layer i's kept input fills [0, base_i) and the reply follows: the reply's token t sits at
base_i + t in layer i and at first + t in the chat (first: the input's length). A decode step hands each layer its
own slot and attended length (DecodeStep.layer_slot / layer_length: the step's slot plus base_i − first), so one
CUDA graph serves every layer and the attention reads a contiguous run of slots, with no slot lists.
Sliding-window layers (Gemma 3) keep the last `window` input slots, which covers all they read.

The chat's full K/V is not touched: the reply's K/V go back into it when the reply ends (`WorkingSetDecode.finish`),
so the round is saved, and the next message reads, the whole chat as before.

Shapes: L layers, Hkv KV heads, D head size; per layer [2, Hkv, base_i + room, D].
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.cuda_graph import Replay, StepInputs
from kvchat.engine.model.decoder import Transformer


def window_start(window: int, first: int) -> int:
    """The first of an input's slots [0, first) a layer with this sliding window (0: none) reads again."""
    return max(0, first - window) if window else 0


class LayerWorkingSet:
    """Per layer the kept input's K/V and the reply's room (see the module docstring). Read by the decoder as a
    cache: `layer`, `in_ring`, `ring_size`, `slot_positions`."""

    ring_size = 0  # no rings: a sliding-window layer keeps its window as slots of its own
    slot_positions = None  # slots in each layer are in position order

    def __init__(self, kvs: list[Tensor], base: list[int], first: int, room: int):
        if len(kvs) != len(base) or any(kv.shape[2] != b + room for kv, b in zip(kvs, base)):
            raise ValueError("each layer's tensor holds its kept input and the reply's room")
        self.kvs, self.base, self.first, self.room = kvs, base, first, room
        device = kvs[0].device
        # Per layer, where the chat's slot s of the reply lives in that layer: s + offset
        self.offsets = torch.tensor([b - first for b in base], dtype=torch.long, device=device)

    @classmethod
    @torch.inference_mode()
    def gather(cls, cache: KVCache, kept: list[Tensor | None], windows: list[int], room: int) -> "LayerWorkingSet":
        """The working set of a full cache's input (slots [0, cache.length)): layer i keeps, per KV head, the slots
        kept[i] [Hkv, n_i] names (in that order); a layer without a list keeps its last windows[i] slots if it
        has a window, else every slot."""
        first = cache.length

        def layer_kv(i: int) -> tuple[Tensor, int]:  # a listed layer is never in a ring; a window layer's span is read
            if kept[i] is not None:
                return cache.layer(i), 0
            start = window_start(windows[i], first)
            return cache.read(range(i, i + 1), start, first)[0], start

        return cls.from_layers(layer_kv, kept, windows, first, room)

    @classmethod
    @torch.inference_mode()
    def from_layers(cls, layer_kv, kept: list[Tensor | None], windows: list[int], first: int,
                    room: int) -> "LayerWorkingSet":
        """`gather` over any source: layer_kv(i) gives layer i's K/V [2, Hkv, S, D] on the device the working set
        is to live on, and the slot its first place holds (0 for a layer with a list)."""
        kvs, base = [], []
        for i in range(len(kept)):
            src, at = layer_kv(i)
            if kept[i] is not None:
                index = kept[i].to(src.device, torch.long)  # [Hkv, n]
                chosen = torch.gather(src, 2, index[None, :, :, None].expand(2, -1, -1, src.shape[3]))
            else:
                chosen = src[:, :, window_start(windows[i], first) - at : first - at]
            n = chosen.shape[2]
            # zeros, not empty: a masked attention (SDPA off the kernels) multiplies the unread slots' V by zero
            # weights, and 0 * NaN from uninitialized memory would be NaN
            kv = chosen.new_zeros(2, chosen.shape[1], n + room, chosen.shape[3])
            kv[:, :, :n] = chosen
            kvs.append(kv)
            base.append(n)
            del src
        return cls(kvs, base, first, room)

    def layer(self, layer: int) -> Tensor:
        return self.kvs[layer]

    def in_ring(self, layer: int) -> bool:
        return False

    def device_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kvs)

    def reply_kv(self, layer: int, n: int) -> Tensor:
        """The reply's first n tokens' K/V in one layer: [2, Hkv, n, D] (a view)."""
        return self.kvs[layer][:, :, self.base[layer] : self.base[layer] + n]

    @contextlib.contextmanager
    def keeping_slot(self, slot: int):
        """Around a graph capture's warm-up runs, which write K/V at the chat's `slot` in every layer: what they
        overwrite is put back."""
        with torch.inference_mode():
            at = [slot + b - self.first for b in self.base]
            saved = [kv[:, :, s].clone() for kv, s in zip(self.kvs, at)]
        try:
            yield
        finally:
            with torch.inference_mode():
                for kv, s, old in zip(self.kvs, at, saved):
                    kv[:, :, s] = old


class WorkingSetDecode:
    """Decode a reply over a LayerWorkingSet, for the chat's slots [first, capacity): the step token -> logits [V]
    of a full cache's reply (`cache.length` moves as it would), replayed from one CUDA graph on CUDA."""

    def __init__(self, model: Transformer, cache: KVCache, working: LayerWorkingSet, capacity: int,
                 capture: bool | None = None):
        if capacity - cache.length > working.room or cache.length != working.first:
            raise ValueError("the working set has no room for this reply, or was made for another input")
        self.model, self.cache, self.working = model, cache, working
        self.first, self.end = cache.length, capacity
        model.reserve_rotations(capacity)
        device = model.device
        self.inputs = StepInputs(device)
        self.inputs.set(0, self.end - 1, self.end - 1)  # warm-up runs write the reply's last slot, which no token holds
        with working.keeping_slot(self.end - 1):
            self._replay = Replay(self._step, device, device.type == "cuda" if capture is None else capture)

    @torch.inference_mode()
    def _step(self) -> Tensor:
        m = self.model
        step = self.inputs.step(m)
        layer_slot = self.working.offsets + step.slot  # [L]: the token's slot in each layer's own storage
        step = dataclasses.replace(step, layer_slot=layer_slot, layer_length=layer_slot + 1)
        h = m.run_layers(m.embed(self.inputs.token), None, self.working, None, step=step)
        return m.head(h)

    def __call__(self, token: int) -> Tensor:
        """Append one token at the next slot and return its logits [V]."""
        slot = self.cache.length
        if slot >= self.end:
            raise RuntimeError("the reply outgrew its decode step")
        self.inputs.set(token, slot, slot)
        logits = self._replay()
        self.cache.length = slot + 1
        return logits[-1]

    @torch.inference_mode()
    def finish(self) -> None:
        """The reply's K/V so far into the chat's full cache (slots [first, cache.length)), where the round is
        saved from and the next message reads it."""
        n = self.cache.length - self.first
        if n <= 0:
            return
        for layer in range(len(self.working.kvs)):
            self.cache.write(range(layer, layer + 1), self.first, self.working.reply_kv(layer, n)[None])
