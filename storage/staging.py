"""Host-to-GPU copies of K/V bytes through a few pinned buffers, pinned once per process.

A DMA copy needs page-locked (pinned) host memory. Pinning is slow on the machines we measured (about 1 GB/s: a
second per GiB, on an H100 VM), and a copy from ordinary (pageable) memory goes through the driver's own staging at
about 6 GB/s. So restores copy each segment's bytes in chunks through a small ring of pinned buffers that lives as
long as the process: a CPU memcpy into the next free buffer, then an asynchronous DMA from it, while the copy engine
drains the previous one.
"""

from __future__ import annotations

import threading
import warnings

import torch


class HostToDevice:
    CHUNK = 8 << 20
    SLOTS = 4
    _shared: dict[torch.device, "HostToDevice"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, device: torch.device | str) -> "HostToDevice":
        """The process's ring for `device` (pinned on first use: part of warm-up, not of any one restore)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with cls._shared_lock:
            if device not in cls._shared:
                cls._shared[device] = cls(device)
            return cls._shared[device]

    def __init__(self, device: torch.device | str, chunk: int | None = None, slots: int | None = None):
        self.device = torch.device(device)
        chunk, slots = chunk or self.CHUNK, slots or self.SLOTS
        if self.device.type != "cuda":
            raise ValueError(f"HostToDevice copies to a CUDA device, not {self.device}")
        self._slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._free_after: list[torch.cuda.Event | None] = [None] * slots  # the DMA still reading each buffer
        self._next = 0
        self._lock = threading.Lock()

    def copy(self, raw) -> torch.Tensor:
        """`raw` (any bytes-like object) as a new uint8 tensor on the device. The copy is ordered on the calling
        thread's current stream, so work queued after it there sees the bytes; `raw` may be reused on return."""
        src = _as_tensor(raw)
        out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        chunk = self._slots[0].numel()
        with self._lock:
            for off in range(0, src.numel(), chunk):
                n = min(chunk, src.numel() - off)
                i, self._next = self._next, (self._next + 1) % len(self._slots)
                if self._free_after[i] is not None:
                    self._free_after[i].synchronize()
                self._slots[i][:n].copy_(src[off:off + n])
                out[off:off + n].copy_(self._slots[i][:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                self._free_after[i] = done
        return out


def _as_tensor(raw) -> torch.Tensor:
    """A uint8 view of any bytes-like object (read-only ones included: it is only read from)."""
    if not len(raw):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        return torch.frombuffer(raw, dtype=torch.uint8)
