"""Timing work on a device: the one place the benchmarks and the hardware profile (app/session/profile.py) read
the clock around GPU work.

CUDA runs kernels asynchronously, so the clock read right after a call times its launch, not its work: `sync`
waits for the device's queue first, and `timed_runs` does it on both sides of every run. On the CPU both are plain
clock reads. Here in engine/ (which imports neither storage/ nor app/) so that runtime code may use it as well as
app/bench/, which only the CLI may import.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait until `device` has run everything queued on it (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs of fn, the device synchronized around each (callers pick the statistic:
    the fastest for a floor, the median for a typical figure)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times
