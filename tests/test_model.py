"""The layer-by-layer surface the KV techniques stand on: layer ranges, explicit positions, attending over a chosen
subset of the cache, and reading/writing any span of K/V for any layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.engine.engine import Engine

TEXT_A = "My name is Alice and I live in Paris."
TEXT_B = " Tell me a story about a dragon who learns to cook pasta."
TEXT_C = " What is the capital of France?"


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models.get(n_layers=4), device="cpu")


def tokens(engine, text, bos=False):
    return engine.tokenizer.encode(text, add_bos=bos)


def test_layer_ranges_compose_to_the_full_forward(engine):
    m, ids = engine.model, torch.tensor(tokens(engine, TEXT_A, bos=True))
    full = m(ids, m.new_cache(), all_logits=True)
    cache = m.new_cache()
    pos = torch.arange(len(ids))
    h = m.embed(ids)
    h = m.run_layers(h, pos, cache, 0, range(0, 1))
    h = m.run_layers(h, pos, cache, 0, range(1, 4))
    torch.testing.assert_close(m.head(h), full, rtol=0, atol=1e-5)


def test_incremental_prefill_matches_one_shot(engine):
    m = engine.model
    a, b = tokens(engine, TEXT_A, bos=True), tokens(engine, TEXT_B)
    once = m(torch.tensor(a + b), m.new_cache(), all_logits=True)
    cache = m.new_cache(capacity=4)  # forces the cache to grow
    m(torch.tensor(a), cache)
    later = m(torch.tensor(b), cache, all_logits=True)
    torch.testing.assert_close(later, once[len(a):], rtol=0, atol=1e-4)
    assert cache.length == len(a) + len(b)


def test_explicit_positions_are_used(engine):
    m, ids = engine.model, torch.tensor(tokens(engine, TEXT_A, bos=True))
    base = m(ids, m.new_cache(), all_logits=True)
    shifted = m(ids, m.new_cache(), positions=torch.arange(100, 100 + len(ids)), all_logits=True)
    # RoPE is relative: a uniform shift leaves attention scores (and logits) unchanged up to rounding ...
    torch.testing.assert_close(shifted, base, rtol=0, atol=2e-3)
    # ... while a non-uniform change of positions changes them.
    gapped = torch.arange(len(ids)) * 7
    assert (m(ids, m.new_cache(), positions=gapped, all_logits=True) - base).abs().max() > 1e-2


def test_attending_to_a_subset_equals_a_cache_holding_only_it(engine):
    m = engine.model
    a, b, c = tokens(engine, TEXT_A, bos=True), tokens(engine, TEXT_B), tokens(engine, TEXT_C)
    cache = m.new_cache()
    m(torch.tensor(a + b), cache)
    pos_c = torch.arange(len(a) + len(b), len(a) + len(b) + len(c))
    subset = m(torch.tensor(c), cache, positions=pos_c, attend=torch.arange(len(a)), all_logits=True)
    # A's K/V never depended on B (causal), so a cache of A alone with C at the same positions is the reference.
    alone = m.new_cache()
    m(torch.tensor(a), alone)
    ref = m(torch.tensor(c), alone, positions=pos_c, all_logits=True)
    torch.testing.assert_close(subset, ref, rtol=0, atol=1e-4)
    # And the subset really excludes B: attending to everything gives something else.
    everything = m.new_cache()
    m(torch.tensor(a + b), everything)
    full = m(torch.tensor(c), everything, all_logits=True)
    assert (full - subset).abs().max() > 1e-2


def test_attend_all_slots_equals_default(engine):
    m = engine.model
    a, c = tokens(engine, TEXT_A, bos=True), tokens(engine, TEXT_C)
    c1, c2 = m.new_cache(), m.new_cache()
    m(torch.tensor(a), c1)
    m(torch.tensor(a), c2)
    torch.testing.assert_close(m(torch.tensor(c), c1, attend=torch.arange(len(a)), all_logits=True),
                               m(torch.tensor(c), c2, all_logits=True), rtol=0, atol=1e-5)


def test_kv_read_write_restores_state_per_layer_range(engine):
    m = engine.model
    a, b, c = tokens(engine, TEXT_A, bos=True), tokens(engine, TEXT_B), tokens(engine, TEXT_C)
    src = m.new_cache()
    m(torch.tensor(a + b), src)
    expected = m(torch.tensor(c), src, all_logits=True)
    # Move round A and round B separately, lower and upper layers separately, as round storage will.
    dst = m.new_cache(capacity=8)
    for start, end in ((0, len(a)), (len(a), len(a) + len(b))):
        for layers in (range(0, 2), range(2, 4)):
            kv = src.read(layers, start, end)
            assert kv.shape == (2, 2, m.cfg.n_kv_heads, end - start, m.cfg.head_dim)
            dst.write(layers, start, kv)
    dst.length = len(a) + len(b)
    torch.testing.assert_close(m(torch.tensor(c), dst, all_logits=True), expected, rtol=0, atol=0)


def test_kv_read_rejects_bad_spans(engine):
    cache = engine.model.new_cache(capacity=8)
    with pytest.raises(ValueError):
        cache.read(range(0, 9), 0, 1)
    with pytest.raises(ValueError):
        cache.read(range(0, 1), 4, 100)


@pytest.mark.parametrize("n_new, n_keys, heads, kv_heads, head_dim", [
    (5, 12, 4, 2, 16), (12, 12, 4, 4, 16), (1, 9, 2, 1, 8), (7, 30, 6, 2, 20)])
def test_bottom_right_causal_attention_is_sdpa_under_its_mask(n_new, n_keys, heads, kv_heads, head_dim):
    """New token i sees every cached slot and new tokens 0..i (the mask as a table), whichever kernel runs it."""
    from kvchat.engine.model.attention import BottomRightCausal, bottom_right_causal_attention

    gen = torch.Generator().manual_seed(n_keys)
    q = torch.randn(1, heads, n_new, head_dim, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, n_keys, head_dim, generator=gen)
    mask = BottomRightCausal(n_new, n_keys)
    table = torch.tensor([[c <= n_keys - n_new + r for c in range(n_keys)] for r in range(n_new)])
    assert torch.equal(mask.materialize(torch.device("cpu")), table)
    rep = heads // kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=table, scale=0.3)
    got = bottom_right_causal_attention(q, k, v, mask, scale=0.3, enable_gqa=rep > 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
