"""The GPU memory budget where a command or the app loads a model and opens a chat (engine/memory_plan.py plans;
this module finds the budget on the device, refuses a model whose weights cannot fit, and plans a chat's K/V with
what the chat store knows: its tokens and its rounds).

`--gpu-memory` applies to CUDA only: on the CPU it is accepted and does nothing (the machine's memory is the
operating system's to share; kvchat never caps it), and nothing is said about it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kvchat.engine.kv.cache import RING_SLACK
from kvchat.engine.memory_plan import (
    MemoryNeeds,
    MemoryPlan,
    device_budget,
    plan_host_resident,
    plan_memory,
    upper_share_tokens,
    weight_bytes,
    workspace_bytes,
)
from kvchat.errors import GPUMemoryError

# Room a chat opened without a message in hand (the app opens a chat before anything is typed) keeps for one: a
# message of up to 512 tokens and a reply of the app's default length (512), planned and reserved alike.
OPEN_ROOM = 512 + 512 + 1


@dataclass(frozen=True)
class Budget:
    """Bytes kvchat may allocate on `device`, and how messages name them ("--gpu-memory", or "": the free memory)."""

    device: torch.device
    bytes: int
    name: str


def resolve_device(device) -> torch.device:
    """The device a model given `device` (None: cuda when available) loads on."""
    from kvchat.engine.gguf.loader import default_device

    return torch.device(device) if device is not None else default_device()


def memory_budget(device, requested: int | None, name: str = "--gpu-memory") -> Budget | None:
    """The budget on `device` (the device a model loads on), with torch's allocator capped at `requested` bytes
    (engine.memory_plan.device_budget); None off CUDA, where `--gpu-memory` has no effect."""
    device = resolve_device(device)
    if device.type != "cuda":
        return None
    planned, named = device_budget(device, requested, name)
    return Budget(device, planned, named)


def model_needs(cfg, budget: Budget, weights: tuple[int, int], act_bytes: int, quantized: bool, tokens: int,
                tiered: bool = False, **more) -> MemoryNeeds:
    """MemoryNeeds of a model of config `cfg` holding `tokens` on the device; `weights`: (bytes, tensors) as
    engine.memory_plan.weight_bytes gives them; `more`: the tiered terms (split, upper_tokens, picked_tokens,
    largest_round)."""
    ring_layers = sum(1 for i in range(cfg.n_layers) if cfg.window(i)) if not tiered else 0
    return MemoryNeeds(budget=budget.bytes, weights=weights[0],
                       workspace=workspace_bytes(cfg, act_bytes, tokens, quantized, graphs=2 if tiered else 1,
                                                 weight_tensors=weights[1]),
                       kv_per_token_layer=2 * cfg.n_kv_heads * cfg.head_dim * act_bytes, layers=cfg.n_layers,
                       tokens=tokens, ring_layers=ring_layers,
                       ring_tokens=cfg.sliding_window + RING_SLACK if ring_layers else 0,
                       budget_name=budget.name, **more)


def file_weights(path: str | os.PathLike[str], device_type: str) -> tuple[int, int]:
    """engine.memory_plan.weight_bytes of a model file, read once per file version (its metadata takes a moment)."""
    st = os.stat(path)
    return _file_weights(os.fspath(path), st.st_size, st.st_mtime_ns, device_type)


@functools.lru_cache(maxsize=16)
def _file_weights(path: str, size: int, mtime_ns: int, device_type: str) -> tuple[int, int]:
    return weight_bytes(path, device_type)


def check_weights(path: str | os.PathLike[str], budget: Budget | None) -> None:
    """Refuse, in one line with the numbers, a model whose weights and the least workspace (a one-token prompt's)
    alone exceed the budget, before it is loaded: loading it would fail half-way, or leave nothing for a chat."""
    if budget is None:
        return
    from kvchat.engine.gguf.config import ModelConfig
    from kvchat.engine.gguf.reader import GGUFFile

    cfg = ModelConfig.from_gguf(GGUFFile(path))
    cuda = budget.device.type == "cuda"
    plan = plan_memory(model_needs(cfg, budget, file_weights(path, budget.device.type), 2 if cuda else 4, cuda, 1))
    if plan.kind == "refused":
        raise GPUMemoryError(plan.message)


def chat_needs(engine, budget: Budget, chat_tokens: int, new_tokens: int, round_tokens: list[int],
               split: int | None = None, tiered: bool = False) -> MemoryNeeds:
    """What a chat of `chat_tokens` (its rounds' lengths `round_tokens`) needs on the engine's device with room for
    `new_tokens` more (a message and its reply); `split`: the tiered cache's, once known."""
    tokens = min(chat_tokens + new_tokens, engine.config.context_length + 1)
    picked = min(upper_share_tokens(round_tokens), chat_tokens)
    act_bytes = torch.tensor([], dtype=engine.dtype).element_size()
    cuda = engine.device.type == "cuda"  # where the loader keeps matrices in their blocks (its default)
    return model_needs(engine.config, budget, file_weights(engine.path, engine.device.type), act_bytes, cuda,
                       tokens, tiered=tiered or split is not None, split=split,
                       upper_tokens=picked + tokens - chat_tokens, picked_tokens=picked,
                       largest_round=max(round_tokens, default=0))


def plan_chat(engine, budget: Budget, chat_tokens: int, new_tokens: int, round_tokens: list[int],
              split: int | None = None) -> MemoryPlan:
    """engine.memory_plan.plan_memory for the chat (see chat_needs)."""
    return plan_memory(chat_needs(engine, budget, chat_tokens, new_tokens, round_tokens, split))


def plan_host_chat(engine, budget: Budget, chat_tokens: int, new_tokens: int, round_tokens: list[int], policy
                   ) -> MemoryPlan:
    """engine.memory_plan.plan_host_resident for the chat under a per-layer budget `policy` (engine.policies.budgets:
    its share and always-kept window), with room for `new_tokens` more."""
    needs = chat_needs(engine, budget, chat_tokens, new_tokens, round_tokens)
    kept = policy.tokens / max(chat_tokens, 1) if policy.tokens else policy.budget
    return plan_host_resident(needs, min(kept, 1.0), policy.window, needs.tokens - min(chat_tokens, needs.tokens))
