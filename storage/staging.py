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
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Staged:
    """Bytes on their way to the GPU: `ready` fires when `tensor` holds them."""

    tensor: torch.Tensor  # uint8, on the device
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        """The tensor, safe to use on the current stream (which waits for the copy on the GPU, not the CPU)."""
        if self.ready is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.ready)
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
        self._buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(slots)]
        self._free_after: list[torch.cuda.Event | None] = [None] * slots  # the DMA last reading each buffer
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)
        # One side stream for every copy (they share the copy engine anyway). Made once: creating streams, and
        # allocating device memory in a new stream's pool, would cost a cudaMalloc (a device-wide sync) per thread.
        self._stream = torch.cuda.Stream(self.device)

    def copy(self, raw) -> Staged:
        """`raw` (any bytes-like object) on its way to a new uint8 tensor on the device; `raw` may be reused as
        soon as this returns."""
        src = np.frombuffer(raw, dtype=np.uint8)
        # Allocated in the caller's stream (whose cached blocks are reused), written on the side stream once that
        # stream has caught up with the caller's (a reused block may still be read by work queued there).
        out = torch.empty(len(src), dtype=torch.uint8, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        out.record_stream(self._stream)  # freed early (a cancelled restore), it is not reused before the DMA ends
        chunk = len(self._buffers[0])
        with torch.cuda.stream(self._stream):
            for off in range(0, len(src), chunk):
                n = min(chunk, len(src) - off)
                i = self._free.get()
                try:
                    if self._free_after[i] is not None:
                        self._free_after[i].synchronize()
                    # numpy, not torch: one thread per copy, where torch would start a parallel region in each of
                    # the many threads that stage at once.
                    np.copyto(self._buffers[i][:n], src[off:off + n])
                    out[off:off + n].copy_(torch.from_numpy(self._buffers[i][:n]), non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._stream)
                    self._free_after[i] = done
                finally:
                    self._free.put(i)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return Staged(out, ready)
