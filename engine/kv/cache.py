"""The model's KV cache: K and V of a range of layers on the device, in slots, with Gemma 3's sliding-window layers
optionally kept in rings of their own.

It is one of the caches behind engine.kv.base.KVStore (generation runs a prompt into it and decodes over it through
`prefill_prompt` and `decode_step`) and the DeviceKV the decoder's layers read and write (engine.model.decoder,
engine.model.attention). Tiered KV (engine.kv.tiered) keeps its two tiers in two of them.

Shapes: L layers, Hkv KV heads, D head size, T new tokens; slots [0, capacity).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.model.attention import Attend, with_own_slots

if TYPE_CHECKING:
    from kvchat.engine.model.decoder import Transformer


# Positions a sliding-window layer's ring keeps beyond its window: a retracted round or a regenerated reply of up to
# this many tokens leaves every K/V the window then reads in the ring (further back, a chat is restored again).
RING_SLACK = 2048


class KVCache(nn.Module):
    """K and V of a range of layers (default: all); K is stored after RoPE, as llama.cpp does.

    Slots are storage places, not positions: the positions used for RoPE are whatever the caller passed when the
    token was computed, so a restored or reordered chat keeps its original positions. Layer numbers are the model's
    (a cache of layers [3, 8) is written and read as layers 3..7), so tiered KV can keep each layer group apart.

    Every layer's K/V is one tensor `kv` [layers, 2, Hkv, capacity, D], except with `ring=True` on a model with
    sliding-window layers (Gemma 3): those never read K/V older than their window again, so they keep only the last
    `ring_size` slots in a ring of their own (`ring` [window layers, 2, Hkv, ring_size, D], slot s at s % ring_size)
    and `kv` holds the global layers alone. A ring cache's slots are its positions. `layer`, `read`, `write`,
    `update` and `span` work for either kind; reading a ring slot it no longer holds gives zeros (`read`) or an
    error (`span`).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, capacity: int = 256,
                 layers: range | None = None, ring: bool = False):
        super().__init__()
        self.cfg = cfg
        self.layers = range(cfg.n_layers) if layers is None else layers
        if self.layers.step != 1 or not 0 <= self.layers.start < self.layers.stop <= cfg.n_layers:
            raise ValueError(f"layers {self.layers} outside [0, {cfg.n_layers})")
        self.length = 0  # slots [0, length) hold valid K/V
        windowed = [i for i in self.layers if ring and cfg.window(i)]
        full = [i for i in self.layers if i not in windowed]
        # model layer -> (in the ring?, index in its tensor)
        self._where = {i: (False, n) for n, i in enumerate(full)} | {i: (True, n) for n, i in enumerate(windowed)}
        self.register_buffer(
            "kv", torch.zeros(len(full), 2, cfg.n_kv_heads, capacity, cfg.head_dim, device=device, dtype=dtype),
            persistent=False,
        )
        # A ring grows with the cache up to its full size (while it is shorter, no slot has wrapped: slot s is at s)
        self.ring_limit = cfg.sliding_window + RING_SLACK if windowed else 0
        self.ring = torch.zeros(len(windowed), 2, cfg.n_kv_heads, min(self.ring_limit, capacity), cfg.head_dim,
                                device=device, dtype=dtype)
        # Per ring layer, the slots it holds: [lo, hi), hi read as at least `length` (decode steps write slot
        # `length` from inside a graph, then the caller moves `length`).
        self._ring_lo = [0] * len(windowed)
        self._ring_hi = [0] * len(windowed)
        # Each slot's position, where slots are not positions (Round Attention's packed upper tier) and the model
        # has sliding-window layers, whose windows are over positions; None: slot s holds position s.
        self.slot_positions: Tensor | None = None
        self.forked = False
        # Retrieval units of closed rounds' slots, by the round's (start, end) (engine.kv.units; LouisKV): built once,
        # or stored with the chat and handed in by a restore, and read by every later message. An index of the K/V,
        # so a truncation drops those of rounds it cuts.
        self.units: dict[tuple[int, int], object] = {}

    def track_positions(self) -> None:
        """Keep `slot_positions` (its owner fills it as it places tokens); it grows with the cache."""
        if self.ring_size:
            raise ValueError("a ring cache's slots are its positions")
        self.slot_positions = torch.zeros(self.capacity, dtype=torch.long, device=self.kv.device)

    def layer(self, layer: int) -> Tensor:
        """K and V of one model layer: [2, Hkv, capacity, D] (a view); a ring layer's ring [2, Hkv, ring_size, D]."""
        in_ring, n = self._where[layer]
        return self.ring[n] if in_ring else self.kv[n]

    def in_ring(self, layer: int) -> bool:
        return self._where[layer][0]

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def ring_size(self) -> int:
        """Places in each ring (slot s at s % ring_size); 0 without rings."""
        return self.ring.shape[3]

    def reserve(self, n_slots: int, exact: bool = False) -> None:
        """Grow (by doubling; with `exact`, to n_slots: a send that knows what it needs, within a GPU memory plan)
        so that slots [0, n_slots) exist; every existing slot is kept, valid or not yet (a restore writes spans
        before it sets `length`). Rings grow with the cache until they reach their full size."""
        if n_slots <= self.capacity:
            return
        if self.forked:
            raise RuntimeError(f"a forked cache cannot grow past its {self.capacity} slots (asked for {n_slots})")
        new_cap = n_slots if exact else max(n_slots, 2 * self.capacity)
        grown = self.kv.new_zeros(*self.kv.shape[:3], new_cap, self.kv.shape[4])
        grown[:, :, :, : self.capacity] = self.kv
        if self.slot_positions is not None:
            grown_positions = self.slot_positions.new_zeros(new_cap)
            grown_positions[: self.capacity] = self.slot_positions
            self.slot_positions = grown_positions
        self.kv = grown
        if self.ring.shape[0] and self.ring_size < self.ring_limit:
            ring = self.ring.new_zeros(*self.ring.shape[:3], min(self.ring_limit, new_cap), self.ring.shape[4])
            ring[:, :, :, : self.ring_size] = self.ring
            self.ring = ring

    def reallocate(self, n_slots: int) -> None:
        """Let every slot's contents go and hold exactly `n_slots` empty ones, the old storage released before the new
        is allocated, so the two are never on the device side by side as when `reserve` grows the cache. For an owner
        that can put back what it needs from elsewhere (the tiered cache's upper tier, whose rounds also live in host
        memory). Not for a ring cache, whose slots are its positions."""
        if self.ring.shape[0]:
            raise ValueError("a ring cache cannot be reallocated (its slots are its positions)")
        if self.forked:
            raise RuntimeError("a forked cache cannot be reallocated")
        shape, positions = (*self.kv.shape[:3], n_slots, self.kv.shape[4]), self.slot_positions is not None
        device, dtype = self.kv.device, self.kv.dtype
        self.kv = self.slot_positions = None  # the last references: freed (to the allocator) here
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        if positions:
            self.slot_positions = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.length = 0
        self.units = {}

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """k, v: [Hkv, T, D] written to slots [start, start + T) of one layer."""
        in_ring, n = self._where[layer]
        if in_ring:
            self._ring_write(n, start, torch.stack([k, v]))
            return
        end = start + k.shape[1]
        kv = self.kv[n]
        kv[0, :, start:end] = k
        kv[1, :, start:end] = v

    def read(self, layers: range, start: int, end: int) -> Tensor:
        """A copy of the K/V of slots [start, end) for `layers`: [len(layers), 2, Hkv, end - start, D] (zeros
        where a ring no longer holds the slot)."""
        self._check_span(layers, start, end)
        if not self.ring_size:
            first = layers.start - self.layers.start
            return self.kv[first : first + len(layers), :, :, start:end].clone()
        out = self.kv.new_empty(len(layers), 2, self.kv.shape[2], end - start, self.kv.shape[4])
        for j, layer in enumerate(layers):
            in_ring, n = self._where[layer]
            out[j] = self._ring_read(n, start, end) if in_ring else self.kv[n, :, :, start:end]
        return out

    def write(self, layers: range, start: int, kv: Tensor) -> None:
        """Write back K/V as returned by `read` (any device/dtype) into slots starting at `start`."""
        end = start + kv.shape[3]
        if kv.shape[0] != len(layers):
            raise ValueError(f"K/V for {kv.shape[0]} layers cannot fill {layers}")
        self._check_span(layers, start, start)
        self.reserve(end)
        kv = kv.to(self.kv.device, self.kv.dtype)
        if not self.ring_size:
            first = layers.start - self.layers.start
            self.kv[first : first + len(layers), :, :, start:end] = kv
            return
        for j, layer in enumerate(layers):
            in_ring, n = self._where[layer]
            if in_ring:
                self._ring_write(n, start, kv[j])
            else:
                self.kv[n, :, :, start:end] = kv[j]

    def write_rows(self, layer: int, heads: Tensor, slots: Tensor, kv: Tensor) -> None:
        """K/V [2, R, D] of single rows, row i into KV head heads[i] at slot slots[i], of one layer outside the
        rings (a lazy resume bringing in the units each head chose)."""
        in_ring, n = self._where[layer]
        if in_ring:
            raise ValueError(f"layer {layer} is a ring: its slots are its positions, not rows to write one by one")
        device = self.kv.device
        self.kv[n][:, heads.to(device), slots.to(device)] = kv.to(device, self.kv.dtype)

    def span(self, layer: int, start: int, end: int) -> Tensor:
        """K/V [2, Hkv, end - start, D] of slots [start, end) of one layer, to attend to: a view (or, where a ring
        wraps, a copy); a ring must still hold every one of them."""
        in_ring, n = self._where[layer]
        if not in_ring:
            return self.kv[n, :, :, start:end]
        self._check_reach(layer, start, end)
        parts = [self.ring[n, :, :, places] for places, _ in self._ring_places(start, end)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def keys_of(self, layers: list[int], end: int) -> Tensor | None:
        """K of slots [0, end) of several model layers as one view [len(layers), Hkv, end, D], where the cache
        holds them side by side in `kv` (outside the rings, in adjacent places); None where it does not."""
        places = [self._where[layer] for layer in layers]
        n0 = places[0][1]
        if any(in_ring or n != n0 + j for j, (in_ring, n) in enumerate(places)):
            return None
        return self.kv[n0 : n0 + len(layers), 0, :, :end]

    def gather(self, layer: int, slots: Tensor, lowest: int, end: int) -> Tensor:
        """K/V [2, Hkv, len(slots), D] of the listed slots (on the cache's device, all in [lowest, end): the
        caller knows the bounds, so no device sync is needed to check them) of one layer."""
        in_ring, n = self._where[layer]
        if not in_ring:
            return self.kv[n].index_select(2, slots)
        self._check_reach(layer, lowest, end)
        return self.ring[n].index_select(2, torch.remainder(slots, self.ring_size))

    def _check_reach(self, layer: int, start: int, end: int) -> None:
        lo, hi = self._ring_reach(self._where[layer][1])
        if start < end and (start < lo or end > hi):
            raise RuntimeError(f"layer {layer}'s ring holds slots [{lo}, {hi}), not all of [{start}, {end})")

    def _ring_places(self, start: int, end: int) -> list[tuple[slice, slice]]:
        """(ring places, offsets into [start, end)) of slots [start, end), at most ring_size of them: one run, or
        two where the ring wraps."""
        first, n = start % self.ring_size, end - start
        if first + n <= self.ring_size:
            return [(slice(first, first + n), slice(0, n))]
        k = self.ring_size - first
        return [(slice(first, self.ring_size), slice(0, k)), (slice(0, n - k), slice(k, n))]

    def truncate(self, length: int) -> None:
        self.units = {span: u for span, u in self.units.items() if span[1] <= length}
        for n in range(len(self._ring_lo)):
            self._ring_lo[n], self._ring_hi[n] = self._ring_reach(n)
            self._ring_hi[n] = min(self._ring_hi[n], length)
        self.length = min(self.length, length)

    def holds_window(self, end: int) -> bool:
        """Whether a chat cut back to `end` tokens still has in its rings every K/V its next token's windows read
        (always, without rings)."""
        first = max(0, end - self.cfg.sliding_window + 1)
        return all(self._ring_reach(n)[0] <= first for n in range(len(self._ring_lo)))

    def fork_ring(self) -> "KVCache":
        """A cache that shares this one's global layers (the same tensor, not a copy) and has an empty ring of its
        own: the restore's recompute stream writes its windows there while the loads fill this one's ring, and
        `join_ring` brings in what this ring should hold."""
        fork = KVCache.__new__(KVCache)
        nn.Module.__init__(fork)
        fork.cfg, fork.layers, fork.length, fork._where = self.cfg, self.layers, self.length, self._where
        fork.register_buffer("kv", self.kv, persistent=False)
        fork.ring_limit, fork.ring = self.ring_limit, torch.zeros_like(self.ring)
        fork._ring_lo, fork._ring_hi = [0] * len(self._ring_lo), [0] * len(self._ring_hi)
        fork.slot_positions = None
        fork.forked = True  # growing would part the two caches' global layers
        return fork

    def join_ring(self, fork: "KVCache") -> None:
        """Take from a fork's ring every slot it holds that this ring should hold (the later slots win)."""
        for n in range(len(self._ring_lo)):
            f_lo, f_hi = fork._ring_reach(n)
            lo, hi = self._ring_reach(n)
            hi = max(hi, f_hi)
            lo = max(lo, hi - self.ring_size)
            if max(f_lo, lo) < f_hi:
                for places, _ in self._ring_places(max(f_lo, lo), f_hi):
                    self.ring[n, :, :, places] = fork.ring[n, :, :, places]
            self._ring_lo[n], self._ring_hi[n] = lo, hi

    @contextlib.contextmanager
    def keeping_slot(self, slot: int):
        """Around a graph capture's warm-up runs, which really write K/V at `slot` (one no token holds yet): in a
        ring that place may hold a live slot's K/V, put back afterwards."""
        if not self.ring_size:
            yield
            return
        place = slot % self.ring_size
        # In inference mode: a restore makes its cache there, while generate may build its step outside it.
        with torch.inference_mode():
            saved = self.ring[:, :, :, place].clone()
        try:
            yield
        finally:
            with torch.inference_mode():
                self.ring[:, :, :, place] = saved

    def nbytes(self) -> int:
        """Bytes of the valid slots' K/V (in a ring, of the slots it holds)."""
        ring_slots = sum(hi - lo for lo, hi in map(self._ring_reach, range(len(self._ring_lo))))
        per_layer_slot = self.kv[0, :, :, 0].numel() * self.kv.element_size() if self.kv.shape[0] else 0
        ring_slot = self.ring[0, :, :, 0].numel() * self.ring.element_size() if self.ring.shape[0] else 0
        return self.length * self.kv.shape[0] * per_layer_slot + ring_slots * ring_slot

    def slot_bytes(self) -> int:
        """Bytes of one slot of every layer."""
        return (self.kv.shape[0] + self.ring.shape[0]) * self.kv.shape[2] * 2 * self.kv.shape[4] * \
            self.kv.element_size()

    def device_bytes(self) -> int:
        """Bytes the cache takes on its device."""
        return self.kv.numel() * self.kv.element_size() + self.ring.numel() * self.ring.element_size()

    def storage(self) -> tuple[Tensor, Tensor]:
        """The tensors a captured decode graph reads and writes by address (`kv`, `ring`): growing the cache
        replaces them, and the graph must then be captured again."""
        return self.kv, self.ring

    # ---- KVStore: how generation drives this cache (engine.kv.base) ----

    @torch.inference_mode()
    def prefill_prompt(self, model: Transformer, tokens: list[int], attend: Attend = None,
                       chunk: int = 4096) -> Tensor:
        """Append tokens in chunks (bounded activation memory) and return the last token's logits [V]. `attend`
        restricts what the tokens see of the cache as it was before them (they always see each other)."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        ids = torch.tensor(tokens, dtype=torch.long)
        first, logits = self.length, None
        for i in range(0, len(tokens), chunk):
            logits = model(ids[i : i + chunk], self, attend=with_own_slots(attend, first, self.length))
        return logits[-1]

    def decode_step(self, model: Transformer, max_tokens: int, limit: int, *, attend: Attend = None,
                    first: int = 0, cuda_graph: bool | None = None, policy=None) -> Callable[[int], Tensor]:
        """The decode step (token -> logits [V]) for up to `max_tokens` tokens within `limit`: a policy's own
        (`policy.decode_step`), the cache's plain step (graphed on CUDA: engine.model.cuda_graph), or, with `attend`
        (the view the prefill had of the cache as it was at slot `first`), eager steps that see the chosen slots
        and everything generated since."""
        if policy is not None:
            own = policy.decode_step(model, self, first, attend, min(self.length + max_tokens + 1, limit), cuda_graph)
            if own is not None:
                return own
        if attend is None:
            # Here, not at the top: engine.model.cuda_graph imports the decoder, which imports this module.
            from kvchat.engine.model.cuda_graph import decoder_step

            return decoder_step(model, self, min(self.length + max_tokens + 1, limit), cuda_graph)

        def step(tok: int) -> Tensor:
            visible = with_own_slots(attend, first, self.length)
            return model(torch.tensor([tok]), self, attend=visible)[-1]

        return step

    def _ring_reach(self, n: int) -> tuple[int, int]:
        hi = max(self._ring_hi[n], self.length)
        return max(self._ring_lo[n], hi - self.ring_size), hi

    def _ring_write(self, n: int, start: int, kv: Tensor) -> None:
        """kv [2, Hkv, T, D] of slots [start, start + T) into ring layer n: the slots older than the ring then
        holds are dropped."""
        end = start + kv.shape[2]
        lo, hi = self._ring_reach(n)
        hi = max(hi, end)
        lo = max(lo, hi - self.ring_size)
        first = max(start, lo)
        if first < end:
            kv = kv[:, :, first - start :]
            for places, offsets in self._ring_places(first, end):
                self.ring[n, :, :, places] = kv[:, :, offsets]
        self._ring_lo[n], self._ring_hi[n] = lo, hi

    def _ring_read(self, n: int, start: int, end: int) -> Tensor:
        """K/V [2, Hkv, end - start, D] of slots [start, end) of ring layer n, zeros where it holds none."""
        out = self.ring.new_zeros(2, self.ring.shape[2], end - start, self.ring.shape[4])
        lo, hi = self._ring_reach(n)
        first, last = max(start, lo), min(end, hi)
        if first < last:
            for places, offsets in self._ring_places(first, last):
                out[:, :, first - start + offsets.start : first - start + offsets.stop] = self.ring[n, :, :, places]
        return out

    def _check_span(self, layers: range, start: int, end: int) -> None:
        if layers.step != 1 or not self.layers.start <= layers.start < layers.stop <= self.layers.stop:
            raise ValueError(f"layers {layers} outside the cache's {self.layers.start}..{self.layers.stop - 1}")
        if not 0 <= start <= end <= self.capacity:
            raise ValueError(f"slots [{start}, {end}) outside the cache's {self.capacity}")
