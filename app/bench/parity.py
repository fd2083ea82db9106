"""llama.cpp (through llama-cpp-python) as the yardstick: logits and greedy tokens for the same GGUF file, and the
comparison of our engine against them (used by the reference tests and by `kvchat bench parity`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.text.tokenizer import quiet_llama_logs


def _llama(path: Path, n_ctx: int):
    from llama_cpp import Llama

    quiet_llama_logs()
    # F32 KV cache: llama.cpp's default F16 cache would round K/V, which is not what we compare against.
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=os.cpu_count(),
                 type_k=0, type_v=0, flash_attn=False, verbose=False)


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits [T, V] at every position."""
    llm = _llama(path, max(64, len(tokens)))
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def reference_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's greedy continuation, ignoring end-of-generation tokens (random models emit them anywhere)."""
    llm = _llama(path, len(prompt) + steps + 8)
    llm.eval(prompt)
    out = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref|: the measure the reference check bounds."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@dataclass
class Parity:
    path: str
    device: str
    dtype: str
    numerics: str
    relative_error: float
    greedy_steps: int
    greedy_agreeing: int  # leading greedy tokens identical to llama.cpp's


def ours_logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    return engine.model(torch.tensor(tokens), engine.new_cache(), all_logits=True).float().cpu().numpy()


def ours_greedy(engine: Engine, prompt: list[int], steps: int) -> list[int]:
    return generate(engine.model, engine.new_cache(ring=True), prompt, decoder=engine.tokenizer.stream_decoder(),
                    max_tokens=steps).tokens


def compare(path: Path, prompt: str, device: str | None = None, dtype: torch.dtype | None = None,
            greedy_steps: int = 64, numerics: str | None = None) -> Parity:
    engine = Engine(path, device=device, dtype=dtype, numerics=numerics)
    tokens = engine.encode_prompt(prompt)
    err = relative_error(ours_logits(engine, tokens), reference_logits(Path(path), tokens))
    ours, ref = ours_greedy(engine, tokens, greedy_steps), reference_greedy(Path(path), tokens, greedy_steps)
    agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), greedy_steps)
    return Parity(str(path), str(engine.device), str(engine.dtype).removeprefix("torch."), engine.numerics, err,
                  greedy_steps, agree)


def self_consistency(path: Path, prompt_tokens: list[int], steps: int) -> float:
    """How far llama.cpp's one-token decode drifts from its own batched evaluation of the same tokens (max relative
    logit difference): the size of difference a rounding flip causes inside llama.cpp itself."""
    llm = _llama(path, len(prompt_tokens) + steps + 8)
    llm.eval(prompt_tokens)
    seq = list(prompt_tokens)
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        seq.append(token)
        llm.eval([token])
    return relative_error(np.array(llm.scores[: len(seq)], dtype=np.float32), reference_logits(path, seq))
