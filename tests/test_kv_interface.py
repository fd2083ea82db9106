"""The KV cache interface (engine.kv.base): both caches implement it, generation and the CUDA-graph step name no
concrete cache, and a third cache written against the interface alone drives `generate` to the full cache's reply."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvchat.engine.engine import Engine
from kvchat.engine.generate import decode_steps, generate, prefill
from kvchat.engine.kv.base import DeviceKV, KVStore
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.tiered import TieredKV
from kvchat.engine.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Tell me a story about a dragon"
CONCRETE = {"KVCache", "TieredKV", "kvchat.engine.kv.cache", "kvchat.engine.kv.tiered"}


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models.get(), device="cpu")


class RecomputeKV:
    """A KVStore that keeps no K/V at all: only the tokens, every one of them run again through the model at each
    step. Written against the interface alone, as a new KV technique would be."""

    def __init__(self):
        self.tokens: list[int] = []
        self.calls: list[str] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _logits(self, model) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor(self.tokens), model.new_cache(len(self.tokens) + 1))[-1]

    def prefill_prompt(self, model, tokens, attend=None, chunk=4096):
        self.calls.append("prefill_prompt")
        self.tokens += tokens
        return self._logits(model)

    def decode_step(self, model, max_tokens, limit, *, attend=None, first=0, cuda_graph=None, policy=None):
        self.calls.append("decode_step")

        def step(token: int) -> torch.Tensor:
            self.tokens.append(token)
            return self._logits(model)

        return step

    def truncate(self, length: int) -> None:
        del self.tokens[length:]


def test_both_caches_are_kv_stores_and_the_full_cache_is_a_device_kv(engine):
    full = engine.new_cache()
    tiered = TieredKV(engine.model, make_policy("round-topk", engine, watershed=0), 64)
    assert isinstance(full, KVStore) and isinstance(tiered, KVStore) and isinstance(RecomputeKV(), KVStore)
    assert isinstance(full, DeviceKV) and isinstance(tiered.lower, DeviceKV) and isinstance(tiered.upper, DeviceKV)
    assert not isinstance(tiered, DeviceKV)  # its upper tier lives per round in host memory
    assert not isinstance(object(), KVStore)


def test_the_decoder_still_exports_the_cache_for_the_session():
    from kvchat.engine.model.decoder import KVCache as from_the_decoder  # app/session's import, until it moves

    assert from_the_decoder is KVCache


@pytest.mark.parametrize("module", ["engine/generate.py", "engine/model/cuda_graph.py"])
def test_generation_and_the_graph_step_name_no_concrete_cache(module):
    tree = ast.parse((ROOT / module).read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            named |= {node.module or ""} | {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
    # string annotations ("KVCache | None") too; docstrings may speak of the caches
    named |= {word for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "\n" not in node.value for word in node.value.replace("|", " ").split()}
    assert not named & CONCRETE, f"{module} names {named & CONCRETE}"


def test_a_third_cache_behind_the_interface_drives_generate_to_the_full_cache_s_reply(engine):
    prompt = engine.encode_prompt(PROMPT)
    replies = []
    for cache in (engine.new_cache(), RecomputeKV()):
        replies.append(generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(),
                                max_tokens=8))
        assert cache.length == len(prompt) + 7  # every generated token but the last
    assert replies[1].tokens == replies[0].tokens and replies[1].text == replies[0].text
    assert replies[1].stop_reason == "max_tokens"


def test_prefill_and_decode_steps_go_through_the_cache_s_own_methods(engine):
    cache = RecomputeKV()
    full = engine.new_cache()
    prompt = engine.encode_prompt(PROMPT)
    torch.testing.assert_close(prefill(engine.model, cache, prompt), prefill(engine.model, full, prompt),
                               rtol=1e-4, atol=1e-4)
    step, full_step = decode_steps(engine.model, cache, 4, 1024), decode_steps(engine.model, full, 4, 1024)
    torch.testing.assert_close(step(7), full_step(7), rtol=1e-4, atol=1e-4)
    assert cache.calls == ["prefill_prompt", "decode_step"] and cache.length == full.length
    cache.truncate(3)
    assert cache.length == 3
