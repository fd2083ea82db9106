"""Engine-level speed figures: load time, prefill and decode tokens/s at given context lengths, peak GPU memory (the
whole run's, and each context's apart).

Models are random-weight GGUF files shaped like public ones (engine.train.synthetic.SHAPES), built once and kept in a
cache folder, so the figures need no download and measure exactly the code a user runs. Quantized ones (`QTYPES`)
are the BF16 file put through llama.cpp's own quantizer, as a downloaded Q4_K_M or Q8_0 file was made.
"""

from __future__ import annotations

import gc
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType as Q

from kvchat.engine.engine import Engine
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.timing import timed_runs
from kvchat.engine.train.synthetic import LLAMA_FTYPE_Q4_K_M, SHAPES, llama_quantize, make_shaped_model

# The quantized file types the bench makes, by llama.cpp's LLAMA_FTYPE_MOSTLY_* number (llama.h; llama_cpp's
# LLAMA_FTYPE_MOSTLY_Q8_0 = 7, _Q4_K_M = 15, _Q5_K_M = 17, _Q6_K = 18): each of its own mix, as llama-quantize
# makes it (not pure: the _M types keep some matrices in a larger type; 1-d tensors stay F32).
QTYPES = {"Q4_K_M": LLAMA_FTYPE_Q4_K_M, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}


@dataclass
class ContextFigures:
    context: int
    prefill_tokens_per_s: float
    prefill_seconds: float
    decode_tokens_per_s: float
    decode_ms_per_token: float
    eager_decode_tokens_per_s: float | None = None
    cache_mib: float = 0.0  # the KV cache's device memory (capacity: the context and the decoded tokens)
    # CUDA: the peak while this context was measured (its prefills and decode, CUDA graph; the model included),
    # allocated by tensors and reserved by the caching allocator, the allocator's cache emptied first
    peak_gpu_gib: float | None = None
    peak_reserved_gib: float | None = None
    # A model with sliding-window layers (Gemma 3), measured again with those layers in rings (KVCache(ring=True))
    ring: "ContextFigures | None" = None


@dataclass
class ShapeFigures:
    shape: str
    qtype: str
    device: str
    dtype: str
    file_bytes: int
    load_seconds: float
    weights_gib: float
    cold_load: bool = False
    peak_gpu_gib: float | None = None
    contexts: list[ContextFigures] = field(default_factory=list)
    weights: str = "dequantized"  # "quantized": matrices kept in their GGUF blocks (engine.model.quantized)
    # Quant types of this file without a decode kernel, dequantized at load although the rest stays in its blocks
    dequantized_types: list[str] = field(default_factory=list)


def model_file(cache_dir: Path, shape: str, qtype: str = "BF16") -> Path:
    """The random model for `shape` in `qtype` (BF16 or one of QTYPES, quantized from the BF16 file), built on first
    use."""
    if qtype != "BF16" and qtype not in QTYPES:
        raise ValueError(f"unknown benchmark type {qtype!r} (accepted: BF16, {', '.join(QTYPES)})")
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{shape}-{qtype}.gguf"
    if path.exists():
        return path
    if qtype == "BF16":
        make_shaped_model(path.with_suffix(".tmp"), shape, Q.BF16).rename(path)
    else:
        src = model_file(cache_dir, shape, "BF16")
        llama_quantize(src, path.with_suffix(".tmp"), QTYPES[qtype], keep_output_f32=False, pure=False)
        path.with_suffix(".tmp").rename(path)
    return path


def _median_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    return statistics.median(timed_runs(fn, device, repeats))


@torch.inference_mode()
def measure_context(engine: Engine, context: int, decode_steps: int = 64, repeats: int = 3,
                    cuda_graph: bool | None = None, ring: bool = False) -> ContextFigures:
    """Prefill of `context` random tokens (one pass, as generate's first chunk of up to 4k and a bench's long
    context do not differ in kind) and `decode_steps` decoded after it; `ring`: sliding-window layers in rings."""
    model, device = engine.model, engine.device
    gen = torch.Generator().manual_seed(context)
    tokens = torch.randint(0, engine.config.vocab_size, (context,), generator=gen)

    def prefill_once():
        cache = model.new_cache(context + decode_steps + 1, ring=ring)
        h = model.run_layers(model.embed(tokens), torch.arange(context), cache, 0)
        model.head(h[-1:])

    prefill_once()  # warm-up (kernels, allocator)
    prefill_s = _median_seconds(prefill_once, device, repeats)

    cache = model.new_cache(context + decode_steps + 1, ring=ring)
    model(tokens, cache)
    step = decoder_step(model, cache, context + decode_steps + 1, cuda_graph)

    def decode_run():
        cache.truncate(context)
        token = 1
        for _ in range(decode_steps):
            token = int(torch.argmax(step(token)))  # the same host sync a real decode loop has

    decode_run()
    decode_s = _median_seconds(decode_run, device, repeats)
    return ContextFigures(context, context / prefill_s, prefill_s, decode_steps / decode_s,
                          1000 * decode_s / decode_steps,
                          cache_mib=cache.device_bytes() / 2**20)


def drop_page_cache() -> bool:
    """Ask Linux to forget cached file pages, so the next load reads the disk (needs root; False if refused)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def bench_shape(cache_dir: Path, shape: str, contexts: list[int], qtype: str = "BF16",
                device: str | None = None, log: Callable[[str], None] = print, cold: bool = False,
                quantized: bool | None = None, int8_activations: bool = True) -> ShapeFigures:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
    return bench_file(model_file(cache_dir, shape, qtype), shape, qtype, contexts, device, log, cold, quantized,
                      int8_activations)


def bench_file(path: Path, name: str, qtype: str, contexts: list[int], device: str | None = None,
               log: Callable[[str], None] = print, cold: bool = False, quantized: bool | None = None,
               int8_activations: bool = True) -> ShapeFigures:
    """Load, prefill and decode figures of one model file (`name`, `qtype`: how to report it); `quantized`: keep
    its matrices in their blocks (default: the engine's, on CUDA); `int8_activations` off: their one-row products
    take the float GEMVs (kernels.quant_gemv) rather than the integer ones (kernels.quant_dot)."""
    shape = name
    dropped = drop_page_cache() if cold else False
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)  # this file's peak, not an earlier engine's
    engine = Engine(path, device=device, quantized=quantized)
    dev = engine.device
    kept = quantized_matrices(engine.model)
    for matrix in kept:
        matrix.int8_activations = int8_activations
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) + sum(m.nbytes for m in kept)
    figures = ShapeFigures(shape, qtype, _device_name(dev), str(engine.dtype).removeprefix("torch."),
                           path.stat().st_size, engine.load_seconds, weights / 2**30, cold_load=dropped,
                           weights=("quantized" if int8_activations else "quantized, float GEMVs") if kept
                           else "dequantized",
                           dequantized_types=list(engine.dequantized_types))
    log(f"{shape} {qtype}, weights {figures.weights}: loaded in {engine.load_seconds:.2f} s "
        f"{'(page cache dropped first) ' if dropped else ''}"
        f"({figures.file_bytes / 2**30:.2f} GiB file, {figures.weights_gib:.2f} GiB of weights on the device)"
        + (f"; {', '.join(figures.dequantized_types)} matrices dequantized at load (no decode kernel)"
           if figures.dequantized_types else ""))
    run_peak = _Peaks(dev)
    for ctx in contexts:
        run_peak.start_context()
        c = measure_context(engine, ctx)
        c.peak_gpu_gib, c.peak_reserved_gib = run_peak.context_peaks()
        figures.contexts.append(c)
        line = f"  ctx {ctx}: prefill {c.prefill_tokens_per_s:,.0f} tok/s, decode {c.decode_tokens_per_s:,.1f} tok/s"
        if dev.type == "cuda":
            eager = measure_context(engine, ctx, cuda_graph=False)
            c.eager_decode_tokens_per_s = eager.decode_tokens_per_s
            line += f" (eager, no CUDA graph: {eager.decode_tokens_per_s:,.1f})"
        line += f", KV cache {c.cache_mib:,.1f} MiB"
        if c.peak_gpu_gib is not None:
            line += f", peak GPU {c.peak_gpu_gib:.2f} GiB ({c.peak_reserved_gib:.2f} GiB reserved)"
        if engine.config.sliding_window:
            c.ring = r = measure_context(engine, ctx, ring=True)
            line += (f"; window layers in rings: prefill {r.prefill_tokens_per_s:,.0f} tok/s, decode "
                     f"{r.decode_tokens_per_s:,.1f} tok/s, KV cache {r.cache_mib:,.1f} MiB "
                     f"({r.cache_mib / c.cache_mib:.3f}x)")
        log(line)
    figures.peak_gpu_gib = run_peak.whole_run()
    del engine
    for line in figures_table(figures):
        log(line)
    return figures


class _Peaks:
    """Peak GPU memory per context, and over the whole run (load included) although each context resets the
    allocator's peak: the largest peak seen before each reset is kept. Off CUDA every figure is None."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.run = 0

    def _seen(self) -> int:
        self.run = max(self.run, torch.cuda.max_memory_allocated(self.device))
        return self.run

    def start_context(self) -> None:
        if self.device is None:
            return
        self._seen()
        gc.collect()
        torch.cuda.empty_cache()  # the reserved peak is then this context's, not cached blocks of the last one
        torch.cuda.reset_peak_memory_stats(self.device)

    def context_peaks(self) -> tuple[float | None, float | None]:
        if self.device is None:
            return None, None
        return (torch.cuda.max_memory_allocated(self.device) / 2**30,
                torch.cuda.max_memory_reserved(self.device) / 2**30)

    def whole_run(self) -> float | None:
        return None if self.device is None else self._seen() / 2**30


def figures_table(figures: ShapeFigures) -> list[str]:
    """One file's figures as a Markdown table: a row per context."""
    head = (f"{figures.shape} {figures.qtype}, weights {figures.weights} ({figures.weights_gib:.2f} GiB), "
            f"{figures.device}:")
    rows = ["| context | prefill tok/s | decode tok/s | eager decode tok/s | KV cache MiB | peak GPU GiB allocated | "
            + "peak GPU GiB reserved |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def num(value, fmt):
        return "" if value is None else format(value, fmt)

    for c in figures.contexts:
        rows.append(f"| {c.context:,} | {c.prefill_tokens_per_s:,.0f} | {c.decode_tokens_per_s:,.1f} | "
                    f"{num(c.eager_decode_tokens_per_s, ',.1f')} | {c.cache_mib:,.1f} | {num(c.peak_gpu_gib, '.2f')} | "
                    f"{num(c.peak_reserved_gib, '.2f')} |")
    tail = ([] if figures.peak_gpu_gib is None
            else [f"peak GPU memory over the whole run: {figures.peak_gpu_gib:.2f} GiB"])
    return [head, *rows, *tail]


def quantized_matrices(model) -> list:
    """The model's matrices kept in their GGUF blocks (engine.model.quantized.QuantizedMatrix)."""
    from kvchat.engine.model.quantized import QuantizedMatrix

    held = [model.tok_embeddings, model.output] + [getattr(layer, name) for layer in model.layers
                                                   for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    return [m for m in held if isinstance(m, QuantizedMatrix)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def as_dict(figures: ShapeFigures) -> dict:
    return asdict(figures)
