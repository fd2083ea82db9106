"""LoopServe's progressive decode-time selection (engine.policies.progressive_decode) and the `loopserve` policies."""

from __future__ import annotations

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.model.cuda_graph import GraphedDecode
from kvchat.engine.engine import Engine
from kvchat.engine.model.attention import SplitAttend
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.progressive_decode import ProgressiveDecode
from kvchat.errors import KvchatError

QUESTION = ("My dog is called Rex. Our canoe is called Blue Heron. My sister lives in Lisbon. The cat is called "
            "Miso. What is my dog called?")


@pytest.fixture(scope="module")
def model():
    return Engine(DEFAULT_MODEL, device="cpu")


def prefilled(engine, capacity=256):
    m = engine.model
    prompt = engine.encode_prompt(QUESTION)
    cache = m.new_cache(capacity)
    logits = m(torch.tensor(prompt), cache)[-1]
    return cache, logits, len(prompt)


def decode(step, first_logits, n):
    tokens, rows = [int(first_logits.argmax())], [first_logits]
    for _ in range(n):
        rows.append(step(tokens[-1]).clone())
        tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


def test_a_budget_holding_the_whole_input_decodes_as_the_full_cache(model):
    m = model.model
    cache, logits, n = prefilled(model)
    full_tokens, full = decode(GraphedDecode(m, cache, 200, capture=False), logits, 12)
    cache, logits, n = prefilled(model)
    step = ProgressiveDecode(m, cache, 0, 200, budget=n, interval=4, warmup=4, capture=False)
    tokens, got = decode(step, logits, 12)
    assert step.selections == 3  # after tokens 4, 8 and 12
    assert tokens == full_tokens
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_a_small_budget_attends_to_the_inputs_most_attended_slots(model):
    m, cfg = model.model, model.config
    cache, logits, n = prefilled(model)
    step = ProgressiveDecode(m, cache, 0, 200, budget=8, interval=4, warmup=4, capture=False)
    tokens, got = decode(step, logits, 4)  # the choice is made after the 4th token
    assert step.selections == 1
    assert (step.base == 8).all()
    # The choice, recomputed by hand for one layer: the 4 latest tokens' softmax over every slot, summed.
    layer, end = 3, cache.length
    q = step.queries[:, layer].float()  # [4, H, D], tokens in order (the ring has just wrapped)
    keys = cache.layer(layer)[0, :, :end].float().repeat_interleave(cfg.n_rep, 0)
    scores = torch.einsum("thd,hnd->htn", q, keys) * cfg.softmax_scale
    causal = torch.arange(end)[None, :] <= torch.arange(end - 4, end)[:, None]
    mass = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).sum(1)[:, :n]
    mass = mass.view(cfg.n_kv_heads, cfg.n_rep, n).sum(1)
    for head in range(cfg.n_kv_heads):
        want = set(mass[head].topk(8).indices.tolist())
        assert set(step.chosen[layer, head, :8].tolist()) == want
        assert step.chosen[layer, head, 8:12].tolist() == list(range(n, n + 4))  # then the reply
    # The same tokens through the full cache: the same logits up to the choice, other logits after it.
    full_cache, _, _ = prefilled(model)
    full = GraphedDecode(m, full_cache, 200, capture=False)
    for i, token in enumerate(tokens[:4]):
        torch.testing.assert_close(full(token), got[i + 1], rtol=1e-5, atol=1e-5)
    assert (full(tokens[4]) - step(tokens[4])).abs().max() > 1e-3


def test_pooling_keeps_the_neighbours_of_the_most_attended_slots(model):
    m, cfg = model.model, model.config
    cache, logits, n = prefilled(model)
    step = ProgressiveDecode(m, cache, 0, 200, budget=9, interval=4, warmup=4, capture=False, pool=3)
    decode(step, logits, 4)
    layer, end = 2, cache.length
    q = step.queries[:, layer].float()
    keys = cache.layer(layer)[0, :, :end].float().repeat_interleave(cfg.n_rep, 0)
    scores = torch.einsum("thd,hnd->htn", q, keys) * cfg.softmax_scale
    causal = torch.arange(end)[None, :] <= torch.arange(end - 4, end)[:, None]
    mass = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).sum(1)[:, :n]
    mass = mass.view(cfg.n_kv_heads, cfg.n_rep, n).sum(1)
    pooled = torch.stack([mass[:, max(0, i - 1) : i + 2].amax(1) for i in range(n)], 1)  # the max of i-1, i, i+1
    for head in range(cfg.n_kv_heads):
        chosen = set(step.chosen[layer, head, :9].tolist())
        assert chosen == set(pooled[head].topk(9).indices.tolist())
        peak = int(mass[head].argmax())
        assert {peak - 1, peak, peak + 1} & set(range(n)) <= chosen  # the peak comes with its neighbours
    with pytest.raises(ValueError, match="pool"):
        ProgressiveDecode(m, cache, 0, 200, pool=0)


def test_under_a_round_policy_each_layer_chooses_among_what_it_may_see(model):
    m = model.model
    cache, logits, n = prefilled(model)
    # pretend slots [0, n - 10) are history whose upper layers (from 4) see only slots 5..20
    attend = SplitAttend(4, torch.arange(5, 20))
    step = ProgressiveDecode(m, cache, n - 10, 200, budget=6, interval=2, warmup=2, attend=attend, capture=False)
    assert int(step.base[0]) == n and int(step.base[5]) == 15 + 10  # before the first choice: everything seen
    decode(step, logits, 2)
    allowed = set(range(5, 20)) | set(range(n - 10, n))
    for layer in range(4, model.config.n_layers):
        for head in range(model.config.n_kv_heads):
            assert set(step.chosen[layer, head, :6].tolist()) <= allowed


def test_layers_that_see_fewer_slots_than_the_budget_keep_all_they_see(model):
    m, cfg = model.model, model.config
    cache, logits, n = prefilled(model)
    attend = SplitAttend(4, torch.arange(5, 20))  # layers from 4 see 15 history slots and the 10 of the prompt
    step = ProgressiveDecode(m, cache, n - 10, 200, budget=30, interval=2, warmup=2, attend=attend, capture=False)
    decode(step, logits, 2)
    assert step.selections == 1 and n > 30
    assert step.base[:4].tolist() == [30] * 4 and step.base[4:].tolist() == [25] * (cfg.n_layers - 4)
    for layer in range(4, cfg.n_layers):
        for head in range(cfg.n_kv_heads):
            assert sorted(step.chosen[layer, head, :25].tolist()) == list(range(5, 20)) + list(range(n - 10, n))


def test_the_choice_is_the_same_whatever_the_grouping_of_layers(model, monkeypatch):
    """Without the kernel the choice scores groups of layers at once, as many as SCORE_BYTES holds: one group of
    every layer here, or (SCORE_BYTES = 1) one layer at a time, and the same slots either way."""
    runs = []
    for score_bytes in (ProgressiveDecode.SCORE_BYTES, 1):
        monkeypatch.setattr(ProgressiveDecode, "SCORE_BYTES", score_bytes)
        cache, logits, n = prefilled(model)
        step = ProgressiveDecode(model.model, cache, 0, 200, budget=8, interval=4, warmup=4, capture=False)
        decode(step, logits, 4)
        runs.append((len(step._groups), step.chosen[:, :, :8].sort(-1).values))
    assert runs[0][0] == 1 and runs[1][0] == model.config.n_layers
    assert torch.equal(runs[0][1], runs[1][1])


def test_on_gemma_the_global_layers_choose_and_rings_change_nothing(models):
    """Gemma 3's sliding-window layers keep their window; the global layers choose. With the window layers in rings
    (apart from the global layers' keys) the choice and the reply are those of a cache of every slot."""
    from kvchat.engine.train.synthetic import REFERENCE_MODELS

    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")
    m, prompt = engine.model, engine.encode_prompt(QUESTION)
    runs = []
    for ring in (False, True):
        cache = m.new_cache(256, ring=ring)
        logits = m(torch.tensor(prompt), cache)[-1]
        step = ProgressiveDecode(m, cache, 0, 200, budget=6, interval=4, warmup=4, capture=False)
        tokens, rows = decode(step, logits, 8)
        assert step.layers == [i for i in range(engine.config.n_layers) if not engine.config.window(i)]
        runs.append((tokens, rows, step.chosen[step.layers, :, :6].sort(-1).values))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][2], runs[1][2])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-5)


def test_the_policies_take_their_options_and_refuse_bad_ones(model):
    policy = make_policy("loopserve", model, budget=64, interval=8)
    assert policy.budget == 64 and policy.interval == 8 and policy.pool == 7
    assert make_policy("loopserve", model, pool=1).pool == 1  # the paper's choice of single slots
    with pytest.raises(KvchatError, match="at least 1"):
        make_policy("loopserve", model, pool=0)
    with pytest.raises(KvchatError, match="takes no option"):
        make_policy("loopserve", model, watershed=2)
    with pytest.raises(KvchatError, match="at least 1"):
        make_policy("loopserve", model, budget=0)
    with pytest.raises(KvchatError, match="takes no option"):
        make_policy("loopserve+round", model, nope=1)
    both = make_policy("loopserve+round", model, watershed=2, budget=32)
    assert both.watershed == 2 and both.budget == 32


def test_the_policy_turns_sparse_prefill_on_for_its_message_only(model):
    m = model.model
    policy = make_policy("loopserve", model)
    cache = m.new_cache(64)
    undo = policy.prepare(m, cache, [], [])
    assert m.sparse_prefill is policy.sparse_prefill and m.sparse_prefill.min_keys == 0
    undo()
    assert m.sparse_prefill is None


def test_a_chat_runs_under_loopserve(model, kvchat_home):
    """ChatSession under loopserve answers as the policy does on a fresh cache: the message's prefill sparse, the
    reply read through a budget chosen again as it goes (here 8 slots, chosen every token), the model dense again
    after the message."""
    from kvchat.app.session.chat import ChatSession
    from kvchat.engine.generate import generate
    from kvchat.app.session.policies import chat_policy
    from kvchat.engine.reply_guard import ReplyGuard
    from kvchat.engine.policies.sparse_prefill import DEFAULT_MIN_KEYS
    from kvchat.storage.db import Store
    from kvchat.storage.fingerprint import model_fingerprint

    m, options = model.model, dict(budget=8, warmup=1, interval=1, min_keys=0)
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt="")
    policy = make_policy("loopserve", model, **options)
    chat = ChatSession(store, model, sid, policy=policy)
    prompt = model.chat.open_round_tokens(chat.conversation(), QUESTION)
    got = chat.send(QUESTION, max_tokens=12)
    chat.close()
    assert m.sparse_prefill is None and policy.sparse_prefill.stats.calls > 0 and policy.last_decode is not None

    again = make_policy("loopserve", model, **options)
    undo = again.prepare(m, m.new_cache(256), [], [])
    try:
        want = generate(m, m.new_cache(256), prompt, decoder=model.tokenizer.stream_decoder(), max_tokens=12,
                        stop_tokens=model.tokenizer.eog_ids, stop_strings=model.chat.stop_strings, policy=again,
                        **model.guarding(ReplyGuard()))
    finally:
        undo()
    assert got.tokens == want.tokens
    assert chat_policy("loopserve", model).min_keys == DEFAULT_MIN_KEYS  # chats: sparse only where measured faster


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_captured_step_is_the_eager_step():
    """On CUDA the step is captured once and replayed through the choices (the per-head lists rewritten between
    replays): the same logits as the same step run uncaptured, through the decode kernel's per-head slot lists."""
    engine = Engine(DEFAULT_MODEL, device="cuda")
    runs = []
    for capture in (True, False):
        cache, logits, n = prefilled(engine)
        step = ProgressiveDecode(engine.model, cache, 0, 200, budget=12, interval=4, warmup=4, capture=capture)
        runs.append(decode(step, logits, 14))
        assert step.selections == 3
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)
