"""Decode steps replayed from a captured CUDA graph.

Eager decode launches ~25 kernels per layer from Python; for an 8B model that host work, not the GPU, sets the
speed. The step is captured once for a cache of fixed storage and replayed per token: one launch. Everything that
changes from token to token (the token, its position, its cache slot, how many slots it attends to) is in a device
tensor the graph reads, and attention goes through kernels.decode_attention, which takes the length from the
device: one graph serves every length up to the cache's capacity, and is kept for the next reply while the cache's
storage and the rotary table stay the same.

`capture=False` runs the very same step without a graph (any device): the tests check the kernel path that way on
the CPU, in Triton's interpreter. CudaGraphs (`GRAPHS`) is the one place that calls CUDA's graph API: the tests
replace it with a CPU stand-in that replays the captured operations (tests/graph_standin.py), so that the capture
and replay bookkeeping runs without a GPU.

The step runs over any DeviceKV (engine.kv.base): it binds to the tensors `cache.storage()` names.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from typing import Callable

import torch
from kvchat.engine.kv.base import DeviceKV
from kvchat.engine.model.attention import DecodeStep
from kvchat.engine.model.decoder import Transformer
from torch import Tensor


class StepInputs:
    """The next token, its position, and per cache its slot and attended length, in one device tensor set with
    one host-to-device copy."""

    def __init__(self, device: torch.device, n_caches: int = 1):
        self.values = torch.zeros(2 + 2 * n_caches, dtype=torch.long, device=device)
        self.token, self.position = self.values[0:1], self.values[1:2]

    def slot(self, cache: int) -> Tensor:
        return self.values[2 + 2 * cache : 3 + 2 * cache]

    def length(self, cache: int) -> Tensor:
        return self.values[3 + 2 * cache : 4 + 2 * cache]

    def step(self, model: Transformer, cache: int = 0) -> DecodeStep:
        return DecodeStep(self.slot(cache), self.position, self.length(cache), model.gather_rotations(self.position))

    def set(self, token: int, position: int, *slots: int) -> None:
        """The token at `position`, written to `slots` (one per cache), attending to every slot up to its own."""
        values = [token, position]
        for slot in slots:
            values += [slot, slot + 1]
        self.values[: len(values)].copy_(torch.tensor(values))

    def set_slot(self, cache: int, slot: int) -> None:
        self.values[2 + 2 * cache : 4 + 2 * cache].copy_(torch.tensor([slot, slot + 1]))


class CudaGraphs:
    """How Replay captures: two warm-up runs on a side stream, then the capture into a torch.cuda.CUDAGraph, whose
    replay() reruns the captured kernels on the same tensors. The one place that touches CUDA's graph API, so that
    the tests can put a stand-in in its place (`GRAPHS`) and run the capture and replay bookkeeping on the CPU."""

    def takes(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def capture(self, fn: Callable[[], object], device: torch.device) -> tuple[object, object]:
        """(a graph with replay(), fn's outputs: the tensors every replay writes)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up runs (they really execute: callers point them at harmless slots)
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during the capture: a graph in some reference cycle, freed by the cycle collector
        # inside the capture, would free its memory pool there, which CUDA refuses while a stream captures ("operation
        # not permitted when stream is capturing": seen when one process decoded under several KV budgets at 32k,
        # before Replay held its step weakly). Collected after instead, whenever the collector next runs.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: a KV writer thread may be using the GPU on its own stream while we capture.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = fn()
        finally:
            if collecting:
                gc.enable()
        return graph, outputs


GRAPHS = CudaGraphs()


class Replay:
    """`fn` (no arguments, device tensors in and out) captured in a CUDA graph and replayed, or with capture=False
    simply called.

    A bound method is held weakly: its object owns this replay (a decode step's `self._replay = Replay(self._step,
    ...)`), and a strong reference back would make a cycle that only Python's cycle collector frees. Until it runs,
    the step, the KV cache it holds (gigabytes at 32k) and the graph's memory pool would stay on the GPU after the
    step and its cache were dropped; under --gpu-memory the next chat's cache then ran out of memory."""

    def __init__(self, fn: Callable[[], object], device: torch.device, capture: bool = True):
        self._fn = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self.graph, self.outputs = None, None
        if not capture:
            return
        if not GRAPHS.takes(device):
            raise ValueError("CUDA graphs need a CUDA model")
        self.graph, self.outputs = GRAPHS.capture(fn, device)

    @property
    def fn(self) -> Callable[[], object]:
        fn = self._fn()
        if fn is None:
            raise RuntimeError("the decode step this replay ran is gone")
        return fn

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs


class Bound:
    """Weak references to the tensors a captured graph reads and writes by address: the graph is valid while they
    are exactly these tensors (a grown cache or rotary table is a new tensor; an old one may be freed meanwhile)."""

    def __init__(self, *tensors: Tensor):
        self.refs = tuple(weakref.ref(t) for t in tensors)

    def holds(self, *tensors: Tensor) -> bool:
        return len(tensors) == len(self.refs) and all(ref() is t for ref, t in zip(self.refs, tensors))


class GraphedDecode:
    """The full cache's decode step, replayed. It is kept on its cache (`graphed_decode`) for the next reply, and
    holds the cache weakly: a strong reference back would keep a dropped cache alive until the cycle collector runs
    (see Replay)."""

    def __init__(self, model: Transformer, cache: DeviceKV, capacity: int, capture: bool = True):
        self.model, self._cache = model, weakref.ref(cache)
        cache.reserve(capacity)  # the graph is bound to this storage: it must not grow while in use
        model.reserve_rotations(cache.capacity)
        self._bound = Bound(*cache.storage(), model.rope.c_table)
        self.inputs = StepInputs(model.device)
        # Warm-up runs really execute: point them at the last slot, which no token holds yet.
        self.inputs.set(0, cache.capacity - 1, cache.capacity - 1)
        with cache.keeping_slot(cache.capacity - 1):
            self._replay = Replay(self._step, model.device, capture)

    @property
    def cache(self) -> DeviceKV:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the KV cache of this decode step is gone")
        return cache

    def fits(self, cache: DeviceKV, capacity: int) -> bool:
        """Whether this graph can serve `cache` up to `capacity` slots (same storage, same rotary table)."""
        return (cache is self._cache() and self._bound.holds(*cache.storage(), self.model.rope.c_table)
                and capacity <= cache.capacity)

    @torch.inference_mode()
    def _step(self) -> Tensor:
        m = self.model
        h = m.run_layers(m.embed(self.inputs.token), None, self.cache, None, step=self.inputs.step(m))
        return m.head(h)

    def __call__(self, token: int, position: int | None = None) -> Tensor:
        """Append one token at the next slot (its position defaults to the slot) and return its logits [V]."""
        if not self.fits(self.cache, self.cache.length + 1):
            raise RuntimeError("the KV cache outgrew the captured decode graph")
        slot = self.cache.length
        self.inputs.set(token, slot if position is None else position, slot)
        logits = self._replay()
        self.cache.length = slot + 1
        return logits[-1]


def graphed_decode(model: Transformer, cache: DeviceKV, capacity: int) -> GraphedDecode:
    """The cache's captured decode step, captured again only when its storage or the rotary table changed or it
    needs more slots (capturing costs a few eager steps)."""
    graphed = getattr(cache, "graphed_decode", None)
    if graphed is None or not graphed.fits(cache, capacity):
        cache.graphed_decode = None  # free the old graph's memory before capturing the new one
        graphed = cache.graphed_decode = GraphedDecode(model, cache, capacity)
    return graphed


def decoder_step(model: Transformer, cache: DeviceKV, capacity: int, cuda_graph: bool | None):
    """One decode step as a function token -> logits [V]: replayed from a CUDA graph on CUDA, eager otherwise."""
    if cuda_graph is None:
        cuda_graph = model.device.type == "cuda"
    if cuda_graph:
        return graphed_decode(model, cache, capacity)
    return lambda token: model(torch.tensor([token]), cache)[-1]
