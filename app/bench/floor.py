"""The physical floor of resuming a chat: what the machine allows, measured in the same run as the methods.

Resuming needs either the chat's K/V (read from disk, moved to the device) or recomputing it (a prefill). The
floor for a workload is the faster of the two at the machine's measured rates:
min(bytes ÷ min(disk, host-to-device), recompute FLOPs ÷ matmul FLOP/s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.timing import timed_runs


def _timed(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` runs: the floor is what the machine can do, not what it did on an unlucky run."""
    return min(timed_runs(fn, device, repeats))


def host_to_device_gb_s(device: torch.device, size: int = 256 << 20, repeats: int = 5) -> float | None:
    """Pinned host memory to the GPU, GB/s; None on the CPU, where there is no such copy."""
    if device.type != "cuda":
        return None
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    return size / _timed(lambda: dst.copy_(src, non_blocking=True), device, repeats) / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """Square matmul throughput in the engine's dtype (the prefill's dominant operation), TFLOP/s."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    inner = 10 if device.type == "cuda" else 2

    def run():
        for _ in range(inner):
            torch.matmul(a, b)

    run()
    return 2 * n**3 * inner / _timed(run, device, repeats) / 1e12


def matmul_params(cfg: ModelConfig) -> int:
    """Weights every prefilled token is multiplied by (attention projections and MLP; not the embedding lookup,
    and not the output head, which only the last token needs)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * (cfg.d_model * (q + 2 * kv) + q * cfg.d_model + 3 * cfg.d_model * cfg.ffn_dim)


def recompute_flops(cfg: ModelConfig, tokens: int) -> float:
    """Prefill FLOPs: 2 × params × tokens for the matmuls, plus causal attention, 4 × layers × width × tokens²/2
    (scores and the weighted sum, each 2 FLOPs per multiply-add, over half the square)."""
    width = cfg.n_heads * cfg.head_dim
    return 2.0 * matmul_params(cfg) * tokens + 4.0 * cfg.n_layers * width * tokens**2 / 2


@dataclass
class Floor:
    bytes_needed: int
    load_seconds: float  # bytes ÷ min(disk, host-to-device)
    recompute_flops: float
    recompute_seconds: float  # FLOPs ÷ FLOP/s
    seconds: float
    bound: str  # "load" | "recompute"


def resume_floor(bytes_needed: int, flops: float, disk_mb_s: float, h2d_gb_s: float | None,
                 tflops: float) -> Floor:
    bandwidth = disk_mb_s * 1e6 if h2d_gb_s is None else min(disk_mb_s * 1e6, h2d_gb_s * 1e9)
    load = bytes_needed / bandwidth
    compute = flops / (tflops * 1e12)
    return Floor(bytes_needed, load, flops, compute, min(load, compute), "load" if load <= compute else "recompute")
