"""Host-to-GPU copies of K/V bytes through a few pinned buffers, pinned once per process.

A DMA copy needs page-locked (pinned) host memory. Pinning is slow on the machines we measured (about 1 GB/s: a
second per GiB, on an H100 VM), and a copy from ordinary (pageable) memory goes through the driver's own staging at
about 6 GB/s. So restores copy K/V bytes in chunks through a small pool of pinned buffers that lives as long as
the process: a CPU memcpy into a free buffer, then an asynchronous DMA from it on the calling thread's own CUDA
stream. Many threads copy at once (each takes any free buffer for one chunk, so none waits on another's progress),
and the thread that uses the result waits only for its copy's event.
"""

from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass

import torch


@dataclass
class Staged:
    """Bytes on their way to the GPU: `ready` fires when `tensor` holds them."""

    tensor: torch.Tensor  # uint8, on the device
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        """The tensor, safe to use on the current stream (which waits for the copy on the GPU, not the CPU)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            stream.wait_event(self.ready)
            self.tensor.record_stream(stream)  # allocated on the copying thread's stream, used on this one
        return self.tensor


class HostToDevice:
    CHUNK = 4 << 20
    SLOTS = 16
    _shared: dict[torch.device, "HostToDevice"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, device: torch.device | str) -> "HostToDevice":
        """The process's buffers for `device` (pinned on first use: part of warm-up, not of any one restore)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with cls._shared_lock:
            if device not in cls._shared:
                cls._shared[device] = cls(device)
            return cls._shared[device]

    def __init__(self, device: torch.device | str, chunk: int | None = None, slots: int | None = None):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"HostToDevice copies to a CUDA device, not {self.device}")
        chunk, slots = chunk or self.CHUNK, slots or self.SLOTS
        self._buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._free_after: list[torch.cuda.Event | None] = [None] * slots  # the DMA last reading each buffer
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)
        self._streams = threading.local()

    def copy(self, raw) -> Staged:
        """`raw` (any bytes-like object) on its way to a new uint8 tensor on the device; `raw` may be reused as
        soon as this returns."""
        src = _as_tensor(raw)
        stream = self._stream()
        with torch.cuda.stream(stream):
            out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            chunk = self._buffers[0].numel()
            for off in range(0, src.numel(), chunk):
                n = min(chunk, src.numel() - off)
                i = self._free.get()
                try:
                    if self._free_after[i] is not None:
                        self._free_after[i].synchronize()
                    self._buffers[i][:n].copy_(src[off:off + n])
                    out[off:off + n].copy_(self._buffers[i][:n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    self._free_after[i] = done
                finally:
                    self._free.put(i)
            ready = torch.cuda.Event()
            ready.record(stream)
        return Staged(out, ready)

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        return stream


def _as_tensor(raw) -> torch.Tensor:
    """A uint8 view of any bytes-like object (read-only ones included: it is only read from)."""
    if not len(raw):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        return torch.frombuffer(raw, dtype=torch.uint8)
