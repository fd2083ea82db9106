"""CUDA runs (skipped without CUDA): half precision close to fp32, CUDA-graph decode identical to eager decode."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.parity import compare, ours_logits, relative_error
from kvchat.engine.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT

pytestmark = pytest.mark.gpu
SPECS = [dict(qtype=Q.F16), dict(qtype=Q.Q4_K), dict(arch="qwen2", style="chatml"), dict(llama3_factor=8.0),
         dict(n_kv_heads=4), dict(arch="qwen2", style="chatml", n_kv_heads=1),
         # Qwen 3's head norms; Gemma 3's windows of 8 keys (48 decoded tokens cross many of them)
         REFERENCE_MODELS["qwen3-f32"], REFERENCE_MODELS["gemma3-f32-swa"]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", SPECS)
def test_half_precision_on_cuda_is_close_to_fp32(models, dtype, spec):
    path = models.get(**spec)
    exact = Engine(path, device="cpu", numerics="exact")
    tokens = exact.encode_prompt(REFERENCE_PROMPT)
    half = relative_error(ours_logits(Engine(path, device="cuda", dtype=dtype), tokens), ours_logits(exact, tokens))
    # bf16 keeps 8 bits of mantissa, fp16 11: the expected size of the difference is ~1e-2 and ~1e-3.
    assert half < (2e-2 if dtype == torch.bfloat16 else 3e-3)
    # llama.cpp itself rounds activations to 8 bits for quantized weights, so it is only this close to us:
    assert compare(path, REFERENCE_PROMPT, device="cuda", dtype=dtype, greedy_steps=4).relative_error < 3e-2


@pytest.mark.parametrize("spec", SPECS)
def test_cuda_graph_decode_equals_eager_decode(models, spec):
    engine = Engine(models.get(**spec), device="cuda", dtype=torch.float32)
    prompt = engine.encode_prompt(REFERENCE_PROMPT)
    runs = [generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                     max_tokens=48, cuda_graph=graph) for graph in (False, True)]
    assert runs[0].tokens == runs[1].tokens


def test_generation_on_cuda(models):
    engine = Engine(models.get(), device="cuda")
    out = engine.complete(engine.encode_prompt(REFERENCE_PROMPT), max_tokens=16)
    assert len(out.tokens) == 16 and engine.model.tok_embeddings.is_cuda


@pytest.mark.parametrize("spec", [dict(), dict(n_kv_heads=4), dict(arch="qwen2", style="chatml", n_kv_heads=1),
                                  REFERENCE_MODELS["gemma3-f32-swa"]])
def test_chunked_prefill_on_cuda_equals_one_pass(models, spec):
    """Later chunks attend through a lower-right causal bias (flash attention, grouped-query heads included):
    the same logits as one pass, within fp32 rounding."""
    from kvchat.engine.generate import prefill

    engine = Engine(models.get(**spec), device="cuda", dtype=torch.float32)
    tokens = engine.encode_prompt(REFERENCE_PROMPT * 8)
    whole, chunked = engine.new_cache(len(tokens) + 8), engine.new_cache(len(tokens) + 8)
    one = prefill(engine.model, whole, tokens)
    many = prefill(engine.model, chunked, tokens, chunk=7)
    assert relative_error(many.cpu().numpy(), one.cpu().numpy()) < 1e-4
    n = len(tokens)
    assert (chunked.kv[:, :, :, :n] - whole.kv[:, :, :, :n]).abs().max() < 1e-3 * whole.kv[:, :, :, :n].abs().max()
