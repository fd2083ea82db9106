"""LoopServe's speed figures (`kvchat bench loopserve`): sparse against dense prefill, and progressive against
full-cache decode, each pair measured in the same run.

* attention: one layer's attention over a whole prefill, chunked as the engine prefills (4,096 tokens a chunk):
  dense SDPA against the vertical-slash kernel at set densities. The lines are synthetic but shaped like a trained
  model's (a local band, a few distant slashes, scattered verticals), because the speed depends only on how many
  there are and where; what density a real model's selection reaches is measured by the prefill figures.
* prefill: the model's whole prefill (time to first token of a chat read from scratch: a first open, a resume
  that recomputes), dense against the online selection (alpha), with the density the selection reached. On a
  random-weight model attention is nearly uniform and the selection keeps almost everything: the kernel then runs
  dense, and the figure says so.
* decode: tokens/s of the captured full-cache step against LoopServe's progressive step (budget B, re-chosen every
  16 tokens, the choices' cost included).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kvchat.engine.engine import Engine
from kvchat.engine.model.attention import BottomRightCausal, bottom_right_causal_attention
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.policies.loopserve import POOL
from kvchat.engine.policies.progressive_decode import ProgressiveDecode
from kvchat.engine.policies.sparse_prefill import SparsePrefill
from kvchat.engine.timing import timed_runs
from kvchat.kernels.sparse_prefill import block_size, build_index, slash_diagonals, sparse_prefill_attention

CHUNK = 4096  # engine.generate.prefill's chunk


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    fn()  # warm-up
    return timed_runs(fn, device, repeats)


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def shaped_lines(n_heads: int, n_keys: int, density: float, seed: int = 0, device="cpu"):
    """Vertical and slash lines [H, N] like a trained model's: a local band and the first keys (a sink) always,
    a few distant slashes, and scattered verticals making up the rest of `density` (a share of the keys)."""
    gen = torch.Generator().manual_seed(seed)
    verticals = torch.rand(n_heads, n_keys, generator=gen) < density
    verticals[:, :4] = True
    slashes = torch.zeros(n_heads, n_keys, dtype=torch.bool)
    slashes[:, :128] = True
    slashes.scatter_(1, torch.randint(0, n_keys, (n_heads, 4), generator=gen), True)
    return verticals.to(device), slashes.to(device)


@torch.inference_mode()
def attention_figures(n_heads: int, n_kv_heads: int, head_dim: int, context: int, densities: list[float],
                      device: torch.device, repeats: int = 5, dtype=torch.bfloat16) -> dict:
    """One layer's attention over a `context`-token prefill in engine chunks: dense SDPA, then the kernel at each
    density (the index built once per chunk and included)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(context, n_heads, head_dim, device=device, dtype=dtype, generator=gen)
    kv = torch.randn(2, n_kv_heads, context, head_dim, device=device, dtype=dtype, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    chunks = [(s, min(context, s + CHUNK)) for s in range(0, context, CHUNK)]

    def dense():  # as the engine's prefill attends
        for s, e in chunks:
            bottom_right_causal_attention(q[s:e].transpose(0, 1)[None], kv[0, :, :e][None], kv[1, :, :e][None],
                                          BottomRightCausal(e - s, e), scale=scale, enable_gqa=True)

    out = {"context": context, "dense": _summary(_timed(dense, device, repeats)), "sparse": []}
    for density in densities:
        block = block_size(head_dim)
        lines = [(v, slash_diagonals(sl, s, e - s, block))
                 for (s, e), (v, sl) in zip(chunks, (shaped_lines(n_heads, e, density, seed=s, device=device)
                                                    for s, e in chunks))]
        indices = []

        def sparse():
            indices.clear()
            for (s, e), (v, sl) in zip(chunks, lines):
                index = build_index(v, sl, s, e - s, block)
                indices.append(index.density())
                sparse_prefill_attention(q[s:e], kv[0, :, :e], kv[1, :, :e], index, scale)

        t = _summary(_timed(sparse, device, repeats))
        t["density"] = statistics.fmean(indices)
        t["target_density"] = density
        t["speedup"] = out["dense"]["median_s"] / t["median_s"]
        out["sparse"].append(t)
    return out


def chat_tokens(engine: Engine, context: int) -> torch.Tensor:
    """`context` tokens of a real chat (MT-Bench questions and answers in the model's template, as `kvchat bench`
    builds them): where attention has the structure sparse prefill relies on, unlike random tokens."""
    from kvchat.engine.data.workloads import mt_bench_workload

    work = mt_bench_workload(engine.chat, f"loopserve-{context}", seed=0, target=context + 512)
    tokens = [t for span in engine.chat.round_spans(work.conversation) for t in span]
    if len(tokens) < context:
        raise ValueError(f"the MT-Bench chat reached {len(tokens)} tokens, short of {context}")
    return torch.tensor(tokens[:context])


def decode_rates(cache, context: int, make_step, device: torch.device, repeats: int, decode_tokens: int) -> list[float]:
    """Tokens/s of `decode_tokens` greedy steps after the cache's first `context` slots, `repeats` times (after one
    run that warms up), the step made (a graph captured) by `make_step()` before the clock starts."""
    rates = []
    for run in range(repeats + 1):
        cache.length = context
        step = make_step()
        token = 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            token = int(torch.argmax(step(token)))  # the host sync a real decode loop has
        if run:  # the first run warms up
            rates.append(decode_tokens / (time.perf_counter() - t0))
    return rates


@dataclass
class ModelFigures:
    model: str
    device: str
    contexts: list[dict] = field(default_factory=list)


@torch.inference_mode()
def prefill_and_decode(engine: Engine, context: int, repeats: int = 3, alpha: float = 0.955, budget: int = 1024,
                       decode_tokens: int = 128) -> dict:
    model, device = engine.model, engine.device
    tokens = chat_tokens(engine, context)
    capacity = context + decode_tokens + 2

    def prefill():
        cache = model.new_cache(capacity)
        for s in range(0, context, CHUNK):
            logits = model(tokens[s : s + CHUNK], cache)
        return cache, logits

    sparse = SparsePrefill(alpha, min_keys=0)
    figures: dict = {"context": context}
    for name, setting in (("dense", None), ("sparse", sparse)):
        model.sparse_prefill = setting
        try:
            figures[f"prefill_{name}"] = _summary(_timed(prefill, device, repeats))
        finally:
            model.sparse_prefill = None
    figures["prefill_speedup"] = figures["prefill_dense"]["median_s"] / figures["prefill_sparse"]["median_s"]
    figures["selection"] = sparse.stats.as_dict()
    cache, _ = prefill()

    def decode_times(make_step) -> list[float]:
        return decode_rates(cache, context, make_step, device, repeats, decode_tokens)

    figures["decode_full_tok_s"] = decode_times(lambda: decoder_step(model, cache, capacity, None))
    figures["decode_progressive_tok_s"] = decode_times(
        lambda: ProgressiveDecode(model, cache, context, capacity, budget=budget, pool=POOL))
    figures["decode_speedup"] = (statistics.median(figures["decode_progressive_tok_s"])
                                 / statistics.median(figures["decode_full_tok_s"]))
    figures["budget"] = budget
    return figures


def bench_model(engine: Engine, contexts: list[int], repeats: int = 3, log=print, **options) -> ModelFigures:
    figures = ModelFigures(str(engine.path), torch.cuda.get_device_name(engine.device)
                           if engine.device.type == "cuda" else "cpu")
    for context in contexts:
        f = prefill_and_decode(engine, context, repeats, **options)
        figures.contexts.append(f)
        log(f"  {context} tokens: prefill dense {context / f['prefill_dense']['median_s']:,.0f} tok/s, sparse "
            f"{context / f['prefill_sparse']['median_s']:,.0f} tok/s ({f['prefill_speedup']:.2f}x; selection density "
            f"{f['selection']['density']:.2f}, {f['selection']['dense_heads']}/{f['selection']['heads']} heads "
            f"dense); decode full {statistics.median(f['decode_full_tok_s']):.1f} tok/s, progressive "
            f"{statistics.median(f['decode_progressive_tok_s']):.1f} tok/s ({f['decode_speedup']:.2f}x)")
    return figures


def as_dict(figures: ModelFigures) -> dict:
    return asdict(figures)
