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

It is a KVStore (engine.kv.base) as generation drives it, and exposes the host copy (`host`, a KVCache on the
CPU, pinned where the model runs on CUDA) to whoever restores or saves the chat.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.working_set import LayerWorkingSet, WorkingSetDecode, window_start
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
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

    def reserve(self, n_slots: int) -> None:
        """Room for slots [0, n_slots) in the host copy (doubling), allocated pinned where the model is on CUDA."""
        host = self.host
        if n_slots <= host.capacity:
            return
        if self.device.type != "cuda":
            host.reserve(n_slots)
            return
        old = host.kv
        grown = torch.zeros(*old.shape[:3], max(n_slots, 2 * old.shape[3]), old.shape[4], dtype=old.dtype,
                            pin_memory=True)
        grown[:, :, :, : old.shape[3]] = old
        host.kv = grown

    def truncate(self, length: int) -> None:
        self.host.truncate(length)
        self.working, self._kept = None, []  # chosen for a chat that no longer is: the next message chooses again

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
        cfg, first, n = model.cfg, self.host.length, len(tokens)
        end = first + n
        self.reserve(end)
        self.working = None  # the last reply's working set is freed before any layer is staged
        positions = torch.arange(first, end)
        h = model.embed(torch.tensor(tokens, dtype=torch.long))
        n_win = min(self.policy.window, n, end)
        scored = self.policy.scores_needed(cfg, end, n_win)
        masses: list[Tensor] = []
        for layer in range(cfg.n_layers):
            stage = KVCache(cfg, self.device, model.dtype, end, layers=range(layer, layer + 1))
            lo = window_start(cfg.window(layer), first)  # a sliding-window layer reads its window's slots alone
            if lo < first:
                stage.layer(layer)[:, :, lo:first] = self._host_layer(layer, lo, first)
            self.peak_stage_bytes = max(self.peak_stage_bytes, stage.device_bytes())
            outs, window_q = [], None
            for c in range(0, n, chunk):  # the message in chunks, as a prefill on the device runs it
                queries: list[Tensor] = []
                outs.append(model.run_layers(h[c : c + chunk], positions[c : c + chunk], stage, first + c,
                                             layers=range(layer, layer + 1), queries=queries))
                q = queries[0].reshape(-1, cfg.n_heads, cfg.head_dim)
                window_q = q[-n_win:] if window_q is None else torch.cat([window_q, q])[-n_win:]
                del queries, q
            h = torch.cat(outs) if len(outs) > 1 else outs[0]
            del outs
            self.host.write(range(layer, layer + 1), first, stage.read(range(layer, layer + 1), first, end))
            if scored and layer in cfg.global_layers:
                masses.append(slot_mass(window_q[None], stage.keys_of([layer], end), end - n_win, None,
                                        cfg.softmax_scale))
            del stage
        self.host.length = end
        if scored:
            choice, kept = self.policy.choice_from_scores(cfg, self.policy.pooled(torch.cat(masses)), end, n_win)
        else:
            choice, kept = self.policy.keep_everything(cfg, end)
        self.policy.last_choice = choice
        self._kept = kept
        return model.head(h[-1:])[-1]

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
