"""A compact Llama/Qwen/Gemma 3 decoder in the spirit of gpt-fast's model.py, built to be driven layer by layer.

Everything the KV techniques need is a public method: run any contiguous range of layers on given hidden states,
at explicit absolute positions, attending over all or a chosen subset of the cached tokens; and the KV cache
(engine.kv.cache) reads out / writes back any token span for any range of layers. Which cached K/V a query sees
(the masks, windows, rings and chosen subsets) is engine.model.attention's.

Shapes (batch is always 1: one chat at a time):
    T  new tokens,  S  attended keys,  d  model width,  H / Hkv  query / KV heads,  D  head size,  L  layers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import (
    Attend,
    BottomRightCausal,
    DecodeStep,
    attend_at,
    attended_kv,
    bottom_right_causal_attention,
    chosen_visible,
    ring_visible,
    ring_window_kv,
    step_visible,
)
from kvchat.kernels._triton import SUPPORTED_DTYPES, triton_kernel_runs_on
from kvchat.kernels.decode_attention import decode_attention, unsupported_reason
from kvchat.engine.model.quantized import QuantizedMatrix, linear
from kvchat.kernels.quant_dot import QuantX
from kvchat.kernels.gemv import gemv
from kvchat.kernels.rms_norm import add_rms_norm
from kvchat.kernels.rope_kv import rope_kv
from kvchat.kernels.silu_mul import silu_mul


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
    # Activation rounding before each matrix (engine.gguf.numerics): llama.cpp's CPU numerics, or identity.
    round_qkv: Callable[[Tensor], Tensor] = identity
    round_wo: Callable[[Tensor], Tensor] = identity
    round_gate_up: Callable[[Tensor], Tensor] = identity
    round_down: Callable[[Tensor], Tensor] = identity
    # Qwen 3 / Gemma 3
    q_norm: Tensor | None = None  # [D]
    k_norm: Tensor | None = None  # [D]
    post_attn_norm: Tensor | None = None  # [d]  Gemma: applied to the attention's output before the residual add
    post_ffn_norm: Tensor | None = None  # [d]
    gelu: Callable[[Tensor], Tensor] = gelu_tanh  # Gemma's gate activation (engine.gguf.numerics may round it)


def weight_attribute(weight: Tensor | QuantizedMatrix) -> nn.Parameter | QuantizedMatrix:
    """A matrix as a layer holds it: a frozen Parameter, or (kept quantized) the QuantizedMatrix itself."""
    return weight if isinstance(weight, QuantizedMatrix) else nn.Parameter(weight, requires_grad=False)


def any_gemv(x: Tensor, weight: Tensor | QuantizedMatrix, bias: Tensor | None = None, xq: QuantX | None = None
             ) -> Tensor:
    """A decode step's product over either kind of weight (kernels.gemv, or kernels.quant_dot / quant_gemv through
    the matrix; `xq`: x already quantized by the kernel that made it)."""
    return weight.linear(x, bias, xq) if isinstance(weight, QuantizedMatrix) else gemv(x, weight, bias)


def int8_input(weight: Tensor | QuantizedMatrix, rounding: Callable[[Tensor], Tensor], x_dtype: torch.dtype,
               device: torch.device) -> bool:
    """Whether a decode step's x for `weight` is best quantized by the kernel that makes it (a norm, SwiGLU): the
    matrix takes int8 x for that dtype and no input rounding (numerics="llama.cpp" on the CPU) comes between."""
    return (isinstance(weight, QuantizedMatrix) and rounding is identity
            and weight.takes_int8(x_dtype, device))


def _optional_norm(weight: Tensor | None, eps: float) -> RMSNorm | None:
    return None if weight is None else RMSNorm(weight, eps)


class QueryTap:
    """Keeps, per layer, the queries of the last `rows` tokens a prefill ran (across its chunks), and where they end:
    what a KV policy scores after a message's prefill (XKV's observation window), read from the prefill itself
    rather than by running those tokens through every layer again; and, for the same tokens, how far each layer's
    attention moves the residual stream (`attention_shares`: XKV weighs its layers by it). Decode steps do not feed
    it."""

    def __init__(self, rows: int, norms: bool = False):
        self.rows = rows
        self.measures_norms = norms  # whether `keep_norms` keeps anything (only xkv's layer_weight reads them)
        self.kept: dict[int, Tensor] = {}  # layer -> queries [<= rows, H, D]
        self.end: dict[int, int] = {}  # layer -> the position after its last kept row
        # layer -> [2, <= rows]: per row the norm of what the layer's attention adds to the residual stream (after
        # Gemma's post-attention norm) and of the stream entering the layer (`attention_shares`)
        self.norms: dict[int, Tensor] = {}
        self.norms_end: dict[int, int] = {}

    def keep(self, layer: int, start: int, q: Tensor) -> None:
        """A prefill chunk's queries q [T, H, D] at positions [start, start + T) of `layer`."""
        before = self.kept.get(layer) if self.end.get(layer) == start else None  # the chunk before this one
        rows = q[-self.rows :] if before is None else torch.cat([before, q])[-self.rows :]
        self.kept[layer], self.end[layer] = rows.detach().clone(), start + q.shape[0]

    def queries(self, layers: list[int], end: int, n: int) -> dict[int, Tensor] | None:
        """Each of `layers`' queries [n, H, D] of the tokens before position `end`, if the tap kept them all."""
        if any(self.end.get(i) != end or self.kept[i].shape[0] < n for i in layers):
            return None
        return {i: self.kept[i][-n:] for i in layers}

    def keep_norms(self, layer: int, start: int, added: Tensor, residual: Tensor) -> None:
        """A prefill chunk's attention output as added to the residual stream, added [T, d], and the stream entering
        the layer, residual [T, d], at positions [start, start + T) of `layer`: their norms per row (a tap made
        without `norms` keeps nothing: the prefill does no work for shares nobody reads)."""
        if not self.measures_norms:
            return
        rows = self.rows
        norms = torch.stack([added[-rows:].float().norm(dim=-1), residual[-rows:].float().norm(dim=-1)])  # [2, T']
        before = self.norms.get(layer) if self.norms_end.get(layer) == start else None
        kept = norms if before is None else torch.cat([before, norms], 1)
        self.norms[layer], self.norms_end[layer] = kept[:, -rows:], start + added.shape[0]

    def attention_shares(self, layers: list[int], end: int, n: int) -> Tensor | None:
        """Per layer of `layers` [len(layers)] float32, over the n tokens before position `end`: the mean norm of
        what its attention adds to the residual stream over the mean norm of the stream entering it (how much the
        layer's attention moves the model's state there); None unless the tap kept all those rows."""
        means = []
        for i in layers:
            rows, stop = self.norms.get(i), self.norms_end.get(i, -1)
            if n < 1 or stop < end or stop - rows.shape[1] > end - n:
                return None
            at = rows.shape[1] - (stop - end)  # the kept rows may go on past `end` (a window run again with the reply)
            means.append(rows[:, at - n : at].mean(1))
        means = torch.stack(means)  # [L, 2]
        return (means[:, 0] / means[:, 1].clamp_min(1e-30)).cpu()


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
        # a prefill's attention in global layers, where it is not every slot's: LoopServe's sparse prefill
        # (engine.policies.sparse_prefill.SparsePrefill) or a message reading units (engine.policies.units_prefill);
        # set for all layers by the Transformer
        self.sparse_prefill = None
        self.query_tap: QueryTap | None = None  # set for all layers by the Transformer
        self.wqkv = weight_attribute(w.wqkv)
        self.bqkv = None if w.bqkv is None else nn.Parameter(w.bqkv, requires_grad=False)
        self.wo = weight_attribute(w.wo)
        self.w_gate_up = weight_attribute(w.w_gate_up)
        self.w_down = weight_attribute(w.w_down)
        self.rope = rope  # shared by the layers using it, not a child module
        self.rope_slot = rope_slot  # which of the model's Rotations is this layer's
        self.round_qkv, self.round_wo = w.round_qkv, w.round_wo
        self.round_gate_up, self.round_down = w.round_gate_up, w.round_down

    def forward(self, h: Tensor, layer: int, rot: Rotations, cache: KVCache, start: int,
                attend: Tensor | None, step: DecodeStep | None = None, queries: list | None = None) -> Tensor:
        a = self._attention(self.attn_norm(h), layer, rot, cache, start, attend, step, queries)
        a = a if self.post_attn_norm is None else self.post_attn_norm(a)
        if step is None and self.query_tap is not None:
            self.query_tap.keep_norms(layer, start, a, h)
        h = h + a
        y = self._mlp(self.ffn_norm(h))
        return h + (y if self.post_ffn_norm is None else self.post_ffn_norm(y))

    def _mlp(self, x: Tensor) -> Tensor:
        gate, up = linear(self.round_gate_up(x), self.w_gate_up).chunk(2, dim=-1)
        act = self.gelu(gate) if self.cfg.gelu_ffn else F.silu(gate)
        return linear(self.round_down(act * up), self.w_down)

    def _attention(self, x: Tensor, layer: int, rot: Rotations, cache: KVCache, start: int,
                   attend: Tensor | None, step: DecodeStep | None, queries: list | None = None) -> Tensor:
        q, k, v = self._qkv(x, rot)
        if queries is not None:
            queries.append(q)
        if step is None and self.query_tap is not None:
            self.query_tap.keep(layer, start, q)
        in_ring = bool(self.window) and cache.in_ring(layer)
        if step is not None:  # a decode step the kernels do not take: slot and length still live on the device
            kv = cache.layer(layer)
            slot = step.ring_slot if in_ring else step.slot
            kv[0].index_copy_(1, slot, k.transpose(0, 1))
            kv[1].index_copy_(1, slot, v.transpose(0, 1))
            if step.chosen is not None and not self.window:
                mask = chosen_visible(cache, step, layer)[None, :, None, :]  # [1, Hkv, 1, C]
            elif in_ring:
                mask = ring_visible(cache, step, self.window)[None, :]
            else:
                mask = step_visible(cache, step, self.window, kv)[None, :]
            return linear(self.round_wo(self._sdpa(q, kv[0], kv[1], mask, False)), self.wo)
        if in_ring:
            keys, values, mask = ring_window_kv(cache, layer, start, k.transpose(0, 1), v.transpose(0, 1), attend,
                                                 self.window)
            return linear(self.round_wo(self._sdpa(q, keys, values, mask, False)), self.wo)
        cache.update(layer, start, k.transpose(0, 1), v.transpose(0, 1))
        sparse = self.sparse_prefill
        if (sparse is not None and attend is None and not self.window and cache.slot_positions is None
                and sparse.applies(x.shape[0], start + x.shape[0])):
            out = sparse.attend(q, cache.layer(layer), start, self.cfg.softmax_scale, layer=layer)
            if out is not None:  # None: every head fell back to dense
                return linear(self.round_wo(out), self.wo)
        keys, values, mask, causal = attended_kv(cache, layer, start, x.shape[0], attend, self.window)
        return linear(self.round_wo(self._sdpa(q, keys, values, mask, causal)), self.wo)

    def _qkv(self, x: Tensor, rot: Rotations) -> tuple[Tensor, Tensor, Tensor]:
        """Normed hidden states x [T, d] -> q [T, H, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        cfg, n_new = self.cfg, x.shape[0]
        qkv = linear(self.round_qkv(x), self.wqkv, self.bqkv).view(n_new, -1, cfg.head_dim)  # [T, H+2Hkv, D]
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

    def fused_decode(self, h: Tensor, pending: Tensor | None, layer: int, cache: KVCache, step: DecodeStep,
                     queries: list | None) -> tuple[Tensor, Tensor]:
        """One decode token through the layer with the decode kernels: (h, pending) [1, d] -> the same for the next
        layer, where h + pending is the hidden state (the residual add is left to the next norm, which does it in
        the same kernel). The norms fused with their residual adds, RoPE with the K/V write, split-KV attention
        over slots [0, step.length), SwiGLU, and the matrix products as GEMVs. ~10 kernels instead of ~26, so a
        captured step spends its time reading weights rather than between small kernels. forward()'s numbers
        within the dtype's rounding."""
        return self._fused(h, pending, lambda x, xq: self._decode_attention(x, layer, cache, step, queries, xq),
                           any_gemv, decode=True)

    def fused_prefill(self, h: Tensor, pending: Tensor | None, layer: int, rot: Rotations, cache: KVCache,
                      start: int, attend: Tensor | None, queries: list | None) -> tuple[Tensor, Tensor]:
        """forward() for T new tokens on the GPU with the norms fused with their residual adds and SwiGLU in one
        kernel, (h, pending) as in fused_decode: a third fewer kernels, which a short prefill (a message over a
        chat, a restore's recomputed rounds) spends its time queuing."""
        tap = self.query_tap
        return self._fused(h, pending, lambda x, xq: self._attention(x, layer, rot, cache, start, attend, None,
                                                                     queries),
                           linear, tap=None if tap is None else lambda a, h: tap.keep_norms(layer, start, a, h))

    def _fused(self, h: Tensor, pending: Tensor | None, attention: Callable[[Tensor, QuantX | None], Tensor],
               linear: Callable[..., Tensor], decode: bool = False,
               tap: Callable[[Tensor, Tensor], None] | None = None) -> tuple[Tensor, Tensor]:
        # A decode step's x for an int8 product (kernels.quant_dot) is quantized by the norm or SwiGLU kernel that
        # makes it: three kernels a layer fewer than quantizing each x on its own.
        def int8(weight, rounding) -> bool:
            return decode and int8_input(weight, rounding, h.dtype, h.device)

        h, x, *xq = add_rms_norm(h, pending, self.attn_norm.weight, self.attn_norm.eps,
                                 quantize=int8(self.wqkv, self.round_qkv))
        out = attention(x, xq[0] if xq else None)
        if self.post_attn_norm is not None:
            out = self.post_attn_norm(out)
        if tap is not None:  # (a prefill's: h is now the stream entering the layer, its pending add done)
            tap(out, h)
        h, x, *xq = add_rms_norm(out, h, self.ffn_norm.weight, self.ffn_norm.eps,
                                 quantize=int8(self.w_gate_up, self.round_gate_up))
        gate_up = linear(self.round_gate_up(x), self.w_gate_up, xq=xq[0] if xq else None)
        xq = []
        if self.cfg.gelu_ffn:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.gelu(gate) * up
        elif int8(self.w_down, self.round_down):
            act, *xq = silu_mul(gate_up, quantize=True)
        else:
            act = silu_mul(gate_up)
        out = linear(self.round_down(act), self.w_down, xq=xq[0] if xq else None)
        return h, out if self.post_ffn_norm is None else self.post_ffn_norm(out)

    def _decode_attention(self, x: Tensor, layer: int, cache: KVCache, step: DecodeStep,
                          queries: list | None, xq: QuantX | None = None) -> Tensor:
        cfg = self.cfg
        qkv = any_gemv(self.round_qkv(x), self.wqkv, self.bqkv, xq)  # [1, (H + 2 Hkv) D]
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
            attended = self._masked_decode(q, kv[0], kv[1], step_visible(cache, step, self.window))
        elif in_ring:  # the last `window` slots, each at slot % ring_size
            attended = decode_attention(q, kv[0], kv[1], step.length, scale=cfg.softmax_scale, window=self.window,
                                        ring=cache.ring_size).view(1, -1)
        else:
            attended = decode_attention(q, kv[0], kv[1], step.length, scale=cfg.softmax_scale,
                                        window=self.window).view(1, -1)
        return any_gemv(self.round_wo(attended), self.wo)

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
        self.tok_embeddings = weight_attribute(tok_embeddings)  # [V, d]
        self.rope = RotaryTable(cfg, freq_factors, device)
        # Gemma 3's sliding-window layers rotate with their own base: a second table, the model's Rotations[1].
        self.rope_local = RotaryTable(cfg, None, device, local=True) if cfg.rope_base_swa else None
        self.ropes = [t for t in (self.rope, self.rope_local) if t is not None]
        self.layers = nn.ModuleList(self._layer(cfg, i, w) for i, w in enumerate(layers))
        self.output_norm = RMSNorm(output_norm, cfg.rms_eps)
        # Tied models reuse the embedding matrix as the output projection.
        self.output = None if output is None else weight_attribute(output)  # [V, d]
        self.round_output = round_output

    def _layer(self, cfg: ModelConfig, i: int, w: LayerWeights) -> DecoderLayer:
        local = bool(cfg.window(i)) and self.rope_local is not None
        return DecoderLayer(cfg, w, self.rope_local if local else self.rope, int(local), cfg.window(i))

    @property
    def query_tap(self) -> "QueryTap | None":
        """What keeps a prefill's last queries per layer for a KV policy (QueryTap), or None."""
        return self.layers[0].query_tap

    @query_tap.setter
    def query_tap(self, value: "QueryTap | None") -> None:
        for layer in self.layers:
            layer.query_tap = value

    @property
    def sparse_prefill(self):
        """LoopServe's online sparse prefill (engine.policies.sparse_prefill.SparsePrefill), or None: dense
        attention."""
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
        table = self.tok_embeddings
        h = table.rows(tokens) if isinstance(table, QuantizedMatrix) else F.embedding(tokens.to(self.device), table)
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
                h, pending = self.layers[i].fused_decode(h, pending, i, cache, step.for_layer(i), queries)
            return h + pending
        if step is None and h.shape[0] and fused_prefill_runs(h.dtype, h.device):
            pending = None
            for i in layers:
                h, pending = self.layers[i].fused_prefill(h, pending, i, rot, cache, start, attend_at(attend, i),
                                                          queries)
            return h + pending
        for i in layers:
            h = self.layers[i](h, i, rot, cache, start, attend_at(attend, i), step and step.for_layer(i), queries)
        return h

    def head(self, h: Tensor) -> Tensor:
        """Final norm and output projection: [T, d] -> logits [T, V] in fp32."""
        weight = self.tok_embeddings if self.output is None else self.output
        logits = linear(self.round_output(self.output_norm(h)), weight).float()
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
