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
from typing import Callable

import numpy as np
import torch


@dataclass
class Staged:
    """Bytes on their way to the GPU: `ready` makes the caller's stream wait until `tensor` holds them."""

    tensor: torch.Tensor  # uint8, on the device
    ready: Callable[[], None] | None

    def wait(self) -> torch.Tensor:
        """The tensor, safe to use on the current stream (which waits for the copy on the GPU, not the CPU)."""
        if self.ready is not None:
            self.ready()
        return self.tensor


class CudaCopies:
    """The CUDA side of the ring, its one contact with CUDA: pinned host buffers, the device tensors copied into,
    and asynchronous copies on one side stream ordered by events. The tests put a CPU stand-in in its place
    (HostToDevice.copies) to run the ring's chunking and buffer reuse with copies that complete late."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"HostToDevice copies to a CUDA device, not {device}")
        self.device = device
        # One side stream for every copy (they share the copy engine anyway). Made once: creating streams, and
        # allocating device memory in a new stream's pool, would cost a cudaMalloc (a device-wide sync) per thread.
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def serves(device: torch.device) -> bool:
        return device.type == "cuda"

    def host_buffer(self, size: int) -> np.ndarray:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()

    def output(self, size: int) -> torch.Tensor:
        # Allocated in the caller's stream (whose cached blocks are reused), written on the side stream once that
        # stream has caught up with the caller's (a reused block may still be read by work queued there).
        out = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out.record_stream(self.stream)  # freed early (a cancelled restore), it is not reused before the DMA ends
        return out

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> torch.cuda.Event:
        """dst <- src, asynchronously: an event whose synchronize() returns once the copy has read src."""
        with torch.cuda.stream(self.stream):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def ready(self) -> Callable[[], None]:
        """What makes the caller's stream wait for every copy queued so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return lambda: torch.cuda.current_stream(self.device).wait_event(event)


class HostToDevice:
    CHUNK = 4 << 20
    SLOTS = 16
    copies = CudaCopies  # the device side (tests: a CPU stand-in)
    _shared: dict[torch.device, "HostToDevice"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def serves(cls, device: torch.device | str) -> bool:
        """Whether bytes for `device` travel through the ring (to a GPU) rather than being used where they are."""
        return cls.copies.serves(torch.device(device))

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
        self._copies = self.copies(self.device)
        chunk, slots = chunk or self.CHUNK, slots or self.SLOTS
        self._buffers = [self._copies.host_buffer(chunk) for _ in range(slots)]
        self._free_after: list = [None] * slots  # the copy last reading each buffer (its event)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)

    def copy(self, raw) -> Staged:
        """`raw` (any bytes-like object) on its way to a new uint8 tensor on the device; `raw` may be reused as
        soon as this returns."""
        src = np.frombuffer(raw, dtype=np.uint8)
        out = self._copies.output(len(src))
        chunk = len(self._buffers[0])
        for off in range(0, len(src), chunk):
            n = min(chunk, len(src) - off)
            i = self._free.get()
            try:
                if self._free_after[i] is not None:
                    self._free_after[i].synchronize()
                # numpy, not torch: one thread per copy, where torch would start a parallel region in each of
                # the many threads that stage at once.
                np.copyto(self._buffers[i][:n], src[off:off + n])
                self._free_after[i] = self._copies.copy(out[off:off + n], self._buffers[i][:n])
            finally:
                self._free.put(i)
        return Staged(out, self._copies.ready())
