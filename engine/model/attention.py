"""Which K/V a query sees: the attention views of the decoder (engine.model.decoder).

A prefill's new tokens see every earlier slot, a listed subset (`attend`; SplitAttend: the chosen slots in the
upper layers only) or, in a sliding-window layer, the last `window` positions; the functions below gather those
keys/values from a KVCache (engine.kv.cache) and build their mask. A decode step (DecodeStep) carries its slot,
position and length in device tensors so that it can be captured once in a CUDA graph, and its visibility is built
on the device.

Shapes: T new tokens, S attended keys, C cache slots (capacity), H / Hkv query / KV heads, D head size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from kvchat.engine.kv.cache import KVCache
    from kvchat.engine.model.decoder import Rotations


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


def mask_left_to_attention(device: torch.device) -> bool:
    """Whether a prefill after cached tokens hands attention its causal mask as a BottomRightCausal (on CUDA, where
    flash attention needs none in memory) rather than materialized. The tests turn it on for the CPU, where
    bottom_right_causal_attention then materializes it itself."""
    return device.type == "cuda"


def attended_kv(cache: KVCache, layer: int, start: int, n_new: int, attend: Tensor | None, window: int = 0):
    """Keys/values [Hkv, S, D] for new tokens in slots [start, start+T), and how to mask them.

    Without `attend` the new tokens see every slot before them (a contiguous prefix, sliced, no copy); with it they
    see exactly the slots listed (all of which precede them) plus the new tokens causally. A sliding-window layer
    (`window` > 0) sees only the last `window` slots up to each token itself.
    """
    if window:
        return window_kv(cache, layer, start, n_new, attend, window)
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
    if mask_left_to_attention(cache.kv.device):
        # Run by flash attention without a [T, S] mask where it applies (a chunked prefill's later chunks, a message
        # over a long chat); a boolean mask costs a slower kernel.
        return keys, values, BottomRightCausal(n_new, n_prev + n_new), False
    return keys, values, BottomRightCausal(n_new, n_prev + n_new).materialize(cache.kv.device), False


def step_visible(cache: KVCache, step: DecodeStep, window: int, layer_kv: Tensor | None = None) -> Tensor:
    """The slots [C] a decode step sees, built on the device (graph-safe): [0, length), and for a sliding-window
    layer only the last `window` positions (by slot, or by `slot_positions` in a packed cache). `layer_kv`: the
    layer's K/V [2, Hkv, C, D], where its slots are not the cache's (engine.kv.working_set)."""
    slots = (torch.arange(cache.capacity, device=cache.kv.device) if layer_kv is None
             else torch.arange(layer_kv.shape[2], device=layer_kv.device))
    visible = slots < step.length
    if window:
        if cache.slot_positions is None:
            visible &= slots >= step.length - window
        else:
            visible &= cache.slot_positions > step.position - window
    return visible


def ring_visible(cache: KVCache, step: DecodeStep, window: int) -> Tensor:
    """The ring places [ring_size] a decode step sees in a sliding-window layer: those holding the last `window`
    slots up to its own (slot s at s % ring_size; graph-safe)."""
    back = torch.remainder(step.length - 1 - torch.arange(cache.ring_size, device=cache.ring.device),
                           cache.ring_size)  # how many slots before the token's own each place holds
    return (back < window) & (back < step.length)


def ring_window_kv(cache: KVCache, layer: int, start: int, k: Tensor, v: Tensor, attend: Tensor | None,
                    window: int) -> tuple[Tensor, Tensor, Tensor]:
    """window_kv for a layer kept in a ring: the earlier slots the new tokens' windows reach are gathered from the
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


def chosen_visible(cache: KVCache, step: DecodeStep, layer: int) -> Tensor:
    """The slots [Hkv, C] each KV head sees under a step's per-head choice (the first n_chosen[layer] slots of
    chosen[layer]), built on the device (graph-safe)."""
    chosen = step.chosen[layer]  # [Hkv, S]
    listed = torch.arange(chosen.shape[1], device=chosen.device) < step.n_chosen[layer]
    index = torch.where(listed, chosen.long(), cache.capacity)
    visible = torch.zeros(chosen.shape[0], cache.capacity + 1, dtype=torch.bool, device=chosen.device)
    visible.scatter_(1, index, torch.ones_like(index, dtype=torch.bool))
    return visible[:, : cache.capacity]


def window_kv(cache: KVCache, layer: int, start: int, n_new: int, attend: Tensor | None, window: int):
    """attended_kv for a sliding-window layer: position t is visible from position p iff p - window < t <= p
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
    captured once in a CUDA graph and replayed for every token (engine.model.cuda_graph)."""

    slot: Tensor  # [1] long: where the token's K/V go
    position: Tensor  # [1] long: its position (RoPE)
    length: Tensor  # [1] long: it attends to slots [0, length) (itself included: length = slot + 1)
    rot: Rotations  # C, S [1, 1, D] for its position, per rotary table
    # LoopServe's decode (engine.policies.progressive_decode): per layer and KV head the slots a global layer
    # attends to,
    # [L, Hkv, S] int32, of which the first n_chosen[layer] ([L] long) count; None: slots [0, length).
    chosen: Tensor | None = None
    n_chosen: Tensor | None = None
    # Where the token's K/V go in a cache's sliding-window rings: slot % ring_size (set by run_layers).
    ring_slot: Tensor | None = None
    # A cache whose layers keep different numbers of slots (engine.kv.working_set: each layer its own budget):
    # per layer [L] long the token's slot and attended length in that layer's own storage; run_layers hands each
    # layer its own as `slot` and `length`.
    layer_slot: Tensor | None = None
    layer_length: Tensor | None = None

    def for_layer(self, layer: int) -> "DecodeStep":
        """The step as one layer sees it: its own slot and length where the cache's layers differ."""
        if self.layer_slot is None:
            return self
        return dataclasses.replace(self, slot=self.layer_slot[layer : layer + 1],
                                   length=self.layer_length[layer : layer + 1], layer_slot=None, layer_length=None)


def with_own_slots(attend: Attend, first: int, end: int) -> Attend:
    """A restricted view of the old cache plus every slot this generation has added so far."""
    if attend is None:
        return None
    if isinstance(attend, SplitAttend):
        return SplitAttend(attend.split, with_own_slots(attend.upper, first, end))
    return torch.cat([attend.to(torch.long).cpu(), torch.arange(first, end)])
