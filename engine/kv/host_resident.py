"""A chat under per-layer KV budgets whose full K/V lives in host memory (issue 43's memory target): the device holds
one layer's K/V at a time while a message is read, and the reply's working set (engine.kv.working_set) while it is
written — the budget's bytes, not the chat's.

A message's prefill streams the layers (XKV's scoring needs no mini-prefill, as the paper's does, because every
layer's K/V passes through the device anyway):

    for each layer i: stage its K/V of the chat on the device; run the message's tokens through layer i over it
    (their K/V go back to the host); for a global layer, score the message's last `window` tokens' attention over
    the staged keys (their queries are the prefill's own) and pool it;
    then the policy's global top-N chooses each layer's kept slots (LayerBudgetPolicy.choice_from_scores), and the
    working set is gathered from the host copy.

Each message chooses again over the whole chat, as on the device (nothing is evicted: what one reply leaves out a
later one may read). The reply decodes over the working set (WorkingSetDecode), whose `finish` writes its K/V back
to the host copy, from which the round is saved.

It is a KVStore (engine.kv.base) as generation drives it. Restoring and saving a chat (app.session) use the host
copy through `write` / `read` / `length` as they use a device cache's: a restore places loaded K/V in host memory
(nothing of the chat goes to the device until a message streams it), and a round that had to be recomputed, or the
end-of-turn tail a reply settles, is run through the layers the same way (`compute`, which chooses nothing).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.working_set import LayerWorkingSet, WorkingSetDecode, window_start
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import QueryTap, Transformer
from kvchat.kernels.slot_mass import slot_mass


class HostResidentKV:
    """A chat's K/V in host memory, read by a message layer by layer through the device (see the module
    docstring). `policy`: a LayerBudgetPolicy (xkv, uniform, pyramid), without `progressive`."""

    def __init__(self, model: Transformer, policy, capacity: int = 256):
        if getattr(policy, "progressive", False):
            raise ValueError("a host-resident chat decodes over a fixed working set: not with progressive=true")
        self.model, self.policy = model, policy
        self.device = model.device
        self.host = KVCache(model.cfg, torch.device("cpu"), model.dtype, capacity)
        if self.device.type == "cuda":  # pinned: the per-head copies to the device run asynchronously
            self.host.kv = self.host.kv.pin_memory()
        self.working: LayerWorkingSet | None = None  # the latest reply's
        self._kept: list[Tensor | None] = []  # per layer the slots the latest message's choice keeps
        self.peak_stage_bytes = 0  # the largest layer staged on the device by a prefill (for the benchmarks)

    @property
    def length(self) -> int:
        return self.host.length

    @length.setter
    def length(self, value: int) -> None:  # a restore that placed the chat's K/V says where it ends
        self.host.length = value

    @property
    def capacity(self) -> int:
        return self.host.capacity

    ring_size = 0  # the host copy keeps every slot of every layer (no rings: sliding-window layers stream a span)

    def reserve(self, n_slots: int, exact: bool = False) -> None:
        """Room for slots [0, n_slots) in the host copy (doubling, unless `exact`), allocated pinned where the model
        is on CUDA."""
        host = self.host
        if n_slots <= host.capacity:
            return
        if self.device.type != "cuda":
            host.reserve(n_slots, exact=exact)
            return
        old = host.kv
        grown = torch.zeros(*old.shape[:3], n_slots if exact else max(n_slots, 2 * old.shape[3]), old.shape[4],
                            dtype=old.dtype, pin_memory=True)
        grown[:, :, :, : old.shape[3]] = old
        host.kv = grown

    def truncate(self, length: int) -> None:
        self.host.truncate(length)
        self.working, self._kept = None, []  # chosen for a chat that no longer is: the next message chooses again

    def read(self, layers: range, start: int, end: int) -> Tensor:
        """A copy of the host K/V of slots [start, end) of `layers` (KVCache.read's shape; in host memory)."""
        return self.host.read(layers, start, end)

    def write(self, layers: range, start: int, kv: Tensor) -> None:
        """Write K/V as `read` returns them (on any device) into the host copy from slot `start` on."""
        self.reserve(start + kv.shape[3])
        self.host.write(layers, start, kv.to("cpu"))

    def device_bytes(self) -> int:
        """Bytes of K/V on the device between messages: the latest reply's working set."""
        return 0 if self.working is None else self.working.device_bytes()

    @torch.inference_mode()
    def prefill_prompt(self, model: Transformer, tokens: list[int], attend: Attend = None,
                       chunk: int = 4096) -> Tensor:
        """Run `tokens` (at least one) through every layer over the whole chat, one layer's K/V on the device at a
        time; the last token's logits [V]. The working set for the reply is chosen on the way (`attend` does not
        apply: the policy reads the whole chat)."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if attend is not None:
            raise ValueError("a host-resident chat's message reads the whole chat")
        cfg, end = model.cfg, self.host.length + len(tokens)
        n_win = min(self.policy.window, len(tokens), end)
        scored = self.policy.scores_needed(cfg, end, n_win)
        # the layers' attention shares, measured on the way where the policy weighs its layers (whatever tap the
        # model had is put back after)
        before, tap = model.query_tap, QueryTap(n_win, norms=True) if scored and self.policy.weighs_layers() else None
        model.query_tap = tap
        try:
            h, masses = self._stream(model, tokens, self.host.length, n_win if scored else 0, chunk)
        finally:
            model.query_tap = before
        if scored:
            shares = tap.attention_shares(cfg.global_layers, end, n_win) if tap is not None else None
            choice, kept = self.policy.choice_from_scores(cfg, self.policy.pooled(torch.cat(masses)), end, n_win,
                                                          shares)
        else:
            choice, kept = self.policy.keep_everything(cfg, end)
        self.policy.last_choice = choice
        self._kept = kept
        return model.head(h[-1:])[-1]

    @torch.inference_mode()
    def compute(self, model: Transformer, tokens: list[int], start: int | None = None, chunk: int = 4096) -> None:
        """Compute `tokens`' K/V into slots [start, ...) (default: appended), through every layer over the slots
        before them as a message's are, choosing nothing: a restore's recomputed rounds (placed among loaded ones),
        a settled round's tail. The latest choice stays the reply's."""
        if tokens:
            self._stream(model, tokens, self.host.length if start is None else start, 0, chunk)

    def _stream(self, model: Transformer, tokens: list[int], first: int, n_win: int,
                chunk: int) -> tuple[Tensor, list[Tensor]]:
        """Run `tokens` at slots [first, ...) through every layer, one layer's K/V staged on the device at a time,
        their K/V written to the host copy; (the last hidden states [T, d], per global layer the window's slot mass
        when `n_win`)."""
        cfg, n = model.cfg, len(tokens)
        end = first + n
        self.reserve(end)
        self.working = None  # the last reply's working set is freed before any layer is staged
        positions = torch.arange(first, end)
        h = model.embed(torch.tensor(tokens, dtype=torch.long))
        masses: list[Tensor] = []
        for layer in range(cfg.n_layers):
            stage = KVCache(cfg, self.device, model.dtype, end, layers=range(layer, layer + 1))
            lo = window_start(cfg.window(layer), first)  # a sliding-window layer reads its window's slots alone
            if lo < first:
                stage.layer(layer)[:, :, lo:first] = self._host_layer(layer, lo, first)
            self.peak_stage_bytes = max(self.peak_stage_bytes, stage.device_bytes())
            outs, window_q = [], None
            for c in range(0, n, chunk):  # the message in chunks, as a prefill on the device runs it
                queries: list[Tensor] | None = [] if n_win else None  # the window's, to score it
                outs.append(model.run_layers(h[c : c + chunk], positions[c : c + chunk], stage, first + c,
                                             layers=range(layer, layer + 1), queries=queries))
                if queries:
                    q = queries[0].reshape(-1, cfg.n_heads, cfg.head_dim)
                    window_q = q[-n_win:] if window_q is None else torch.cat([window_q, q])[-n_win:]
                del queries
            h = torch.cat(outs) if len(outs) > 1 else outs[0]
            del outs
            self.host.write(range(layer, layer + 1), first, stage.read(range(layer, layer + 1), first, end))
            if n_win and layer in cfg.global_layers:
                masses.append(slot_mass(window_q[None], stage.keys_of([layer], end), end - n_win, None,
                                        cfg.softmax_scale))
            del stage
        self.host.length = max(self.host.length, end)  # a restore's recompute may come before rounds loaded after it
        return h, masses

    def decode_step(self, model: Transformer, max_tokens: int, limit: int, *, attend: Attend = None,
                    first: int = 0, cuda_graph: bool | None = None, policy=None) -> Callable[[int], Tensor]:
        """The reply's step over its working set: each layer's kept slots (chosen by the prefill) gathered from the
        host copy onto the device, with room for `max_tokens`."""
        if attend is not None:
            raise ValueError("a host-resident chat's reply reads its working set")
        first = self.host.length
        if len(self._kept) != model.cfg.n_layers:
            raise RuntimeError("a host-resident chat's reply follows its message's prefill, which chooses its slots")
        capacity = min(first + max_tokens + 1, limit)
        self.reserve(capacity)
        windows = [model.cfg.window(i) for i in range(model.cfg.n_layers)]

        def layer_kv(i: int) -> tuple[Tensor, int]:
            # Each layer staged again and its kept slots gathered on the device: one copy of the chat over the bus
            # (~4 GB at 32k on the 8B shape) costs less than gathering them on one CPU core; a window layer's span.
            lo = 0 if self._kept[i] is not None else window_start(windows[i], first)
            return self._host_layer(i, lo, first), lo

        self.working = LayerWorkingSet.from_layers(layer_kv, self._kept, windows, first, capacity - first)
        return WorkingSetDecode(model, self.host, self.working, capacity, cuda_graph)

    def _host_layer(self, layer: int, start: int, end: int) -> Tensor:
        """K/V [2, Hkv, end - start, D] of one layer's slots, copied to the device (one copy per K or V and head:
        each is a contiguous run of the pinned host tensor)."""
        src = self.host.layer(layer)[:, :, start:end]
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        for kv in range(2):
            for head in range(src.shape[1]):
                out[kv, head].copy_(src[kv, head], non_blocking=True)
        return out
