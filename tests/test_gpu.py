"""CUDA runs (skipped without CUDA): half precision close to fp32, CUDA-graph decode identical to eager decode."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.app.bench.parity import compare, ours_logits, relative_error
from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT

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


def test_cuda_graph_decode_over_window_rings_equals_eager_decode(models, monkeypatch):
    """Gemma 3's window layers in rings of 12 (window 8; the prompt and 48 tokens wrap them many times): the
    captured step decodes what eager steps over a cache of every slot do. Its warm-up runs write a ring place that
    holds a live slot (255 % 12 = 3: slot 27 of the prompt) and put it back."""
    from kvchat.engine.kv import cache as cache_module

    monkeypatch.setattr(cache_module, "RING_SLACK", 4)
    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cuda", dtype=torch.float32)
    prompt = engine.encode_prompt(REFERENCE_PROMPT)
    caches = (engine.new_cache(), engine.new_cache(ring=True))
    runs = [generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=48,
                     cuda_graph=graph) for cache, graph in zip(caches, (False, True))]
    assert caches[1].ring_size == 12 and caches[1].capacity == 256
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (8, 8), (14, 2)])
def test_bottom_right_causal_attention_by_flash_on_cuda(dtype, heads, kv_heads):
    """The flash path (no mask in memory) against SDPA under the materialized mask, grouped-query heads included."""
    import torch.nn.functional as F

    from kvchat.engine.model.attention import BottomRightCausal, bottom_right_causal_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 300, 128, device="cuda", dtype=dtype, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, 1000, 128, device="cuda", dtype=dtype, generator=gen)
    mask = BottomRightCausal(300, 1000)
    rep = heads // kv_heads
    expected = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                              v.float().repeat_interleave(rep, 1),
                                              attn_mask=mask.materialize(q.device), scale=0.09)
    got = bottom_right_causal_attention(q, k, v, mask, scale=0.09, enable_gqa=rep > 1)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("spec", [dict(), dict(arch="qwen2", style="chatml", n_kv_heads=1),
                                  REFERENCE_MODELS["qwen3-f32"], REFERENCE_MODELS["gemma3-f32-swa"]], ids=str)
def test_fused_prefill_on_cuda_matches_the_plain_one(models, monkeypatch, spec, dtype):
    """The prefill's norms fused with their residual adds and SwiGLU in one kernel: the plain forward's logits and
    K/V within the dtype's rounding."""
    from test_decode_kernels import fused_and_plain_prefill

    engine = Engine(models.get(**spec), device="cuda", dtype=dtype)
    (fused, fused_kv), (plain, plain_kv) = fused_and_plain_prefill(engine, monkeypatch, chunk=7)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert relative_error(fused.cpu().numpy(), plain.cpu().numpy()) < tol
    assert (fused_kv - plain_kv).abs().max() <= tol * plain_kv.abs().max()


def test_chunked_prefill_on_cuda_imports_no_dynamo(models, tmp_path):
    """A chat's later chunks attend without torch.nn.attention.bias, whose import of torch._dynamo cost seconds
    inside the first long resume of every process."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from kvchat.engine.engine import Engine\n"
        "from kvchat.engine.generate import prefill\n"
        f"engine = Engine({str(models.get())!r}, device='cuda', dtype=torch.bfloat16)\n"
        "tokens = engine.encode_prompt('The quick brown fox. ' * 40)\n"
        "prefill(engine.model, engine.new_cache(len(tokens) + 8), tokens, chunk=16)\n"
        "torch.cuda.synchronize()\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merged_layers_on_cuda_round_trip(dtype):
    from kvchat.engine.kv.cross_layer import approximate_pair, merge_pair, unmerge_pair

    kv = torch.randn(2, 8, 300, 128, device="cuda").to(dtype)
    same = approximate_pair(kv, kv.clone())
    assert torch.equal(same[0], kv) and torch.equal(same[1], kv)  # equal layers: exact in the cache's dtype
    other = torch.randn_like(kv)
    merged = merge_pair(kv, other, retain=0.05)
    assert merged.is_cuda and merged.dtype == dtype and merged.shape[3] == 300 + 15
    cpu = unmerge_pair(merged.cpu(), 300)
    torch.testing.assert_close(unmerge_pair(merged, 300).cpu(), cpu)


def test_a_merged_chat_restores_on_cuda(models, kvchat_home):
    """The staged (pinned, copied on the loader threads) path of a restore unmerges on the device."""
    from kvchat.app.session.chat import ChatSession
    from kvchat.app.session.merges import ChatMerges
    from kvchat.engine.kv.cross_layer import LayerPair
    from kvchat.storage.db import SEGMENT_MERGED, Store
    from kvchat.storage.fingerprint import model_fingerprint

    engine = Engine(models.get(style="chatml", arch="qwen2", n_layers=4), device="cuda")
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt=None)
    chat = ChatSession(store, engine, sid, merges=ChatMerges(store, sid, engine, "", 0.5,
                                                             allowed=[LayerPair(1, 2)], gamma=0.0))
    for m in ("The quick brown fox jumps over the lazy dog.", "My name is Alice.", "What is my name?"):
        chat.send(m, max_tokens=8)
    chat.close()
    assert any(s["kind"] == SEGMENT_MERGED for s in store.segments(sid))
    reopened = ChatSession(store, engine, sid)
    assert reopened.restore().tokens_recomputed == 0
    n = chat.cache.length
    assert torch.equal(reopened.cache.kv[[0, 3], :, :, :n], chat.cache.kv[[0, 3], :, :, :n])
    from kvchat.engine.kv.cross_layer import approximate_pair

    for r in chat.rounds:  # layers 1 and 2: what merging the live cache's round gives, computed here
        span = slice(r.token_start, r.token_end)
        want = approximate_pair(chat.cache.kv[1, :, :, span], chat.cache.kv[2, :, :, span])
        torch.testing.assert_close(reopened.cache.kv[1:3, :, :, span], want)
