"""The recompute stream of a restore: a chat's first tokens prefilled again, layer group by layer group, on a CUDA
stream of their own while the load stream brings in the rest.

A prefix of the chat attends only to itself, so it needs nothing loaded. The span shrinks with depth (a pyramid:
group g + 1 runs on the first tokens of group g's output, Krul's tensor[:target_length]), and each group runs in
the same chunks as `generate.prefill`, so its K/V are those a fresh prefill computes, up to the rounding of the last
chunk (shorter than the prefill's chunk there, and matrix products round by shape): within 1e-5 in float32 (the
tests), a few bfloat16 units in the last place in bfloat16.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.decoder import Transformer


class RecomputeCancelled(Exception):
    pass


_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_streams_lock = threading.Lock()


def _recompute_stream(device: torch.device) -> "torch.cuda.Stream":
    """One stream per device for the process: memory the allocator caches for a stream is reused only by that
    stream, so a new stream per restore would cudaMalloc (a device-wide sync) the activations every time."""
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


@dataclass
class PyramidStep:
    layers: range  # a layer group
    tokens: int  # recompute the chat's first `tokens` at these layers (non-increasing from step to step)
    cache: KVCache  # where those layers' K/V go (slots = positions)


class PrefixRecompute:
    """Recomputes `steps` over `tokens` (the chat's first tokens). `launch` queues the whole pyramid on the
    recompute stream from the calling thread and returns (on the CPU it computes it there); `finish` waits for it.

    The calling thread should be the main one: on a GPU, PyTorch queued the same kernels 5-8 times slower from a
    thread of their own (docs/probes/recompute_threads.py, H100), so the restore places loaded rounds from a helper
    thread instead (few operations each) and queues the recompute here."""

    CHUNK = 4096  # as generate.prefill: the same chunks give the same K/V

    def __init__(self, model: Transformer, tokens: list[int], steps: list[PyramidStep],
                 cancel: threading.Event | None = None, side_stream: bool = True):
        for a, b in zip(steps, steps[1:]):
            if b.tokens > a.tokens or b.layers.start != a.layers.stop:
                raise ValueError("recompute steps must run upward through adjacent layer groups on shrinking spans")
        if steps and steps[0].tokens > len(tokens):
            raise ValueError(f"recomputing {steps[0].tokens} tokens needs them ({len(tokens)} given)")
        self.model, self.tokens, self.steps = model, tokens, [s for s in steps if s.tokens > 0]
        self.cancel, self.side_stream = cancel, side_stream
        self.done_tokens = 0  # token-layers queued (computed, on the CPU): progress for the restore's caller
        self.busy_s = 0.0
        self.launched_s = 0.0  # until the last kernel was queued: near busy_s, the host (not the device) set the pace
        self.started_at = self.ended_at = 0.0
        self._stream = None
        self._done_event = None
        self._caches_ready = None
        if model.device.type == "cuda" and side_stream:
            # The caches were made on the caller's stream: the recompute starts after that, and after nothing queued
            # there later (a restore's loaded rounds, placed from another thread while this one tokenized, once held
            # it back).
            self._caches_ready = torch.cuda.Event()
            self._caches_ready.record(torch.cuda.current_stream(model.device))

    @property
    def work(self) -> int:
        return sum(s.tokens * len(s.layers) for s in self.steps)

    @torch.inference_mode()
    def launch(self) -> "PrefixRecompute":
        """Queue (CPU: compute) the pyramid; RecomputeCancelled if `cancel` is set between chunks."""
        device = self.model.device
        self.started_at = time.perf_counter()
        if not self.steps:
            self.ended_at = self.started_at
            return self
        if self._caches_ready is not None:
            self._stream = _recompute_stream(device)
            self._stream.wait_event(self._caches_ready)
        on_stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with on_stream:
            self._pyramid()
            if device.type == "cuda":
                self._done_event = torch.cuda.Event()
                self._done_event.record()
        self.launched_s = time.perf_counter() - self.started_at
        return self

    def finish(self) -> "PrefixRecompute":
        """Wait for the device to finish; the caller's stream then waits for the K/V (on the device)."""
        if self._done_event is not None:
            self._done_event.synchronize()  # busy time is the device's, not the launches'
            torch.cuda.current_stream(self.model.device).wait_event(self._done_event)
            self._done_event = None
        if self.steps and not self.ended_at:
            self.ended_at = time.perf_counter()
            self.busy_s = self.ended_at - self.started_at
        return self

    def run(self) -> "PrefixRecompute":
        return self.launch().finish()

    def _pyramid(self) -> None:
        m = self.model
        n = self.steps[0].tokens
        h = m.embed(torch.tensor(self.tokens[:n], dtype=torch.long))  # [n, d]
        # Every chunk's rotation, on the device at once: the host then never waits for a copy of positions to
        # the device, and queues the whole pyramid ahead of the device.
        m.reserve_rotations(n)
        rots = m.gather_rotations(torch.arange(n, device=m.device))
        for step in self.steps:
            h = h[: step.tokens]  # the next group needs only the first tokens' hidden states (Eq. 4)
            outs = []
            for c in range(0, step.tokens, self.CHUNK):
                if self.cancel is not None and self.cancel.is_set():
                    raise RecomputeCancelled()
                end = min(c + self.CHUNK, step.tokens)
                outs.append(m.run_layers(h[c:end], None, step.cache, c, layers=step.layers,
                                         rot=tuple((cos[c:end], sin[c:end]) for cos, sin in rots)))
                self.done_tokens += (end - c) * len(step.layers)
            h = outs[0] if len(outs) == 1 else torch.cat(outs)
