"""Probe: do weights kept in their GGUF blocks give the same answers as the same file dequantized at load?

One GGUF file is loaded twice, one model on the device at a time: dequantized at load (`quantized=False`, the
reference) and kept in its blocks (`quantized=True`, engine.model.quantized). Both read the same token sequence,
teacher-forced (random token ids from a fixed seed, or the reference's own greedy continuation of a random prefix):
- prefill: one pass over all POSITIONS tokens, the logits of every position (a prefill's products dequantize a band
  of rows at a time and multiply with cuBLAS);
- decode: the last DECODE of those tokens again, one at a time after the rest (the cache cut back to them), through
  the decode step a reply runs (CUDA graph on CUDA): its one-row products run the quantized GEMVs
  (kernels/quant_gemv.py), the reference's the bf16 GEMV. Each path is compared with the reference's same path.
Per path it prints the top-1 agreement over the positions where the reference's two top logits are more than
MARGIN apart (near-ties flip on any change of summation order), how many such positions there are, the agreement
over all positions, and the max and mean |logit difference| over every position and vocabulary entry.

    python3 docs/probes/quant_agreement.py MODEL.gguf                  # on CUDA; prints one JSON object
    python3 docs/probes/quant_agreement.py --shape llama-3.1-8b --qtype Q4_K_M --cache-dir /tmp/bench-models
(the bench's random model, built there first if missing; with the package importable as kvchat, as
docs/gpu/quant-weights.sh sets it up). Both paths use numerics "exact" (the same weights, no llama.cpp rounding).
On the CPU the quantized decode runs the kernels only under TRITON_INTERPRET=1 (else it dequantizes bands too).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from kvchat.engine.gguf.loader import load_model
from kvchat.engine.model.cuda_graph import decoder_step

POSITIONS, DECODE, MARGIN = 1000, 200, 0.05


def compare(reference: Tensor, got: Tensor, margin: float = MARGIN) -> dict:
    """Logits [P, V] of one path against the reference's: top-1 agreement where the reference's top-2 margin
    exceeds `margin` (None if no position does), over all positions, and |logit difference| max and mean."""
    reference, got = reference.float(), got.to(reference.device).float()
    top2 = reference.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > margin
    agree = reference.argmax(-1) == got.argmax(-1)
    diff = (reference - got).abs()
    n_confident = int(confident.sum())
    return {
        "positions": reference.shape[0],
        "confident_positions": n_confident,
        # counted, not averaged in float32 (whose mean of 246 ones on CUDA came to 0.99999994)
        "top1_agreement": int(agree[confident].sum()) / n_confident if n_confident else None,
        "confident_disagreements": int((confident & ~agree).sum()),
        "top1_agreement_all_positions": int(agree.sum()) / agree.numel(),
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
    }


@torch.inference_mode()
def path_logits(model, tokens: Tensor, decode: int, cuda_graph: bool | None = None) -> tuple[Tensor, Tensor]:
    """(prefill logits [P, V] of every position of `tokens` [P] in one pass, decode logits [decode, V] of its last
    `decode` tokens fed one at a time after the cache is cut back to the rest), on the model's device in fp32."""
    n = tokens.shape[0]
    cache = model.new_cache(n + 1)
    prefill = model(tokens, cache, all_logits=True).float()
    # The first n - decode positions' K/V are what a prefill of them alone writes (causal): keep them.
    cache.truncate(n - decode)
    step = decoder_step(model, cache, n + 1, cuda_graph)
    out = torch.empty(decode, prefill.shape[-1], dtype=torch.float32, device=prefill.device)
    for i, token in enumerate(tokens[n - decode:].tolist()):
        out[i].copy_(step(token))  # a captured step's logits are its graph's buffer: copied before the next replay
    cache.graphed_decode = None  # the graph (which holds the cache) goes with it
    return prefill, out


@torch.inference_mode()
def greedy_tokens(model, prefix: Tensor, n: int, cuda_graph: bool | None = None) -> Tensor:
    """`prefix` [k] and the model's greedy continuation of it, n tokens in all."""
    cache = model.new_cache(n + 1)
    tokens = prefix.tolist()
    logits = model(prefix, cache)[-1]
    step = decoder_step(model, cache, n + 1, cuda_graph)
    while len(tokens) < n:
        tokens.append(int(torch.argmax(logits)))
        if len(tokens) < n:
            logits = step(tokens[-1])
    cache.graphed_decode = None
    return torch.tensor(tokens)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def agreement(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
              positions: int = POSITIONS, decode: int = DECODE, margin: float = MARGIN, seed: int = 0,
              source: str = "random", cuda_graph: bool | None = None,
              log: Callable[[str], None] = lambda line: None) -> dict:
    """The probe's figures for one file (see the module's doc): a dict, JSON-ready."""
    if not 0 < decode < positions:
        raise ValueError(f"decode ({decode}) must be between 0 and positions ({positions})")
    if source not in ("random", "greedy"):
        raise ValueError(f"unknown token source {source!r} (accepted: random, greedy)")
    started = time.perf_counter()

    def load(quantized: bool):
        loaded = load_model(path, device, dtype, numerics="exact", quantized=quantized)
        if loaded.config.context_length and positions + 1 > loaded.config.context_length:
            raise ValueError(f"{positions} positions do not fit the model's context of {loaded.config.context_length}")
        return loaded

    loaded = load(False)
    model, cfg = loaded.model, loaded.config
    dev = model.device
    log(f"dequantized at load: {loaded.load_seconds:.1f} s on {dev}, {model.dtype}")
    gen = torch.Generator().manual_seed(seed)
    if source == "random":
        tokens = torch.randint(0, cfg.vocab_size, (positions,), generator=gen)
    else:
        tokens = greedy_tokens(model, torch.randint(0, cfg.vocab_size, (16,), generator=gen), positions, cuda_graph)
    reference = path_logits(model, tokens, decode, cuda_graph)
    dtype_name = str(model.dtype).removeprefix("torch.")
    del model, loaded
    _free(dev)

    from kvchat.app.bench.engine_speed import quantized_matrices

    loaded = load(True)
    model = loaded.model
    kept = quantized_matrices(model)
    log(f"kept in blocks: {loaded.load_seconds:.1f} s, {len(kept)} matrices ({sum(m.nbytes for m in kept) / 2**30:.2f} "
        f"GiB) in their blocks")
    got = path_logits(model, tokens, decode, cuda_graph)
    result = {
        "file": str(path), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype_name, "positions": positions, "decode_positions": decode, "margin": margin, "seed": seed,
        "source": source, "cuda_graph": dev.type == "cuda" if cuda_graph is None else cuda_graph,
        "matrices_kept_quantized": len(kept), "quantized_gib": sum(m.nbytes for m in kept) / 2**30,
        "dequantized_types": list(loaded.dequantized_types),
        "prefill": compare(reference[0], got[0], margin),
        "decode": compare(reference[1], got[1], margin),
    }
    del model, loaded, got, reference
    _free(dev)
    result["seconds"] = time.perf_counter() - started
    return result


def float32_floor(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                  positions: int = POSITIONS, decode: int = DECODE, margin: float = MARGIN, seed: int = 0,
                  cuda_graph: bool | None = None, log: Callable[[str], None] = lambda line: None) -> dict:
    """What `dtype` itself costs: both paths in `dtype` against the dequantized path in float32 (the exact
    answer), on the same random tokens. If the quantized path agrees with float32 as often as the dequantized one
    does, the disagreement between the two in `dtype` is `dtype`'s rounding, not the kernels'."""
    tokens = torch.randint(0, 1 << 30, (positions,), generator=torch.Generator().manual_seed(seed))
    results, reference = {}, None
    for name, as_dtype, quantized in (("float32 dequantized", torch.float32, False),
                                      ("dequantized", dtype, False), ("quantized", dtype, True)):
        loaded = load_model(path, device, as_dtype, numerics="exact", quantized=quantized)
        model = loaded.model
        logits = path_logits(model, tokens % loaded.config.vocab_size, decode, cuda_graph)
        dev = model.device
        del model, loaded
        _free(dev)
        if reference is None:
            reference = logits
            continue
        results[name] = {"prefill": compare(reference[0], logits[0], margin),
                         "decode": compare(reference[1], logits[1], margin)}
        log(f"{name} in {dtype} against float32: {results[name]['prefill']['top1_agreement']:.4f} (prefill), "
            f"{results[name]['decode']['top1_agreement']:.4f} (decode)")
    return {"file": str(path), "dtype": str(dtype).removeprefix("torch."), "positions": positions,
            "decode_positions": decode, "margin": margin, "seed": seed, "against_float32": results}


def main(argv: list[str] | None = None) -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF file (else --shape and --qtype: the bench's random model)")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--cache-dir", default="/tmp/bench-models", help="where the bench keeps its random models")
    ap.add_argument("--positions", type=int, default=POSITIONS)
    ap.add_argument("--decode", type=int, default=DECODE)
    ap.add_argument("--margin", type=float, default=MARGIN)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", choices=["random", "greedy"], default="random")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="activations (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--eager", action="store_true", help="decode without a CUDA graph")
    ap.add_argument("--float32-floor", action="store_true",
                    help="instead: both paths in --dtype (default bf16) against the dequantized one in float32")
    args = ap.parse_args(argv)
    if args.model:
        path = Path(args.model)
    else:
        from kvchat.app.bench.engine_speed import model_file

        path = model_file(Path(args.cache_dir), args.shape, args.qtype)
    if args.float32_floor:
        result = float32_floor(path, getattr(torch, args.dtype or "bfloat16"), args.device, args.positions,
                               args.decode, args.margin, args.seed, False if args.eager else None,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(result, indent=2))
        return
    result = agreement(path, args.device, getattr(torch, args.dtype) if args.dtype else None, args.positions,
                       args.decode, args.margin, args.seed, args.source, False if args.eager else None,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
