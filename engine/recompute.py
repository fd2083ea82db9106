"""The recompute stream of a restore: a chat's first tokens prefilled again, layer group by layer group, on a
thread (and, on CUDA, a stream) of their own while the load stream brings in the rest.

A prefix of the chat attends only to itself, so it needs nothing loaded. The span shrinks with depth (a pyramid:
group g + 1 runs on the first tokens of group g's output, Krul's tensor[:target_length]), and each group runs in
the same chunks as `generate.prefill`, so its K/V are those a fresh prefill computes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from kvchat.engine.model import KVCache, Transformer


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
    """Runs `steps` over `tokens` (the chat's first tokens) when started; `join` waits and re-raises any error."""

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
        self.done_tokens = 0  # token-layers finished, as a share of the work: progress for the restore's caller
        self.busy_s = 0.0
        self.launched_s = 0.0  # until the last kernel was queued: near busy_s, the host (not the device) set the pace
        self.started_at = self.ended_at = 0.0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stream = None
        self._done_event = None

    @property
    def work(self) -> int:
        return sum(s.tokens * len(s.layers) for s in self.steps)

    def start(self) -> "PrefixRecompute":
        device = self.model.device
        if device.type == "cuda" and self.side_stream:
            # The caches were made on the caller's stream: the recompute stream starts after that.
            self._stream = _recompute_stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self.started_at = time.perf_counter()
        if not self.steps:
            self.ended_at = self.started_at
            return self
        self._thread = threading.Thread(target=self._run, name="kv-recompute", daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait for the recompute; the caller's stream then waits for its K/V (on the device, not the host)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._done_event is not None:
            torch.cuda.current_stream(self.model.device).wait_event(self._done_event)

    def wait(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the recompute thread, raising nothing."""
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                on_stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
                with on_stream:
                    self._pyramid()
                    if self.model.device.type == "cuda":
                        self._done_event = torch.cuda.Event()
                        self._done_event.record()
                self.launched_s = time.perf_counter() - self.started_at
                if self._done_event is not None:
                    self._done_event.synchronize()  # busy time is the device's, not the launches'
        except BaseException as exc:  # noqa: BLE001 - handed to join()
            self._error = exc
        self.ended_at = time.perf_counter()
        self.busy_s = self.ended_at - self.started_at

    def run_here(self) -> "PrefixRecompute":
        """Run on the calling thread, now (on the recompute stream, or the caller's without `side_stream`)."""
        device = self.model.device
        if device.type == "cuda" and self.side_stream:
            self._stream = _recompute_stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self.started_at = time.perf_counter()
        self._run()
        if self._error is not None:
            raise self._error
        return self

    def _pyramid(self) -> None:
        m = self.model
        n = self.steps[0].tokens
        h = m.embed(torch.tensor(self.tokens[:n], dtype=torch.long))  # [n, d]
        # Every chunk's rotation, on the device at once: the host then never waits for a copy of positions to
        # the device, and queues the whole pyramid ahead of the device.
        m.rope.reserve(n)
        rot_c, rot_s = m.rope.gather(torch.arange(n, device=m.device))
        for step in self.steps:
            h = h[: step.tokens]  # the next group needs only the first tokens' hidden states (Eq. 4)
            outs = []
            for c in range(0, step.tokens, self.CHUNK):
                if self.cancel is not None and self.cancel.is_set():
                    raise RecomputeCancelled()
                end = min(c + self.CHUNK, step.tokens)
                outs.append(m.run_layers(h[c:end], None, step.cache, c, layers=step.layers,
                                         rot=(rot_c[c:end], rot_s[c:end])))
                self.done_tokens += (end - c) * len(step.layers)
            h = outs[0] if len(outs) == 1 else torch.cat(outs)
