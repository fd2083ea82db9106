"""A message's prefill that reads units too (louiskv/quest `prefill=units`, engine.policies.units_prefill): what
each global layer's message attends to, that it is the reply's first choice, and that it is taken off the model after
the message."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.units_prefill import UnitsPrefill
from kvchat.errors import KvchatError

FACTS = ("My dog is called Rex. Our canoe is called Blue Heron. My sister lives in Lisbon. I was born in Porto. "
         "The cat is called Miso. ")


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def policy_of(engine, name: str, **options):
    extra = {"tau": 0.5} if name == "louiskv" else {}
    return make_policy(name, engine, prefill="units", **extra, **options)


def history_and_message(engine, cache):
    """Two rounds of facts in the cache; the question's tokens, not yet in it. -> (round starts, message tokens)"""
    starts = []
    for message in (FACTS * 4, FACTS * 3 + "Remember that."):
        starts.append(cache.length)
        engine.model(torch.tensor(engine.encode_prompt(message)), cache)
    return starts, engine.encode_prompt("What is my dog called?")


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_attention_over_the_chosen_slots_is_attention_masked_to_them(engine, name):
    """UnitsPrefill.attend against SDPA over every slot with a per-KV-head mask: the sinks, the units' slots it
    read, the buffer before the message and the message's own tokens causally (a chunk after an earlier one)."""
    m, cfg = engine.model, engine.config
    policy = policy_of(engine, name, tokens=24, sinks=4, buffer=12, unit_tokens=8)
    cache = m.new_cache(1024)
    starts, message = history_and_message(engine, cache)
    policy.visible_slots(cache, starts, message, model=m)
    hook = m.sparse_prefill
    assert isinstance(hook, UnitsPrefill) and hook.applies(len(message), cache.length + len(message))
    m.sparse_prefill = None  # the message's K/V written densely: the hook is called on them by hand below
    m(torch.tensor(message), cache)
    layer, chunk = 3, 5  # the message's second chunk: its first 5 tokens are earlier slots of the message
    start, n_new = hook.message_start + chunk, len(message) - chunk
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_new, cfg.n_heads, cfg.head_dim, generator=g)
    kv = cache.layer(layer)
    got = hook.attend(q, kv, start, cfg.softmax_scale, layer=layer)
    reads = hook.reads[layer]  # [Hkv, n]: the chat's slots
    assert reads.shape[1] == 4 + 24 + (hook.message_start - hook.region_end)
    end = start + n_new
    visible = torch.zeros(cfg.n_kv_heads, n_new, end, dtype=torch.bool)
    for head in range(cfg.n_kv_heads):
        visible[head, :, reads[head]] = True
        visible[head, :, hook.message_start : start] = True
        visible[head, :, start:end] = torch.ones(n_new, n_new).tril().bool()
    rep = cfg.n_heads // cfg.n_kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kv[0, :, :end].repeat_interleave(rep, 0)[None],
        kv[1, :, :end].repeat_interleave(rep, 0)[None], attn_mask=visible.repeat_interleave(rep, 0)[None],
        scale=cfg.softmax_scale)[0].transpose(0, 1).reshape(n_new, -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert hook.attend(q, kv, hook.end, cfg.softmax_scale, layer=layer) is None  # another message's: dense


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_the_message_reads_what_the_replys_first_choice_reads(engine, name):
    """Each global layer's message reads the units its last token scores best: the reply's first choice (the same
    queries, kept by that prefill), so a lazy resume fetches them once, for both."""
    check_the_message_reads_the_first_choice(engine, name)


@pytest.mark.gpu
def test_on_the_gpu_the_message_reads_the_first_choice_through_the_fused_prefill_and_the_kernel():
    """On CUDA the prefill runs DecoderLayer.fused_prefill and the choice kernels.unit_choice: the same contract."""
    check_the_message_reads_the_first_choice(Engine(DEFAULT_MODEL, device="cuda"), "louiskv")


def check_the_message_reads_the_first_choice(engine, name: str) -> None:
    m, cfg = engine.model, engine.config
    policy = policy_of(engine, name, tokens=24, sinks=4, buffer=12, unit_tokens=8)
    cache = m.new_cache(1024)
    starts, message = history_and_message(engine, cache)
    with policy.for_message(m, cache, starts, [], message) as attend:
        hook = m.sparse_prefill
        first = cache.length + len(message)
        m(torch.tensor(message), cache)
        step = policy.decode_step(m, cache, first - len(message), attend, first + 8, False)
    assert m.sparse_prefill is None  # the message's override is taken off after it
    assert sorted(hook.reads) == list(range(cfg.n_layers))
    for layer in range(cfg.n_layers):
        n = int(step.base[layer])
        for head in range(cfg.n_kv_heads):
            message_slots = list(range(hook.message_start, first))
            assert step.chosen[layer, head, :n].tolist() == hook.reads[layer][head].tolist() + message_slots


def test_the_message_reading_units_changes_its_logits_only_where_it_leaves_slots_out(engine):
    """Under a budget that covers the region the message reads the whole chat: the full cache's logits exactly.
    Under a small one they differ (it reads less), and the reply decodes on from there."""
    m = engine.model
    logits, replies = {}, {}
    for label, options in (("full cache", None), ("units, budget covering all", {"tokens": 4096}),
                           ("units, budget 24", {"tokens": 24, "buffer": 12, "unit_tokens": 8})):
        policy = None if options is None else make_policy("louiskv", engine, tau=0.5, prefill="units", **options)
        cache = m.new_cache(1024)
        starts, message = history_and_message(engine, cache)
        if policy is None:
            logits[label] = m(torch.tensor(message), cache)
            continue
        with policy.for_message(m, cache, starts, [], message):
            logits[label] = m(torch.tensor(message), cache)
            reads = policy.last_prefill.reads
        assert len(reads) == (0 if options["tokens"] == 4096 else engine.config.n_layers)
        cache.truncate(cache.length - len(message))
        with policy.for_message(m, cache, starts, [], message):
            replies[label] = generate(m, cache, message, decoder=engine.tokenizer.stream_decoder(), max_tokens=6,
                                      policy=policy).tokens
    torch.testing.assert_close(logits["units, budget covering all"], logits["full cache"], atol=0, rtol=0)
    assert (logits["units, budget 24"] - logits["full cache"]).abs().max() > 1e-3
    assert all(len(r) >= 1 for r in replies.values())


def test_bad_prefill_is_one_line(engine):
    with pytest.raises(KvchatError, match="prefill reads the whole chat \\(full\\) or units \\(units\\), not 'abc'"):
        make_policy("louiskv", engine, tau=0.5, prefill="abc")
    assert math.isclose(make_policy("quest", engine, prefill="units").tokens, 1024)


class RowsFromAFullCache:
    """A LazyChat over a cache holding the whole chat (what the store would give): brings rows into the lazily
    resumed cache as asked, and counts them."""

    def __init__(self, full, cache, cfg):
        self.full, self.cache = full, cache
        self.held = torch.zeros(cfg.n_layers, cfg.n_kv_heads, full.length, dtype=torch.bool)
        self.rows, self.spans, self.completed, self.rows_before_complete = 0, [], 0, None
        self.verified_before_complete = 0  # the message's checks of what was brought in, before its first token

    def _bring(self, layer: int, head: int, slots: torch.Tensor) -> None:
        slots = slots[~self.held[layer, head, slots]]
        self.cache.layer(layer)[:, head, slots] = self.full.layer(layer)[:, head, slots]
        self.held[layer, head, slots] = True
        self.rows += len(slots)

    def ensure(self, layer, slots):
        for head in range(slots.shape[0]):
            self._bring(layer, head, slots[head].long().cpu())

    def ensure_span(self, start, end):
        self.spans.append((start, end))
        self._bring_span(start, end)

    def _bring_span(self, start, end):
        for layer in range(self.held.shape[0]):
            for head in range(self.held.shape[1]):
                self._bring(layer, head, torch.arange(start, end))

    def verify(self):
        self.verified_before_complete += not self.completed

    def complete(self):
        self.completed += 1
        self.rows_before_complete = self.rows
        self._bring_span(0, self.full.length)


def lazily_resumed(engine, policy, with_units: bool):
    """The chat of `history_and_message` computed whole, and a cache of its length holding none of its K/V (the
    rounds' units at hand where `with_units`), with a LazyChat over the first."""
    m = engine.model
    full = m.new_cache(1024)
    starts, message = history_and_message(engine, full)
    cache = m.new_cache(1024)
    cache.length = full.length
    if with_units:  # what a restore reads from the store: each round's units
        policy._round_starts = [*starts, full.length]
        for a, b in zip(policy._round_starts, policy._round_starts[1:]):
            policy.units(full, list(range(engine.config.n_layers)), a, b)
        cache.units.update(full.units)
    return full, cache, starts, message, RowsFromAFullCache(full, cache, engine.config)


@pytest.mark.parametrize("with_units", [True, False])
def test_a_lazily_resumed_chat_brings_in_only_what_its_message_reads_then_answers_as_a_full_one(engine, with_units):
    """The message's first token from the units its layers chose, brought in on demand (the same token as over the
    whole chat); then the rest brought in and the message computed again, so that the reply and every slot's K/V
    are the fully restored chat's, exactly."""
    m, cfg = engine.model, engine.config
    options = dict(tokens=24, sinks=4, buffer=12, unit_tokens=8)

    def answer(cache, starts, message, policy, lazy=None):
        policy.lazy = lazy
        with policy.for_message(m, cache, starts, [], message):
            return generate(m, cache, message, decoder=engine.tokenizer.stream_decoder(), max_tokens=8,
                            policy=policy).tokens

    policy = make_policy("louiskv", engine, tau=0.5, **options)
    full, cache, starts, message, rows = lazily_resumed(engine, policy, with_units)
    lazily = answer(cache, starts, message, policy, rows)
    assert rows.completed == 1 and policy.lazy is None and m.sparse_prefill is None
    # before the first token: the units' rows each layer read (and, without stored units, the rounds they are
    # made from), not the chat
    chat_rows = cfg.n_layers * cfg.n_kv_heads * full.length
    if with_units:
        assert not rows.spans and 0 < rows.rows_before_complete < 0.5 * chat_rows
        assert rows.verified_before_complete == 1  # once, at the message's last layer
    else:  # both rounds' units made from their keys: both rounds brought in whole first
        assert rows.spans == [(0, starts[1]), (starts[1], full.length)] or \
            sorted(rows.spans) == [(0, starts[1]), (starts[1], full.length)]
        assert rows.rows_before_complete == chat_rows
    assert rows.rows == chat_rows  # then everything
    # the same first token as the message reading units over the whole chat ...
    whole = m.new_cache(1024)
    starts_w, message_w = history_and_message(engine, whole)
    units_policy = make_policy("louiskv", engine, tau=0.5, prefill="units", **options)
    assert answer(whole, starts_w, message_w, units_policy)[0] == lazily[0]
    # ... and from there on the fully restored chat's reply and K/V (its message read the whole chat)
    restored = m.new_cache(1024)
    starts_r, message_r = history_and_message(engine, restored)
    full_reply = answer(restored, starts_r, message_r, make_policy("louiskv", engine, tau=0.5, **options))
    assert full_reply[0] == lazily[0], "the chat's first token differs over units: pick a chat where it does not"
    assert full_reply == lazily
    assert cache.length == restored.length
    for layer in range(cfg.n_layers):
        assert torch.equal(cache.layer(layer)[:, :, : cache.length], restored.layer(layer)[:, :, : cache.length])


def test_a_lazily_resumed_chat_whose_region_fits_the_budget_is_brought_in_whole_before_the_message(engine):
    """A budget that covers the region: the message reads the whole chat densely, so all of it comes in first."""
    m, cfg = engine.model, engine.config
    policy = make_policy("louiskv", engine, tau=0.5, tokens=4096)
    full, cache, starts, message, rows = lazily_resumed(engine, policy, with_units=True)
    policy.lazy = rows
    with policy.for_message(m, cache, starts, [], message):
        lazily = generate(m, cache, message, decoder=engine.tokenizer.stream_decoder(), max_tokens=4,
                          policy=policy).tokens
    assert rows.spans == [(0, full.length)] and rows.rows_before_complete == cfg.n_layers * cfg.n_kv_heads * full.length
    whole = m.new_cache(1024)
    starts_w, message_w = history_and_message(engine, whole)
    assert generate(m, whole, message_w, decoder=engine.tokenizer.stream_decoder(), max_tokens=4).tokens == lazily
