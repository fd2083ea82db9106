"""The one interface between generation and a KV cache: what engine.generate (and the CUDA-graph decode step,
engine.model.cuda_graph) may ask of a cache, so that neither ever names a concrete one.

Two caches implement it today: KVCache (engine.kv.cache: every layer's K/V on the device, sliding-window layers
optionally in rings) and TieredKV (engine.kv.tiered: Round Attention's lower layers of every round on the device,
the upper layers of the chosen rounds only). A new KV technique (per-layer budgets, retrieval, ...) plugs in here:
it implements KVStore, and generation, the chat session and the benchmarks drive it as they drive the others. What
differs between caches (how a prompt's tokens are placed and attended to, what a decode step runs and whether it is
captured in a CUDA graph, which rounds are kept) lives behind these methods, in the cache:

    length          tokens of the chat the cache holds (the next token's position, for a cache of one chat)
    prefill_prompt  run a prompt's tokens into the cache; the last one's logits [V]
    decode_step     the function token -> logits [V] that decodes the reply, the cache's own: it may reserve room,
                    capture CUDA graphs, or defer to a KV policy's step (engine.policies)
    truncate        forget every token from a position on (a retracted round, a regenerated reply)

DeviceKV is the layer-level half, for a cache whose K/V of every layer it holds sit in device tensors: the per-layer
read/write the decoder's layers and the restore paths use, and what a captured decode graph binds to. KVCache is
one; TieredKV is not (its upper tier lives per round in host memory) but keeps each of its two tiers in one.
The decoder (engine.model.decoder, engine.model.attention) reads KVCache's own layout (rings, slot positions)
when it attends: a cache with another device layout starts there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from kvchat.engine.model.attention import Attend
    from kvchat.engine.model.decoder import Transformer


@runtime_checkable
class KVStore(Protocol):
    """A chat's KV cache as generation drives it (see the module docstring)."""

    @property
    def length(self) -> int:
        """Tokens the cache holds."""
        ...

    def prefill_prompt(self, model: Transformer, tokens: list[int], attend: Attend = None,
                       chunk: int = 4096) -> Tensor:
        """Append `tokens` (at least one), `chunk` at a time, and return the last one's logits [V]. `attend`
        restricts what they see of the cache as it was before them, where the cache takes a view (a cache that
        chooses what its tokens see itself ignores it)."""
        ...

    def decode_step(self, model: Transformer, max_tokens: int, limit: int, *, attend: Attend = None,
                    first: int = 0, cuda_graph: bool | None = None, policy=None) -> Callable[[int], Tensor]:
        """The step token -> logits [V] that appends one token, for up to `max_tokens` tokens of a reply within a
        context of `limit`. `attend` is the view the prompt had of the cache as it was at slot `first`;
        `cuda_graph` (None: on CUDA) whether the step may be captured; `policy` a KVPolicy that may bring its own
        step. Built once per reply, after its first token."""
        ...

    def truncate(self, length: int) -> None:
        """Forget every token from position `length` on."""
        ...


@runtime_checkable
class DeviceKV(KVStore, Protocol):
    """A KVStore holding every layer's K/V it keeps in device tensors, in slots: what the decoder's layers read and
    write, and what a captured decode step runs over (engine.model.cuda_graph). Shapes: Hkv KV heads, D head size."""

    @property
    def capacity(self) -> int:
        """Slots [0, capacity) exist."""
        ...

    def reserve(self, n_slots: int) -> None:
        """Grow so that slots [0, n_slots) exist (the storage tensors may then be new ones)."""
        ...

    def layer(self, layer: int) -> Tensor:
        """K and V of one model layer, [2, Hkv, slots, D] (a view)."""
        ...

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """k, v [Hkv, T, D] written to slots [start, start + T) of one layer."""
        ...

    def read(self, layers: range, start: int, end: int) -> Tensor:
        """A copy of the K/V of slots [start, end) of `layers`: [len(layers), 2, Hkv, end - start, D]."""
        ...

    def write(self, layers: range, start: int, kv: Tensor) -> None:
        """Write back K/V as `read` returns them into slots from `start` on."""
        ...

    def storage(self) -> tuple[Tensor, ...]:
        """The tensors a captured decode graph reads and writes by address."""
        ...

    def keeping_slot(self, slot: int) -> ContextManager[None]:
        """Around a graph capture's warm-up runs, which really write K/V at `slot`: whatever that write overwrites
        is put back afterwards."""
        ...
