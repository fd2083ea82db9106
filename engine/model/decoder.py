"""A compact Llama/Qwen/Gemma 3 decoder in the spirit of gpt-fast's model.py, built to be driven layer by layer.

Everything the KV techniques need is a public method: run any contiguous range of layers on given hidden states,
at explicit absolute positions, attending over all or a chosen subset of the cached tokens; and the KV cache
reads out / writes back any token span for any range of layers.

Shapes (batch is always 1: one chat at a time):
    T  new tokens,  S  attended keys,  d  model width,  H / Hkv  query / KV heads,  D  head size,  L  layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvchat.engine.gguf.config import ModelConfig
from kvchat.kernels.decode_attention import decode_attention, unsupported_reason
from kvchat.kernels.gemv import gemv
from kvchat.kernels.rms_norm import add_rms_norm
from kvchat.kernels.rope_kv import rope_kv
from kvchat.kernels.round_scores import SUPPORTED_DTYPES, triton_kernel_runs_on
from kvchat.kernels.silu_mul import silu_mul


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

    def reserve(self, n_slots: int) -> None:
        """Grow (by doubling) so that slots [0, n_slots) exist; every existing slot is kept, valid or not yet
        (a restore writes spans before it sets `length`). Rings grow with the cache until they reach their full size."""
        if n_slots <= self.capacity:
            return
        if self.forked:
            raise RuntimeError(f"a forked cache cannot grow past its {self.capacity} slots (asked for {n_slots})")
        new_cap = max(n_slots, 2 * self.capacity)
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


class RMSNorm(nn.Module):
    def __init__(self, weight: Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32 even when activations are bf16/fp16, as llama.cpp does.
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class RotaryTable(nn.Module):
    """RoPE as ggml applies it, for explicit positions.

    Each rotated pair (x_a, x_b) becomes (x_a c - x_b s, x_a s + x_b c). We precompute per position C and S over the
    whole head (C = cos, S = -sin on a pair's first member and +sin on its second; 1 and 0 past rope_dim) so one
    rotation is x * C + partner(x) * S over queries and keys together: a handful of kernels, which matters in decode.
    """

    def __init__(self, cfg: ModelConfig, freq_factors: Tensor | None, device: torch.device, local: bool = False):
        super().__init__()
        half = cfg.rope_dim // 2
        # theta_i = pos * freq_scale * base^(-2i / rope_dim) / freq_factor_i, the same formula as ggml's rope.
        # `local`: Gemma 3's sliding-window layers, with their own base and no scaling.
        base, scale = (cfg.rope_base_swa, 1.0) if local else (cfg.rope_base, cfg.rope_freq_scale)
        inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.rope_dim)
        inv_freq = inv_freq * scale
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double().cpu()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("c_table", torch.empty(0, cfg.head_dim, device=device), persistent=False)
        self.register_buffer("s_table", torch.empty(0, cfg.head_dim, device=device), persistent=False)
        self.neox = cfg.rope_neox
        self.rope_dim, self.head_dim = cfg.rope_dim, cfg.head_dim

    def _grow(self, n_pos: int) -> None:
        n_pos = max(n_pos, 2 * self.c_table.shape[0], 1024)
        angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().float(), angles.sin().float()
        if self.neox:  # pairs (i, i + rope_dim/2)
            c, s = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        else:  # pairs (2i, 2i + 1)
            c, s = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
        rest = self.head_dim - self.rope_dim
        self.c_table = F.pad(c, (0, rest), value=1.0).to(self.c_table.device)
        self.s_table = F.pad(s, (0, rest), value=0.0).to(self.s_table.device)

    def reserve(self, n_pos: int) -> None:
        if n_pos > self.c_table.shape[0]:
            self._grow(n_pos)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] (best on the CPU: reading their maximum then costs no device sync) -> C, S [T, 1, D]."""
        self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        return self.gather(positions.to(self.c_table.device))

    def gather(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Like forward, for positions already on the device and within the table (no host sync: graph-safe)."""
        return self.c_table[positions][:, None, :], self.s_table[positions][:, None, :]

    def _partner(self, x: Tensor) -> Tensor:
        """For each rotated element, the other member of its pair."""
        r = self.rope_dim
        if not self.neox:
            return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        if r == self.head_dim:
            return x.roll(r // 2, dims=-1)
        return torch.cat([x[..., :r].roll(r // 2, dims=-1), x[..., r:]], dim=-1)

    def apply(self, x: Tensor, rot: tuple[Tensor, Tensor]) -> Tensor:
        """x [T, heads, D] -> rotated, computed in fp32."""
        c, s = rot
        xf = x.float()
        # mul, mul, add (not a fused multiply-add): the same roundings as ggml's x_a*cos - x_b*sin
        return (xf * c + self._partner(xf) * s).to(x.dtype)


# One (C, S) pair per rotary table of the model (one table, or Gemma 3's global and local ones); each layer takes
# its own: DecoderLayer.rope_slot.
Rotations = tuple[tuple[Tensor, Tensor], ...]


def identity(x: Tensor) -> Tensor:
    return x


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass
class LayerWeights:
    attn_norm: Tensor  # [d]
    wqkv: Tensor  # [(H + 2 Hkv) D, d]  q, k, v fused so one matmul serves all three
    bqkv: Tensor | None  # [(H + 2 Hkv) D]  qwen2 only
    wo: Tensor  # [d, H D]
    ffn_norm: Tensor  # [d]
    w_gate_up: Tensor  # [2 F, d]  gate and up fused
    w_down: Tensor  # [d, F]
    # Activation rounding before each matrix (engine.numerics): llama.cpp's CPU numerics, or identity.
    round_qkv: Callable[[Tensor], Tensor] = identity
    round_wo: Callable[[Tensor], Tensor] = identity
    round_gate_up: Callable[[Tensor], Tensor] = identity
    round_down: Callable[[Tensor], Tensor] = identity
    # Qwen 3 / Gemma 3
    q_norm: Tensor | None = None  # [D]
    k_norm: Tensor | None = None  # [D]
    post_attn_norm: Tensor | None = None  # [d]  Gemma: applied to the attention's output before the residual add
    post_ffn_norm: Tensor | None = None  # [d]
    gelu: Callable[[Tensor], Tensor] = gelu_tanh  # Gemma's gate activation (engine.numerics may round it)


def _optional_norm(weight: Tensor | None, eps: float) -> RMSNorm | None:
    return None if weight is None else RMSNorm(weight, eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: LayerWeights, rope: RotaryTable, rope_slot: int = 0, window: int = 0):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(w.attn_norm, cfg.rms_eps)
        self.ffn_norm = RMSNorm(w.ffn_norm, cfg.rms_eps)
        self.q_norm, self.k_norm = _optional_norm(w.q_norm, cfg.rms_eps), _optional_norm(w.k_norm, cfg.rms_eps)
        self.post_attn_norm = _optional_norm(w.post_attn_norm, cfg.rms_eps)
        self.post_ffn_norm = _optional_norm(w.post_ffn_norm, cfg.rms_eps)
        self.gelu = w.gelu
        self.window = window  # 0, or the keys a sliding-window layer reaches back (itself included)
        self.sparse_prefill = None  # engine.sparse_prefill.SparsePrefill: set for all layers by the Transformer
        self.wqkv = nn.Parameter(w.wqkv, requires_grad=False)
        self.bqkv = None if w.bqkv is None else nn.Parameter(w.bqkv, requires_grad=False)
        self.wo = nn.Parameter(w.wo, requires_grad=False)
        self.w_gate_up = nn.Parameter(w.w_gate_up, requires_grad=False)
        self.w_down = nn.Parameter(w.w_down, requires_grad=False)
        self.rope = rope  # shared by the layers using it, not a child module
        self.rope_slot = rope_slot  # which of the model's Rotations is this layer's
        self.round_qkv, self.round_wo = w.round_qkv, w.round_wo
        self.round_gate_up, self.round_down = w.round_gate_up, w.round_down

    def forward(self, h: Tensor, layer: int, rot: Rotations, cache: KVCache, start: int,
                attend: Tensor | None, step: "DecodeStep | None" = None, queries: list | None = None) -> Tensor:
        a = self._attention(self.attn_norm(h), layer, rot, cache, start, attend, step, queries)
        h = h + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        y = self._mlp(self.ffn_norm(h))
        return h + (y if self.post_ffn_norm is None else self.post_ffn_norm(y))

    def _mlp(self, x: Tensor) -> Tensor:
        gate, up = F.linear(self.round_gate_up(x), self.w_gate_up).chunk(2, dim=-1)
        act = self.gelu(gate) if self.cfg.gelu_ffn else F.silu(gate)
        return F.linear(self.round_down(act * up), self.w_down)

    def _attention(self, x: Tensor, layer: int, rot: Rotations, cache: KVCache, start: int,
                   attend: Tensor | None, step: "DecodeStep | None", queries: list | None = None) -> Tensor:
        q, k, v = self._qkv(x, rot)
        if queries is not None:
            queries.append(q)
        in_ring = bool(self.window) and cache.in_ring(layer)
        if step is not None:  # a decode step the kernels do not take: slot and length still live on the device
            kv = cache.layer(layer)
            slot = step.ring_slot if in_ring else step.slot
            kv[0].index_copy_(1, slot, k.transpose(0, 1))
            kv[1].index_copy_(1, slot, v.transpose(0, 1))
            if step.chosen is not None and not self.window:
                mask = _chosen_visible(cache, step, layer)[None, :, None, :]  # [1, Hkv, 1, C]
            elif in_ring:
                mask = _ring_visible(cache, step, self.window)[None, :]
            else:
                mask = _step_visible(cache, step, self.window)[None, :]
            return F.linear(self.round_wo(self._sdpa(q, kv[0], kv[1], mask, False)), self.wo)
        if in_ring:
            keys, values, mask = _ring_window_kv(cache, layer, start, k.transpose(0, 1), v.transpose(0, 1), attend,
                                                 self.window)
            return F.linear(self.round_wo(self._sdpa(q, keys, values, mask, False)), self.wo)
        cache.update(layer, start, k.transpose(0, 1), v.transpose(0, 1))
        sparse = self.sparse_prefill
        if (sparse is not None and attend is None and not self.window and cache.slot_positions is None
                and sparse.applies(x.shape[0], start + x.shape[0])):
            out = sparse.attend(q, cache.layer(layer), start, self.cfg.softmax_scale)
            if out is not None:  # None: every head fell back to dense
                return F.linear(self.round_wo(out), self.wo)
        keys, values, mask, causal = _attended_kv(cache, layer, start, x.shape[0], attend, self.window)
        return F.linear(self.round_wo(self._sdpa(q, keys, values, mask, causal)), self.wo)

    def _qkv(self, x: Tensor, rot: Rotations) -> tuple[Tensor, Tensor, Tensor]:
        """Normed hidden states x [T, d] -> q [T, H, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        cfg, n_new = self.cfg, x.shape[0]
        qkv = F.linear(self.round_qkv(x), self.wqkv, self.bqkv).view(n_new, -1, cfg.head_dim)  # [T, H+2Hkv, D]
        qk = self._head_norms(qkv[:, : cfg.n_heads + cfg.n_kv_heads])
        qk = self.rope.apply(qk, rot[self.rope_slot])  # queries and keys in one rotation
        return qk[:, : cfg.n_heads], qk[:, cfg.n_heads :], qkv[:, cfg.n_heads + cfg.n_kv_heads :]

    def _head_norms(self, qk: Tensor) -> Tensor:
        """Queries and keys [T, H + Hkv, D] -> each head RMS-normed with its own weights (Qwen 3, Gemma 3)."""
        if self.q_norm is None:
            return qk
        n = self.cfg.n_heads
        return torch.cat([self.q_norm(qk[:, :n]), self.k_norm(qk[:, n:])], dim=1)

    def queries(self, h: Tensor, rot: Rotations) -> Tensor:
        """The queries [T, H, D] this layer would form from hidden states h [T, d] entering it (KV policies score
        earlier rounds with them before deciding what the layer may attend to)."""
        return self._qkv(self.attn_norm(h), rot)[0]

    def fused_decode(self, h: Tensor, pending: Tensor | None, layer: int, cache: KVCache, step: "DecodeStep",
                     queries: list | None) -> tuple[Tensor, Tensor]:
        """One decode token through the layer with the decode kernels: (h, pending) [1, d] -> the same for the next
        layer, where h + pending is the hidden state (the residual add is left to the next norm, which does it in
        the same kernel). The norms fused with their residual adds, RoPE with the K/V write, split-KV attention
        over slots [0, step.length), SwiGLU, and the matrix products as GEMVs. ~10 kernels instead of ~26, so a
        captured step spends its time reading weights rather than between small kernels. forward()'s numbers
        within the dtype's rounding."""
        return self._fused(h, pending, lambda x: self._decode_attention(x, layer, cache, step, queries), gemv)

    def fused_prefill(self, h: Tensor, pending: Tensor | None, layer: int, rot: Rotations, cache: KVCache,
                      start: int, attend: Tensor | None, queries: list | None) -> tuple[Tensor, Tensor]:
        """forward() for T new tokens on the GPU with the norms fused with their residual adds and SwiGLU in one
        kernel, (h, pending) as in fused_decode: a third fewer kernels, which a short prefill (a message over a
        chat, a restore's recomputed rounds) spends its time queuing."""
        return self._fused(h, pending, lambda x: self._attention(x, layer, rot, cache, start, attend, None, queries),
                           F.linear)

    def _fused(self, h: Tensor, pending: Tensor | None, attention: Callable[[Tensor], Tensor],
               linear: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        h, x = add_rms_norm(h, pending, self.attn_norm.weight, self.attn_norm.eps)
        out = attention(x)
        if self.post_attn_norm is not None:
            out = self.post_attn_norm(out)
        h, x = add_rms_norm(out, h, self.ffn_norm.weight, self.ffn_norm.eps)
        gate_up = linear(self.round_gate_up(x), self.w_gate_up)
        if self.cfg.gelu_ffn:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.gelu(gate) * up
        else:
            act = silu_mul(gate_up)
        out = linear(self.round_down(act), self.w_down)
        return h, out if self.post_ffn_norm is None else self.post_ffn_norm(out)

    def _decode_attention(self, x: Tensor, layer: int, cache: KVCache, step: "DecodeStep",
                          queries: list | None) -> Tensor:
        cfg = self.cfg
        qkv = gemv(self.round_qkv(x), self.wqkv, self.bqkv)  # [1, (H + 2 Hkv) D]
        if self.q_norm is not None:
            n_qk = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
            qk = self._head_norms(qkv[:, :n_qk].view(-1, cfg.head_dim)[None]).view(1, n_qk)
            qkv = torch.cat([qk, qkv[:, n_qk:]], dim=1)
        kv = cache.layer(layer)
        in_ring = bool(self.window) and cache.in_ring(layer)
        q = rope_kv(qkv, self.rope.c_table, self.rope.s_table, step.position, kv,
                    step.ring_slot if in_ring else step.slot, cfg.n_heads, cfg.rope_dim,
                    cfg.rope_neox)  # [H, D]; K and V went into the cache
        if queries is not None:
            queries.append(q[None])
        if step.chosen is not None and not self.window:  # LoopServe: each KV head its own chosen slots
            attended = decode_attention(q, kv[0], kv[1], step.n_chosen[layer : layer + 1], slots=step.chosen[layer],
                                        scale=cfg.softmax_scale).view(1, -1)
        elif self.window and cache.slot_positions is not None:  # a window over positions in a packed cache
            attended = self._masked_decode(q, kv[0], kv[1], _step_visible(cache, step, self.window))
        elif in_ring:  # the last `window` slots, each at slot % ring_size
            attended = decode_attention(q, kv[0], kv[1], step.length, scale=cfg.softmax_scale, window=self.window,
                                        ring=cache.ring_size).view(1, -1)
        else:
            attended = decode_attention(q, kv[0], kv[1], step.length, scale=cfg.softmax_scale,
                                        window=self.window).view(1, -1)
        return gemv(self.round_wo(attended), self.wo)

    def _masked_decode(self, q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
        """One token's attention q [H, D] over keys/values [Hkv, C, D] where `visible` [C] (bool) -> [1, H * D], in
        plain matrix products (SDPA may pick a backend whose first call cannot be captured in a CUDA graph). For
        the packed upper tier's sliding-window layers, which hold few slots."""
        cfg = self.cfg
        grouped = q.view(cfg.n_kv_heads, cfg.n_rep, cfg.head_dim).float()
        scores = grouped @ keys.float().transpose(1, 2) * cfg.softmax_scale  # [Hkv, n_rep, C]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return (probs @ values.float()).to(q.dtype).reshape(1, cfg.n_heads * cfg.head_dim)

    def _sdpa(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """q [T, H, D], keys/values [Hkv, S, D], mask broadcastable to [T, S] -> [T, H * D]."""
        cfg, n_new = self.cfg, q.shape[0]
        scale = cfg.softmax_scale
        if n_new == 1 and cfg.n_rep > 1:
            # One query token: the n_rep query heads sharing a KV head become n_rep query rows of that head, so K/V
            # are never repeated and every SDPA backend applies (decode's hot path).
            grouped = q.view(cfg.n_kv_heads, cfg.n_rep, cfg.head_dim)[None]
            m = None if mask is None else mask.reshape(1, -1, 1, mask.shape[-1])  # one mask, or one per KV head
            out = F.scaled_dot_product_attention(grouped, keys[None], values[None], attn_mask=m, scale=scale)
            return out.reshape(1, cfg.n_heads * cfg.head_dim)
        args = (q.transpose(0, 1)[None], keys[None], values[None])
        if isinstance(mask, BottomRightCausal):
            out = bottom_right_causal_attention(*args, mask, scale=scale, enable_gqa=cfg.n_rep > 1)
        else:
            out = F.scaled_dot_product_attention(*args, attn_mask=mask, is_causal=causal, scale=scale,
                                                 enable_gqa=cfg.n_rep > 1)  # [1, H, T, D]
        return out[0].transpose(0, 1).reshape(n_new, cfg.n_heads * cfg.head_dim)


@dataclass(frozen=True)
class BottomRightCausal:
    """The mask of T new tokens after S - T cached ones: new token i sees every cached slot and new tokens 0..i."""

    n_new: int  # T
    n_keys: int  # S

    def materialize(self, device: torch.device) -> Tensor:
        cols = torch.arange(self.n_keys, device=device)
        rows = torch.arange(self.n_new, device=device)
        return cols[None, :] <= (self.n_keys - self.n_new + rows)[:, None]  # [T, S]


def bottom_right_causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: BottomRightCausal, *, scale: float,
                                  enable_gqa: bool) -> Tensor:
    """SDPA of q [1, H, T, D] over k/v [1, Hkv, S, D] under `mask` -> [1, H, T, D]; by flash attention, whose
    causal mask is bottom-right aligned, where it applies, else through the materialized mask.

    What torch.nn.attention.bias.causal_lower_right does, without importing it: that module pulls in torch._dynamo,
    1-5 s paid inside the first long resume of every process (the benchmark's cold runs took 5.7-7.4 s for it)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if mask.n_new == mask.n_keys:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if q.shape[-1] % 8 == 0 and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, enable_gqa)):
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.materialize(q.device), scale=scale,
                                          enable_gqa=enable_gqa)


def _attended_kv(cache: KVCache, layer: int, start: int, n_new: int, attend: Tensor | None, window: int = 0):
    """Keys/values [Hkv, S, D] for new tokens in slots [start, start+T), and how to mask them.

    Without `attend` the new tokens see every slot before them (a contiguous prefix, sliced, no copy); with it they
    see exactly the slots listed (all of which precede them) plus the new tokens causally. A sliding-window layer
    (`window` > 0) sees only the last `window` slots up to each token itself.
    """
    if window:
        return _window_kv(cache, layer, start, n_new, attend, window)
    end, kv = start + n_new, cache.layer(layer)
    if attend is None:
        keys, values = kv[0, :, :end], kv[1, :, :end]
        if n_new == 1:
            return keys, values, None, False
        if start == 0:
            return keys, values, None, True
        n_prev = start
    else:
        index = torch.cat([attend.to(cache.kv.device), torch.arange(start, end, device=cache.kv.device)])
        keys = kv[0].index_select(1, index)
        values = kv[1].index_select(1, index)
        n_prev = attend.numel()
        if n_new == 1:
            return keys, values, None, False
    if cache.kv.device.type == "cuda":
        # Run by flash attention without a [T, S] mask where it applies (a chunked prefill's later chunks, a message
        # over a long chat); a boolean mask costs a slower kernel.
        return keys, values, BottomRightCausal(n_new, n_prev + n_new), False
    return keys, values, BottomRightCausal(n_new, n_prev + n_new).materialize(cache.kv.device), False


def _step_visible(cache: KVCache, step: "DecodeStep", window: int) -> Tensor:
    """The slots [C] a decode step sees, built on the device (graph-safe): [0, length), and for a sliding-window
    layer only the last `window` positions (by slot, or by `slot_positions` in a packed cache)."""
    slots = torch.arange(cache.capacity, device=cache.kv.device)
    visible = slots < step.length
    if window:
        if cache.slot_positions is None:
            visible &= slots >= step.length - window
        else:
            visible &= cache.slot_positions > step.position - window
    return visible


def _ring_visible(cache: KVCache, step: "DecodeStep", window: int) -> Tensor:
    """The ring places [ring_size] a decode step sees in a sliding-window layer: those holding the last `window`
    slots up to its own (slot s at s % ring_size; graph-safe)."""
    back = torch.remainder(step.length - 1 - torch.arange(cache.ring_size, device=cache.ring.device),
                           cache.ring_size)  # how many slots before the token's own each place holds
    return (back < window) & (back < step.length)


def _ring_window_kv(cache: KVCache, layer: int, start: int, k: Tensor, v: Tensor, attend: Tensor | None,
                    window: int) -> tuple[Tensor, Tensor, Tensor]:
    """_window_kv for a layer kept in a ring: the earlier slots the new tokens' windows reach are gathered from the
    ring *before* k, v [Hkv, T, D] of slots [start, start + T) are written into it (a long chunk may wrap over
    them); keys/values are those slots then the new ones, with their mask [T, S]."""
    device, end = cache.ring.device, start + k.shape[1]
    first = max(0, start - window + 1)
    if attend is None:
        cols = torch.arange(first, start, device=device)
        before = cache.span(layer, first, start)  # [2, Hkv, S', D], a view of the ring where it does not wrap
        if before.shape[2] + k.shape[1] > cache.ring_size:  # the new tokens will wrap over it
            before = before.clone()
    else:
        cols = attend[(attend >= first) & (attend < start)].to(device)
        before = cache.gather(layer, cols, first, start)
    cache.update(layer, start, k, v)
    cols = torch.cat([cols, torch.arange(start, end, device=device)])
    rows = torch.arange(start, end, device=device)
    mask = (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - window)
    return torch.cat([before[0], k], dim=1), torch.cat([before[1], v], dim=1), mask


def _chosen_visible(cache: KVCache, step: "DecodeStep", layer: int) -> Tensor:
    """The slots [Hkv, C] each KV head sees under a step's per-head choice (the first n_chosen[layer] slots of
    chosen[layer]), built on the device (graph-safe)."""
    chosen = step.chosen[layer]  # [Hkv, S]
    listed = torch.arange(chosen.shape[1], device=chosen.device) < step.n_chosen[layer]
    index = torch.where(listed, chosen.long(), cache.capacity)
    visible = torch.zeros(chosen.shape[0], cache.capacity + 1, dtype=torch.bool, device=chosen.device)
    visible.scatter_(1, index, torch.ones_like(index, dtype=torch.bool))
    return visible[:, : cache.capacity]


def _window_kv(cache: KVCache, layer: int, start: int, n_new: int, attend: Tensor | None, window: int):
    """_attended_kv for a sliding-window layer: position t is visible from position p iff p - window < t <= p
    (llama.cpp's LLAMA_SWA_TYPE_STANDARD). Slots are positions except in a cache with `slot_positions` (closed
    rounds packed in any order, then the open round's tokens in order). Where slots are positions only the slots
    some new token can see are gathered, so the mask is [T, T + window - 1] at most."""
    end, kv, device = start + n_new, cache.layer(layer), cache.kv.device
    if cache.slot_positions is not None:
        if attend is not None:
            raise ValueError("a packed cache with slot positions takes no `attend`")
        cols, rows = torch.arange(end, device=device), torch.arange(start, end, device=device)
        pos = cache.slot_positions
        mask = (cols[None, :] <= rows[:, None]) & (pos[:end][None, :] > pos[start:end][:, None] - window)
        return kv[0, :, :end], kv[1, :, :end], mask, False
    first = max(0, start - window + 1)
    if attend is None:
        cols = torch.arange(first, end, device=device)
        keys, values = kv[0, :, first:end], kv[1, :, first:end]
    else:
        attend = attend.to(device)
        cols = torch.cat([attend[attend >= first], torch.arange(start, end, device=device)])
        keys, values = kv[0].index_select(1, cols), kv[1].index_select(1, cols)
    rows = torch.arange(start, end, device=device)
    mask = (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - window)
    return keys, values, mask, False


@dataclass(frozen=True)
class SplitAttend:
    """What new tokens see, by layer: every earlier slot in layers below `split`, only the `upper` slots [S] (and
    each other) from `split` up: Round Attention's lower layers keep every round, its upper layers the chosen ones."""

    split: int
    upper: Tensor

    def at(self, layer: int) -> Tensor | None:
        return None if layer < self.split else self.upper


Attend = Tensor | SplitAttend | None


def attend_at(attend: Attend, layer: int) -> Tensor | None:
    return attend.at(layer) if isinstance(attend, SplitAttend) else attend


@dataclass
class DecodeStep:
    """One decode token whose cache slot, attended length and rotation are device tensors, so the step can be
    captured once in a CUDA graph and replayed for every token (engine.cuda_graph)."""

    slot: Tensor  # [1] long: where the token's K/V go
    position: Tensor  # [1] long: its position (RoPE)
    length: Tensor  # [1] long: it attends to slots [0, length) (itself included: length = slot + 1)
    rot: Rotations  # C, S [1, 1, D] for its position, per rotary table
    # LoopServe's decode (engine.progressive_decode): per layer and KV head the slots a global layer attends to,
    # [L, Hkv, S] int32, of which the first n_chosen[layer] ([L] long) count; None: slots [0, length).
    chosen: Tensor | None = None
    n_chosen: Tensor | None = None
    # Where the token's K/V go in a cache's sliding-window rings: slot % ring_size (set by run_layers).
    ring_slot: Tensor | None = None


_KERNEL_CHECKED: dict[tuple, bool] = {}


def decode_kernel_runs(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode steps attend through kernels.decode_attention for this model; if not (a shape or device it
    does not take), the log says why, once."""
    key = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, dtype, device.type)
    if key not in _KERNEL_CHECKED:
        reason = unsupported_reason(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, dtype, device)
        if reason:
            logging.getLogger(__name__).warning("decode attention kernel unavailable (%s): decode steps use SDPA",
                                                reason)
        _KERNEL_CHECKED[key] = reason is None
    return _KERNEL_CHECKED[key]


def fused_prefill_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a prefill runs DecoderLayer.fused_prefill: on the GPU, whose launches it saves (its two kernels take
    any shape). In triton's interpreter on the CPU it would only be slow; its test asks for it there."""
    return dtype in SUPPORTED_DTYPES and device.type == "cuda" and triton_kernel_runs_on(device)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tok_embeddings: Tensor, layers: list[LayerWeights], output_norm: Tensor,
                 output: Tensor | None, freq_factors: Tensor | None,
                 round_output: Callable[[Tensor], Tensor] = identity):
        super().__init__()
        self.cfg = cfg
        device = tok_embeddings.device
        self.tok_embeddings = nn.Parameter(tok_embeddings, requires_grad=False)  # [V, d]
        self.rope = RotaryTable(cfg, freq_factors, device)
        # Gemma 3's sliding-window layers rotate with their own base: a second table, the model's Rotations[1].
        self.rope_local = RotaryTable(cfg, None, device, local=True) if cfg.rope_base_swa else None
        self.ropes = [t for t in (self.rope, self.rope_local) if t is not None]
        self.layers = nn.ModuleList(self._layer(cfg, i, w) for i, w in enumerate(layers))
        self.output_norm = RMSNorm(output_norm, cfg.rms_eps)
        # Tied models reuse the embedding matrix as the output projection.
        self.output = None if output is None else nn.Parameter(output, requires_grad=False)  # [V, d]
        self.round_output = round_output

    def _layer(self, cfg: ModelConfig, i: int, w: LayerWeights) -> DecoderLayer:
        local = bool(cfg.window(i)) and self.rope_local is not None
        return DecoderLayer(cfg, w, self.rope_local if local else self.rope, int(local), cfg.window(i))

    @property
    def sparse_prefill(self):
        """LoopServe's online sparse prefill (engine.sparse_prefill.SparsePrefill), or None: dense attention."""
        return self.layers[0].sparse_prefill

    @sparse_prefill.setter
    def sparse_prefill(self, value) -> None:
        for layer in self.layers:
            layer.sparse_prefill = value

    def rotations(self, positions: Tensor) -> Rotations:
        """positions [T] (best on the CPU: see RotaryTable.forward) -> each table's C, S [T, 1, D]."""
        return tuple(table(positions) for table in self.ropes)

    def gather_rotations(self, positions: Tensor) -> Rotations:
        """Like rotations, for positions already on the device and within the tables (graph-safe)."""
        return tuple(table.gather(positions) for table in self.ropes)

    def reserve_rotations(self, n_pos: int) -> None:
        for table in self.ropes:
            table.reserve(n_pos)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.dtype

    def new_cache(self, capacity: int = 256, layers: range | None = None, ring: bool = False) -> KVCache:
        """`ring`: sliding-window layers keep only their window (and RING_SLACK) in a ring (KVCache)."""
        return KVCache(self.cfg, self.device, self.dtype, capacity, layers, ring)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [T] -> hidden states [T, d]."""
        h = F.embedding(tokens.to(self.device), self.tok_embeddings)
        return h if self.cfg.embed_scale == 1.0 else (h.float() * self.cfg.embed_scale).to(h.dtype)

    def run_layers(self, h: Tensor, positions: Tensor | None, cache: KVCache, start: int | None,
                   layers: range | None = None, attend: Attend = None, step: DecodeStep | None = None,
                   queries: list | None = None, rot: Rotations | None = None) -> Tensor:
        """Run `layers` (default: all) on hidden states h [T, d] of tokens at `positions` [T].

        Their K/V go to slots [start, start + T) of those layers. `attend` [S] (cache slots, all before `start`)
        restricts what the new tokens see, in every layer or (SplitAttend) in the upper ones; the default is every
        slot before `start`. Does not move cache.length.
        With `step` (one token, CUDA-graph decode) positions, slot and visibility come from its device tensors.
        `queries`, if given, receives each layer's queries [T, H, D] (a tiered cache's rechecks score rounds with
        them without running the layers again). `rot`: the rotations of `positions` already on the device
        (gather_rotations), so the host never waits for the device to copy positions over.
        """
        layers = range(self.cfg.n_layers) if layers is None else layers
        if step is not None:
            rot = step.rot
            if cache.ring_size and step.ring_slot is None:
                step = dataclasses.replace(step, ring_slot=torch.remainder(step.slot, cache.ring_size))
        elif rot is None:
            cache.reserve(start + h.shape[0])
            rot = self.rotations(positions)
        else:
            cache.reserve(start + h.shape[0])
        if step is not None and decode_kernel_runs(self.cfg, h.dtype, h.device):
            pending = None
            for i in layers:
                h, pending = self.layers[i].fused_decode(h, pending, i, cache, step, queries)
            return h + pending
        if step is None and h.shape[0] and fused_prefill_runs(h.dtype, h.device):
            pending = None
            for i in layers:
                h, pending = self.layers[i].fused_prefill(h, pending, i, rot, cache, start, attend_at(attend, i),
                                                          queries)
            return h + pending
        for i in layers:
            h = self.layers[i](h, i, rot, cache, start, attend_at(attend, i), step, queries)
        return h

    def head(self, h: Tensor) -> Tensor:
        """Final norm and output projection: [T, d] -> logits [T, V] in fp32."""
        weight = self.tok_embeddings if self.output is None else self.output
        logits = F.linear(self.round_output(self.output_norm(h)), weight).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None, attend: Attend = None,
                all_logits: bool = False) -> Tensor:
        """Append `tokens` [T] to the cache and return logits [T, V] (or [1, V] for the last token only)."""
        start, n_new = cache.length, tokens.shape[0]
        if positions is None:
            positions = torch.arange(start, start + n_new)
        h = self.run_layers(self.embed(tokens), positions, cache, start, attend=attend)
        cache.length = start + n_new
        return self.head(h if all_logits else h[-1:])
