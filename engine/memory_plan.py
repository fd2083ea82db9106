"""The GPU memory budget (`--gpu-memory SIZE`, issue 41): what a chat needs on the device, worked out before anything
is allocated, so that a run that cannot fit says so in one line rather than failing in the middle of a reply.

A budget is the bytes kvchat may allocate on the GPU. `--gpu-memory` (or the app's setting) sets it, and torch's
per-process memory fraction enforces it (`enforce_budget`), so a run on an 80 GB card behaves as a card of that
size would; without it, the budget is what the card has free when the model is loaded (what torch's allocator in
this process already holds counted as free: it is this process's to reuse). The CUDA context itself (a few hundred
MiB) lies outside torch's allocator and outside the budget: on a real 8 GB card, about 7.5 GiB is left for it.

`plan_memory` is pure arithmetic over `MemoryNeeds`. Its terms, and why each is there:

- **weights** (`weight_bytes`): the model's tensors as the loader puts them on the device — matrices whose GGUF type
  has a decode kernel (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0) in their blocks, other matrices dequantized to bf16,
  norms in fp32 (the 8B shape in Q4_K_M: 4.58 GiB).
- **workspace** (`workspace_bytes`), what a message allocates beside the weights and the K/V at its peak:
  - a prefill chunk's activations (4,096 tokens): the hidden state and its normed copy, the fused QKV product, the
    attention's output and the MLP's gate, up and gated product — (2·d + (H + 2·Hkv)·D + H·D + 3·ffn) values per
    token, in the activations' dtype (the 8B shape: 480 MiB);
  - a prefill band: a quantized matrix meets a chunk as bands of 2^24 weights dequantized to bf16 just before
    their product (engine.model.quantized.BAND_ELEMENTS, 32 MiB), the next band allocated while the last is freed;
    a prompt of at most 2,048 tokens takes bands of 2^26 weights (128 MiB, fewer launches) beside at most half
    the activations: the higher of the two is planned;
  - the vocabulary's logits in fp32, and what sampling makes of them (softmax, sorted values, their int64 indices);
  - the decode step's CUDA graph: its private memory pool holds one token's activations (about 2 MiB on the 8B
    shape) but in whole allocator segments; the tiered cache captures two graphs (its lower and upper replays);
  - the rotary tables: cos and sin in fp32 for every position up to the cache's, grown by doubling from 1,024
    (Gemma 3's sliding layers have a second pair);
  - allocator slack: torch's caching allocator rounds each large block up to 2 MiB (about 1 MiB lost per weight
    tensor), keeps freed blocks split between a chunk's differently sized activations, and cuBLAS keeps a
    workspace per stream (32 MiB on Hopper).
- **the restore's segments in flight**: a restore reads stored K/V ahead of its use (storage.prefetch: up to 1 GiB
  of decoded segments) and stages each on the device until its round is placed — never more than the K/V it loads
  to the device. This is the restore's peak, not the message's: the two never overlap.
- **K/V**: bytes per token and layer (2·Hkv·D in bf16: 4 KiB on the 8B shape, so 128 KiB a token over 32 layers)
  times the layers and tokens held on the device: the chat's tokens, the new message's and the reply's room (a
  sliding-window layer keeps at most its ring, engine.kv.cache.RING_SLACK past its window).

Plans, by the peak of the restore and of the message, whichever is higher:

- `full`: all of the K/V resident (the full cache).
- `tiered`: Round Attention's tiered cache (engine.kv.tiered): layers [0, split) of every token stay resident; above
  the split only the rounds a message picks (`picked_tokens`, `upper_share_tokens`) beside the message and reply
  (`upper_tokens` counts both), with `TIERED_REPLY_ROOM` free slots past them, and one more block in flight: a
  round crossing from host memory (the tier is filled a round at a time, `largest_round`) or the open round's
  slots set aside while the tier grows (the tier lets its buffer go before it grows: it never holds two copies of
  itself); and every round's key bounds (one key in 32 twice over: the minimum and maximum of each block of the
  upper keys). The rest of the upper layers lives in host memory.
- `host` (`plan_host_resident`, for a per-layer budget policy, XKV, when the full cache does not fit): the chat's
  K/V stays in host memory (engine.kv.host_resident). A message streams it through the device one layer at a time,
  and the reply reads a working set of each layer's kept slots: the budget's share of the chat (at least the
  always-kept window) and the reply's room, in every layer. At its peak the device holds one layer of the whole chat
  staged beside that working set, as it is gathered. A restore places the chat in host memory: nothing on the device.
- `refused`: even the tiered cache does not fit (or the weights and workspace alone do not): a one-line message
  says how much is needed and how far the budget falls short.

Not planned (see docs/architecture.md, "The GPU memory budget"): a message too long for the room a chat was
opened with grows its cache by a copy (old and new side by side for a moment), and the tiered cache's upper tier
is not capped at its estimate when a reply brings in more rounds than it assumes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20

PREFILL_CHUNK = 4096  # tokens a prefill runs at once (engine.kv.cache.KVCache.prefill_prompt)
BAND_BYTES = (1 << 24) * 2  # engine.model.quantized.BAND_ELEMENTS bf16 weights
SHORT_PREFILL = 2048  # engine.model.quantized.SHORT_PREFILL: prompts this short take bands of SHORT_BAND_BYTES
SHORT_BAND_BYTES = 4 * BAND_BYTES
GRAPH_POOL = 32 * MIB  # a captured decode step's private pool, in whole allocator segments
ALLOCATOR_SLACK = 128 * MIB  # split blocks and cuBLAS's workspace; plus 1 MiB per weight tensor (rounding)
PREFETCH_WINDOW = 1 << 30  # storage.prefetch.SegmentPrefetcher.WINDOW_BYTES (engine/ may not import storage/)
TIERED_REPLY_ROOM = 512  # engine.kv.tiered.REPLY_ROOM: free upper slots past a message when the tier is laid out
KEY_BOUNDS_BLOCK = 32  # engine.kv.key_bounds.BLOCK: a block's minimum and maximum key per 32 tokens
ROPE_START = 1024  # the rotary tables' first size (engine.model.decoder.RotaryTable)


@dataclass(frozen=True)
class MemoryNeeds:
    """What a chat needs on the device, in bytes and tokens."""

    budget: int  # bytes kvchat may allocate on the device
    weights: int  # the model's tensors on the device (weight_bytes)
    workspace: int  # activations, logits, decode graphs, bands, rotary tables, slack (workspace_bytes)
    kv_per_token_layer: int  # one token's K and V in one layer (2 * Hkv * D * element size)
    layers: int
    tokens: int  # held on the device: the chat's, the new message's and the reply's room
    ring_layers: int = 0  # sliding-window layers of the full cache, each holding at most `ring_tokens`
    ring_tokens: int = 0
    split: int | None = None  # tiered: layers [0, split) resident for every token (None: not known yet)
    upper_tokens: int = 0  # tiered: tokens of the upper layers on the device (the picked rounds, the new tokens)
    picked_tokens: int = 0  # tiered: of those, the picked rounds'
    largest_round: int = 0  # tiered: the chat's largest round (the block in flight as the tier is filled)
    restore_window: int = PREFETCH_WINDOW  # the restore's segments in flight on the device, at most
    can_tier: bool = True  # False: no rounds to tier (a raw completion), the full cache or nothing
    budget_name: str = "--gpu-memory"  # how the message names the budget ("" : the card's free memory)


@dataclass(frozen=True)
class MemoryPlan:
    kind: str  # "full" | "tiered" | "host" | "refused"
    needed: int  # bytes at the peak under this plan (refused: the least any plan would need)
    budget: int
    kv: int  # K/V bytes on the device at the message's peak (tiered: lower, upper, staging and key bounds)
    message: str = ""  # one line: why it is tiered or refused ("" for full)

    @property
    def short(self) -> int:
        return max(0, self.needed - self.budget)


def gib(n: float) -> str:
    """Bytes as the messages write them: '4.6 GiB', '8 GiB' (MiB below one GiB)."""
    if n < GIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / GIB:.1f}".removesuffix(".0") + " GiB"


def budget_words(n: MemoryNeeds) -> str:
    return f"{n.budget_name} {gib(n.budget)}" if n.budget_name else f"the {gib(n.budget)} free on the GPU"


def plan_memory(n: MemoryNeeds) -> MemoryPlan:
    """The plan for `n`: the full cache if it fits, else the tiered cache if it fits, else refused. With `split`
    None, a chat that needs tiering comes back `tiered` if the least any split could need fits: the caller then
    learns the model's split (calibrating it, on its first use) and plans again with it."""
    base = n.weights + n.workspace
    if base > n.budget:
        return MemoryPlan("refused", base, n.budget, 0,
                          f"the model needs {gib(n.weights)} of GPU memory for its weights and {gib(n.workspace)} "
                          f"of workspace; {budget_words(n)} is {gib(base - n.budget)} short")
    full = full_kv(n)
    need = base + full + min(n.restore_window, full)  # the restore's peak: the K/V and its segments in flight
    if need <= n.budget:
        return MemoryPlan("full", need, n.budget, full)
    if not n.can_tier:
        return MemoryPlan("refused", need, n.budget, full,
                          f"{n.tokens:,} tokens of K/V ({gib(full)}) need {gib(need)} of GPU memory with the weights "
                          f"and workspace, {gib(need - n.budget)} more than {budget_words(n)}")

    def tiered_need(split: int) -> tuple[int, int]:
        lower, upper = tiered_kv(n, split)
        return base + max(lower + min(n.restore_window, lower), lower + upper), lower + upper

    # Without the split: the least any split would need (the caller learns the real one only if that fits).
    split = n.split or min(range(1, max(n.layers, 2)), key=lambda s: tiered_need(s)[0])
    t_need, t_kv = tiered_need(split)
    words = too_big_words(n)
    if t_need <= n.budget:
        where = f"layers below {split}" if n.split is not None else "its lower layers"
        amount = gib(t_kv) if n.split is not None else f"at least {gib(t_kv)}"  # the split is not known yet
        return MemoryPlan("tiered", t_need, n.budget, t_kv,
                          f"{words}; it runs on the tiered cache (Round Attention: {where} on the GPU, "
                          f"the rounds each message picks above), {amount} of K/V on the GPU")
    how = "(layers below {split} on the GPU) it needs" if n.split is not None else "it needs at least"
    return MemoryPlan("refused", t_need, n.budget, t_kv,
                      f"{words}: even on the tiered cache {how.format(split=split)} {gib(t_need)} "
                      f"({gib(n.weights)} weights, {gib(n.workspace)} workspace, {gib(t_need - base)} K/V at its "
                      f"peak), "
                      f"{gib(t_need - n.budget)} more than {budget_words(n)}")


def too_big_words(n: MemoryNeeds) -> str:
    """Why a chat is not planned on the full cache, as a message begins it."""
    return (f"the K/V of a {n.tokens:,}-token chat with its message and reply ({gib(full_kv(n))}) does not fit in "
            f"{budget_words(n)} beside the weights")


def host_resident_kv(n: MemoryNeeds, share: float, window: int, new_tokens: int) -> int:
    """A host-resident chat's K/V on the device at its peak: one layer of every token staged while the working set
    (each layer's kept input slots, `share` of the input and at least `window`, plus `new_tokens` of reply room) is
    gathered beside it."""
    inputs = max(n.tokens - new_tokens, 0)
    kept = min(inputs, max(math.ceil(share * inputs), window))
    return n.kv_per_token_layer * (n.tokens + n.layers * (kept + new_tokens))


def plan_host_resident(n: MemoryNeeds, share: float, window: int, new_tokens: int) -> MemoryPlan:
    """`host` if a chat whose K/V lives in host memory (a per-layer budget policy reading `share` of it, with an
    always-kept `window`; `new_tokens` of message and reply) fits the budget, else `refused` with what it needs."""
    base = n.weights + n.workspace
    kv = host_resident_kv(n, share, window, new_tokens)
    need = base + kv
    words = too_big_words(n)
    if need <= n.budget:
        return MemoryPlan("host", need, n.budget, kv,
                          f"{words}; it stays in host memory, each message streamed through the GPU one layer at "
                          f"a time and the reply reading {share:.0%} of it ({gib(kv)} of K/V on the GPU at most)")
    return MemoryPlan("refused", need, n.budget, kv,
                      f"{words}: kept in host memory it still needs {gib(need)} ({gib(n.weights)} weights, "
                      f"{gib(n.workspace)} workspace, {gib(kv)} K/V at its peak), {gib(need - n.budget)} more "
                      f"than {budget_words(n)}")


def full_kv(n: MemoryNeeds) -> int:
    """The full cache's K/V: every layer of every token (a sliding-window layer at most its ring)."""
    ring = min(n.tokens, n.ring_tokens) if n.ring_tokens else n.tokens
    return n.kv_per_token_layer * ((n.layers - n.ring_layers) * n.tokens + n.ring_layers * ring)


def tiered_kv(n: MemoryNeeds, split: int) -> tuple[int, int]:
    """The tiered cache's K/V on the device: (the lower tier, resident for every token; the upper tier at the
    message's peak: its tokens and free room, one block in flight, every round's key bounds)."""
    upper_layers = n.layers - split
    lower = n.kv_per_token_layer * split * n.tokens
    in_flight = max(n.largest_round, n.upper_tokens - n.picked_tokens)  # a round crossing, or the open round set aside
    upper = n.kv_per_token_layer * upper_layers * (n.upper_tokens + TIERED_REPLY_ROOM + in_flight)
    bounds = n.kv_per_token_layer * upper_layers * math.ceil(n.tokens / KEY_BOUNDS_BLOCK)
    return lower, upper + bounds


def upper_share_tokens(round_tokens: list[int], k: float = 0.1) -> int:
    """The tokens of the rounds a tiered chat's message may bring to the device above the split, at most: the first
    round (always kept) and the largest ceil(k·(R - 1)) others — Round Attention's top-k pick —, twice over
    (progressive selection brings in at most as many again while the reply is written)."""
    if not round_tokens:
        return 0
    rest = sorted(round_tokens[1:], reverse=True)
    count = min(len(rest), 2 * math.ceil(k * len(rest)))
    return round_tokens[0] + sum(rest[:count])


def workspace_bytes(cfg, act_bytes: int, tokens: int, quantized: bool, graphs: int = 1, weight_tensors: int = 0,
                    chunk: int = PREFILL_CHUNK) -> int:
    """The workspace of a message on a model of config `cfg` (engine.gguf.config.ModelConfig) with activations of
    `act_bytes` each, over a cache of `tokens` positions: the terms the module's docstring lists."""
    d, hd = cfg.d_model, cfg.head_dim
    per_token = 2 * d + (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd + 3 * cfg.ffn_dim
    def activations(n: int) -> int:
        return min(n, max(tokens, 1)) * per_token * act_bytes

    if quantized:  # a chunk's activations and bands, or a short prompt's and its larger bands
        prefill = max(activations(chunk) + 2 * BAND_BYTES,
                      activations(min(chunk, SHORT_PREFILL)) + 2 * SHORT_BAND_BYTES)
    else:
        prefill = activations(chunk)
    logits = cfg.vocab_size * (4 + 4 + 4 + 8)
    positions = max(ROPE_START, 1 << max(tokens - 1, 1).bit_length())
    rope = positions * hd * 4 * 2 * (2 if cfg.rope_base_swa else 1)
    slack = ALLOCATOR_SLACK + weight_tensors * MIB
    return prefill + logits + graphs * GRAPH_POOL + rope + slack


def weight_bytes(path: str | os.PathLike[str], device_type: str, dtype_bytes: int | None = None,
                 quantized: bool | None = None) -> tuple[int, int]:
    """(bytes, tensors) of a GGUF file's weights once loaded on a device of `device_type`, without loading them: as
    engine.gguf.loader.load_model places them (quantized matrices kept in their blocks on CUDA; the rest
    dequantized to `dtype_bytes`, bf16 on CUDA and fp32 on the CPU by default; vectors in fp32)."""
    from kvchat.engine.gguf.config import ModelConfig
    from kvchat.engine.gguf.loader import placed_bytes
    from kvchat.engine.gguf.reader import GGUFFile

    gf = GGUFFile(path)
    cuda = device_type == "cuda"
    return placed_bytes(gf, ModelConfig.from_gguf(gf), dtype_bytes or (2 if cuda else 4),
                        cuda if quantized is None else quantized)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": None, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'8GiB', '12GB', '8G', '7.5GiB', '8192MiB' -> bytes. Every unit is binary, as GPU memory is counted (a
    '12 GB' card has 12 GiB: nvidia-smi shows 12,288 MiB). ValueError, with the reason, for anything else."""
    m = _SIZE.match(text or "")
    if m is None:
        raise ValueError(f"{text!r} is not a size (write it as 8GiB, 12GB, 7.5G or 8192MiB)")
    number, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    if unit is None:
        raise ValueError(f"{text!r} has no unit (write it as 8GiB, 12GB, 7.5G or 8192MiB)")
    size = int(number * unit)
    if size <= 0:
        raise ValueError(f"{text!r} is no memory at all")
    return size


def size_words(n: int) -> str:
    """A budget as a user would write it back: '8GiB', '7.5GiB', '512MiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale and (n * 100) % scale == 0:
            return f"{n / scale:g}{unit}"
    return f"{n}B" if n < 1 << 10 else f"{n / MIB:.1f}MiB"


# ---- on the device


def free_bytes(device) -> tuple[int, int]:
    """(what the card has free for this process, its total): free memory plus what torch's allocator already holds
    here (cached blocks this process can reuse)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device), total


def cuda_index(device) -> int:
    """A CUDA device as its index: torch's memory-fraction call refuses a bare "cuda" (no index), which means the
    current device."""
    import torch

    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def device_budget(device, requested: int | None, name: str = "--gpu-memory") -> tuple[int, str]:
    """On CUDA `device`: cap torch's allocator at `requested` bytes (torch.cuda.set_per_process_memory_fraction),
    before the model loads, and return (the budget to plan with, its name for messages). Without a request, or with
    one above what the card has free, the budget is the free memory (named ""): no cap is set for it, the card
    itself enforces it."""
    import torch

    free, total = free_bytes(device)
    if requested is None:
        return free, ""
    torch.cuda.set_per_process_memory_fraction(min(1.0, requested / total), cuda_index(device))
    return (requested, name) if requested <= free else (free, "")
