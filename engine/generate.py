"""Prefill, then incremental decode: one token at a time into the KV cache, streamed to a callback, stopping on an
end-of-generation token, a stop string, the token limit, the context limit, a cancel from another thread, or the
generation guard (a looping reply, the model's reply cap: engine.reply_guard)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvchat.engine.kv.base import KVStore
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.sampling import Sampler, SamplingParams
from kvchat.engine.text.reply_text import ReplyText
from kvchat.errors import ContextOverflowError

# What the callback receives for each token: the token id and the text it completes (may be "" mid-character).
TokenCallback = Callable[[int, str], None]


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    # "eog" | "stop_string" | "max_tokens" | "context" | "cancelled" | "repetition" | "reply_cap" (the last two: the
    # generation guard stopped a reply that looped or ran past the model's cap)
    stop_reason: str = ""
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0  # from the call to the first sampled token
    # After the first token is shown: building the decode step (capturing its CUDA graphs), once per reply
    decode_setup_seconds: float = 0.0
    decode_seconds: float = 0.0  # the decode steps from the second token on, the setup not included

    @property
    def decode_tokens_per_second(self) -> float:
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


@torch.inference_mode()
def prefill(model: Transformer, cache: KVStore, tokens: list[int], chunk: int = 4096,
            attend: Attend = None) -> torch.Tensor:
    """Append tokens to the cache in chunks (bounded activation memory) and return the last token's logits [V].
    `attend` restricts what the tokens see of the cache as it was before them (they always see each other), where
    the cache takes a view (KVStore.prefill_prompt)."""
    return cache.prefill_prompt(model, tokens, attend=attend, chunk=chunk)


def generate(model: Transformer, cache: KVStore, prompt: list[int], *, decoder, max_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_tokens: frozenset[int] = frozenset(),
             stop_strings: tuple[str, ...] = (), on_token: TokenCallback | None = None,
             cancel: threading.Event | None = None, context_length: int | None = None,
             cuda_graph: bool | None = None, attend: Attend = None, guard: ReplyGuard | None = None,
             reply_cap: int | None = None, policy=None, strip: bool = False) -> GenerationResult:
    """Generate after `prompt` (appended to whatever `cache` already holds). `decoder` is a tokenizer's
    StreamDecoder. Stop tokens end up in `tokens` but not in the text. A stop string is cut off the text, and what
    `on_token` is handed adds up to the text exactly (engine.text.reply_text: an end that could still become a stop
    string is handed on a token later; `strip` leaves out the whitespace around the reply, for a base model's
    transcript). The cache (any KVStore) then holds the prompt and every generated token but the last (nothing has
    attended to it yet). A cache may choose what the prompt sees itself (a TieredKV picks the rounds its upper
    layers see: `attend` does not apply). `guard` stops a looping reply; `reply_cap` (the model's, from
    ReplyGuard.cap_for) stops one that runs on. `policy` (a KVPolicy) may bring its own decode step."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    limit = context_length or model.cfg.context_length
    if cache.length + len(prompt) > limit:
        raise ContextOverflowError(
            f"the prompt needs {cache.length + len(prompt)} tokens of context; the model has {limit}")
    sampler = Sampler(sampling, model.device)
    result = GenerationResult(prefill_tokens=len(prompt))
    started = time.perf_counter()
    first = cache.length
    logits = cache.prefill_prompt(model, prompt, attend=attend)
    token = sampler(logits)
    result.prefill_seconds = result.first_token_seconds = time.perf_counter() - started
    step = None  # built once the first token is out: capturing decode graphs would delay it
    decode_started = time.perf_counter()
    text = ReplyText(stop_strings, strip)
    try:
        while True:
            result.tokens.append(token)
            if token in stop_tokens:
                result.stop_reason = "eog"
                break
            piece = text.feed(decoder.feed(token))
            if on_token is not None:
                on_token(token, piece)
            if text.stopped:
                result.stop_reason = "stop_string"
                break
            if len(result.tokens) >= max_tokens:
                result.stop_reason = "max_tokens"
                break
            if guard is not None and guard.loops(result.tokens):
                result.stop_reason = "repetition"
                break
            if reply_cap is not None and len(result.tokens) >= reply_cap:
                result.stop_reason = "reply_cap"
                break
            if cancel is not None and cancel.is_set():
                result.stop_reason = "cancelled"
                break
            if cache.length + 1 > limit:
                result.stop_reason = "context"
                break
            if step is None:
                setup_started = time.perf_counter()
                step = decode_steps(model, cache, max_tokens, limit, attend, first, cuda_graph, policy)
                result.decode_setup_seconds = time.perf_counter() - setup_started
            token = sampler(step(token))
    finally:
        # A step over a working set of its own (engine.kv.working_set) puts the reply's K/V back into the cache,
        # whose length already counts them, even when the reply stopped on an error.
        finish = getattr(step, "finish", None)
        if finish is not None:
            finish()
    tail = text.feed(decoder.flush())
    tail += text.finish()
    if tail and on_token is not None:
        on_token(-1, tail)
    result.text = text.text
    result.decode_seconds = time.perf_counter() - decode_started - result.decode_setup_seconds
    return result


def decode_steps(model: Transformer, cache: KVStore, max_tokens: int, limit: int, attend: Attend = None,
                 first: int = 0, cuda_graph: bool | None = None, policy=None):
    """The decode step (token -> logits [V]) for up to `max_tokens` tokens after a prefill: the cache's own
    (KVStore.decode_step), which may be a policy's (`policy.decode_step`) or, with `attend` (the view the prefill
    had of the cache as it was at slot `first`), eager steps that see the chosen slots and everything generated
    since."""
    return cache.decode_step(model, max_tokens, limit, attend=attend, first=first, cuda_graph=cuda_graph,
                             policy=policy)
