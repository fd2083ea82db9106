"""CPU counterparts of CUDA-only tests whose logic does not depend on the device (docs/testing.md lists every
`gpu` test's counterpart): the model in half precision, the captured decode step in bfloat16, key bounds kept in
bfloat16, a prefill after cached tokens through the unmaterialized causal mask that flash attention takes on CUDA,
and, in triton's interpreter (through test_half_precision_kernels_in_triton_s_interpreter, as in
test_decode_kernels.py), the fused prefill and the kernel decode step in half precision. The CUDA-graph stand-in's
tests are test_graph_capture.py, the staging ring's test_staging_ring.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from graph_standin import standin_graphs
from kvchat.app.bench.parity import compare, ours_logits, relative_error
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT
from kvchat.kernels._triton import INTERPRET
from triton_interpreter import passed_in_interpreter

# Of test_gpu.py's SPECS: fp16 and Q4_K weights, MQA with biases, Gemma 3's windows.
SPECS = [dict(qtype=Q.F16), dict(qtype=Q.Q4_K), dict(arch="qwen2", style="chatml", n_kv_heads=1),
         REFERENCE_MODELS["gemma3-f32-swa"]]
HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_half_precision_is_close_to_fp32(models, dtype, spec):
    """test_gpu.py::test_half_precision_on_cuda_is_close_to_fp32 on the CPU (torch's half-precision matrix products
    instead of cuBLAS's, the same casts and fp32 norm statistics), with the same bounds; against llama.cpp for the
    fp16 and Q4_K files in bfloat16 (test_reference.py compares every architecture in float32)."""
    path = models.get(**spec)
    exact = Engine(path, device="cpu", numerics="exact")
    tokens = exact.encode_prompt(REFERENCE_PROMPT)
    half = Engine(path, device="cpu", dtype=dtype)
    assert half.model.dtype == dtype and half.model.tok_embeddings.dtype == dtype
    error = relative_error(ours_logits(half, tokens), ours_logits(exact, tokens))
    # bf16 keeps 8 bits of mantissa, fp16 11: the expected size of the difference is ~1e-2 and ~1e-3.
    assert 1e-5 < error < (2e-2 if dtype == torch.bfloat16 else 3e-3)  # above 0: the weights really are halves
    if dtype == torch.bfloat16 and spec.get("qtype", Q.F32) != Q.F32:  # llama.cpp rounds activations to 8 bits
        # for quantized weights, so it is only this close to us
        assert compare(path, REFERENCE_PROMPT, device="cpu", dtype=dtype, greedy_steps=4).relative_error < 3e-2


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=str)
def test_captured_decode_in_bfloat16_equals_eager_decode(models, spec):
    """The captured step (through the CPU stand-in for CUDA graphs) in the dtype CUDA runs by default."""
    engine = Engine(models.get(**spec), device="cpu", dtype=torch.bfloat16)
    prompt = engine.encode_prompt(REFERENCE_PROMPT)
    with standin_graphs() as graphs:
        runs = [generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                         max_tokens=12, cuda_graph=graph) for graph in (False, True)]
    assert [g.replays for g in graphs.graphs] == [11]
    assert runs[0].tokens == runs[1].tokens


def test_bf16_bounds_score_as_float32():
    """test_key_bounds.py::test_bf16_bounds_on_the_gpu_score_as_float32_on_the_cpu with the bf16 table on the CPU:
    every layer's round shares at once from bounds kept in bfloat16, against the float32 table's."""
    from kvchat.engine.kv.key_bounds import BoundsTable, key_bounds
    from test_key_bounds import HKV, LU, REP, D, table_of

    torch.manual_seed(1)
    lengths = [500, 900, 1200, 600]
    keys, q = torch.randn(LU, HKV, sum(lengths), D), torch.randn(LU, HKV * REP, D)
    keys[:, :, 500 + 900 + 17] = 4 * q.view(LU, HKV, REP, D).mean(2)
    want = table_of(keys, lengths).round_shares(q)
    table = BoundsTable(LU, HKV, D, torch.bfloat16, torch.device("cpu"))
    at = 0
    for n in lengths:
        table.append(n, key_bounds(keys[:, :, at : at + n].to(torch.bfloat16)))
        at += n
    assert table.bounds.dtype == torch.bfloat16
    got = table.round_shares(q.to(torch.bfloat16))
    assert (got.argmax(1) == want.argmax(1)).all() and (got - want).abs().max() < 0.05
    assert (got.argmax(1) == 2).all()  # the round holding the matching key


@pytest.mark.parametrize("spec", [dict(), dict(n_kv_heads=4), dict(arch="qwen2", style="chatml", n_kv_heads=1),
                                  REFERENCE_MODELS["gemma3-f32-swa"]], ids=str)
def test_chunked_prefill_through_the_unmaterialized_mask_equals_one_pass(models, monkeypatch, spec):
    """test_gpu.py::test_chunked_prefill_on_cuda_equals_one_pass on the CPU: later chunks hand attention a
    BottomRightCausal, as on CUDA (where flash attention takes it; here bottom_right_causal_attention materializes
    it), grouped-query heads included: the one pass's logits and K/V."""
    from kvchat.engine.model import attention

    engine = Engine(models.get(**spec), device="cpu", dtype=torch.float32)
    tokens = engine.encode_prompt(REFERENCE_PROMPT * 8)
    whole, chunked = engine.new_cache(len(tokens) + 8), engine.new_cache(len(tokens) + 8)
    one = prefill(engine.model, whole, tokens)
    handed = []
    real = attention.bottom_right_causal_attention

    def counted(*args, **kwargs):
        handed.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "mask_left_to_attention", lambda device: True)
    monkeypatch.setattr("kvchat.engine.model.decoder.bottom_right_causal_attention", counted)
    many = prefill(engine.model, chunked, tokens, chunk=7)
    assert handed and all(isinstance(m, attention.BottomRightCausal) for m in handed)
    assert relative_error(many.numpy(), one.numpy()) < 1e-4
    n = len(tokens)
    assert (chunked.kv[:, :, :, :n] - whole.kv[:, :, :, :n]).abs().max() < 1e-3 * whole.kv[:, :, :, :n].abs().max()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (8, 8), (14, 2)])
def test_bottom_right_causal_attention_in_half_precision(dtype, heads, kv_heads):
    """test_gpu.py::test_bottom_right_causal_attention_by_flash_on_cuda's check on the CPU, where the mask is
    materialized (flash attention's own path runs on CUDA only): half-precision inputs against float32 SDPA under
    the materialized mask, grouped-query heads included."""
    from kvchat.engine.model.attention import (
        BottomRightCausal,
        bottom_right_causal_attention,
    )

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 40, 64, generator=gen).to(dtype)
    k, v = torch.randn(2, 1, kv_heads, 150, 64, generator=gen).to(dtype)
    mask = BottomRightCausal(40, 150)
    rep = heads // kv_heads
    expected = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                              v.float().repeat_interleave(rep, 1),
                                              attn_mask=mask.materialize(q.device), scale=0.09)
    got = bottom_right_causal_attention(q, k, v, mask, scale=0.09, enable_gqa=rep > 1)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- half precision through the kernels, interpreted

interpreted = pytest.mark.skipif(
    not INTERPRET, reason="run by test_half_precision_kernels_in_triton_s_interpreter with TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_interpreted_fused_prefill_in_half_precision(models, monkeypatch, dtype):
    """test_gpu.py::test_fused_prefill_on_cuda_matches_the_plain_one's half-precision case in triton's interpreter:
    the norms fused with their residual adds and SwiGLU, the plain forward's logits and K/V within the dtype's
    rounding."""
    from test_decode_kernels import fused_and_plain_prefill

    engine = Engine(models.get(n_layers=2), device="cpu", dtype=dtype)
    (fused, fused_kv), (plain, plain_kv) = fused_and_plain_prefill(engine, monkeypatch, chunk=9)
    assert fused_kv.abs().max() > 0
    assert relative_error(fused.numpy(), plain.numpy()) < 5e-2
    assert (fused_kv - plain_kv).abs().max() <= 5e-2 * plain_kv.abs().max()


@interpreted
def test_interpreted_kernel_decode_in_bfloat16(models):
    """The decode step CUDA captures (rope_kv, the decode attention kernel, the fused norms, SwiGLU and GEMVs) in
    bfloat16, CUDA's default, in triton's interpreter: the eager bfloat16 step's logits within its rounding, and its
    greedy tokens. (Each kernel's float16 path: test_decode_kernels.py and test_decode_attention.py.)"""
    from kvchat.engine.model.cuda_graph import GraphedDecode
    from kvchat.engine.model.decoder import decode_kernel_runs

    engine = Engine(models.get(n_layers=2), device="cpu", dtype=torch.bfloat16)
    m = engine.model
    assert decode_kernel_runs(engine.config, m.dtype, m.device)
    prompt = torch.tensor(engine.encode_prompt(REFERENCE_PROMPT))
    cache, eager = m.new_cache(64), m.new_cache(64)
    token = int(m(prompt, cache)[-1].argmax())
    m(prompt, eager)
    step = GraphedDecode(m, cache, 64, capture=False)
    for _ in range(2):
        got = step(token).float()
        want = m(torch.tensor([token]), eager)[-1].float()
        assert relative_error(got.numpy(), want.numpy()) < 2e-2
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())


def test_half_precision_kernels_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(HALF) + 1
