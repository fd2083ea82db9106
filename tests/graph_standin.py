"""A CPU stand-in for CUDA graphs (engine.model.cuda_graph.GRAPHS), so that the capture and replay bookkeeping of
the decode steps runs in the CPU suite.

It keeps what a CUDA graph does to a step, not merely calls the step again:
- capture runs the step's two warm-ups as CUDA's path does, then runs it once more while recording every aten
  operation with its arguments as they are then: tensors by identity (a graph's fixed addresses), Python numbers
  by value (a kernel's launch arguments);
- replay() reruns the recorded operations on those same tensors without calling the step: each operation's fresh
  outputs are rewritten in place (a graph's private memory pool) and its in-place writes done again. What the step
  read from Python at capture (a length, a slot, a list) stays what it was then, as on the GPU, and a tensor that
  was replaced since (a grown cache, a grown rotary table) is not seen;
- the tensors the capture allocated are filled with NaN once it ends: a CUDA capture executes nothing, so what
  they hold before the first replay is garbage;
- a read of a device value on the host inside the capture (`.item()`, `bool(t)`, nonzero, boolean indexing)
  raises, as it breaks a CUDA capture.

What it cannot see: device-to-host copies (everything is on the CPU) and operations outside aten (a Triton kernel
in the interpreter); the steps run here take their torch paths (no TRITON_INTERPRET).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from kvchat.engine.model import cuda_graph
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# Operations whose result the host reads (a CUDA capture fails on the synchronisation they need).
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.equal.default, aten.is_nonzero.default, aten.unique_consecutive.default,
              aten._unique2.default, aten.repeat_interleave.Tensor}


class CaptureError(RuntimeError):
    pass


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _boolean_index(args) -> bool:
    """A boolean mask as an index: its result's size is the mask's count (nonzero), read on the host."""
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS or (func is aten.index.Tensor and _boolean_index(args)):
            raise CaptureError(f"{func} reads a device value on the host: a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in _tensors((args, kwargs)) if t.numel()}
        # Outputs that alias no input are the operation's own memory: rewritten at each replay.
        fresh = [i for i, t in enumerate(_tensors(out)) if t.numel() and _storage(t) not in inputs]
        self.ops.append((func, args, kwargs, out, fresh))
        return out


class RecordedGraph:
    """The operations of one capture, replayed on the tensors they were recorded with."""

    def __init__(self, ops: list[tuple]):
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, out, fresh in self.ops:
                new = func(*args, **kwargs)
                if not fresh:
                    continue
                old_ts, new_ts = _tensors(out), _tensors(new)
                for i in fresh:
                    if new_ts[i].shape != old_ts[i].shape:
                        raise CaptureError(f"{func} gave shape {tuple(new_ts[i].shape)} at replay, "
                                           f"{tuple(old_ts[i].shape)} at capture")
                    old_ts[i].copy_(new_ts[i])

    def poison(self) -> None:
        with torch.inference_mode():
            for _, _, _, out, fresh in self.ops:
                for i in fresh:
                    t = _tensors(out)[i]
                    if t.is_floating_point():
                        t.fill_(float("nan"))


class StandInGraphs(cuda_graph.CudaGraphs):
    """engine.model.cuda_graph.GRAPHS on the CPU; `graphs` lists every capture, in order."""

    def __init__(self):
        self.graphs: list[RecordedGraph] = []

    def takes(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def capture(self, fn, device):
        for _ in range(2):  # the warm-up runs, as on CUDA
            fn()
        recorder = _Recorder()
        with recorder:
            outputs = fn()
        graph = RecordedGraph(recorder.ops)
        graph.poison()
        self.graphs.append(graph)
        return graph, outputs


@contextmanager
def standin_graphs():
    """CUDA graphs on the CPU for the duration: yields the StandInGraphs (its `graphs`: the captures made)."""
    saved = cuda_graph.GRAPHS
    cuda_graph.GRAPHS = StandInGraphs()
    try:
        yield cuda_graph.GRAPHS
    finally:
        cuda_graph.GRAPHS = saved
