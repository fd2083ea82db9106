"""Per-layer KV budgets: XKV (engine.policies.xkv) and its baselines `uniform` and `pyramid`, on the embedded model."""

from __future__ import annotations

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.generate import decode_steps
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.budgets import window_queries
from kvchat.engine.policies.pyramid import pyramid_counts
from kvchat.engine.policies.xkv import XKV, allocate_greedy, allocate_top_n, layer_weights
from kvchat.errors import KvchatError
from kvchat.kernels.slot_mass import slot_mass_ref
from test_progressive_decode import decode

QUESTION = ("My dog is called Rex. Our canoe is called Blue Heron. My sister lives in Lisbon. The cat is called "
            "Miso. My brother was born in Porto. What is my dog called?")
BUDGET_POLICIES = ("xkv", "uniform", "pyramid")


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def prefilled(engine, policy, capacity=256):
    """The question prefilled into a fresh cache (what the policy saw of it handed over first)."""
    m = engine.model
    prompt = engine.encode_prompt(QUESTION)
    cache = m.new_cache(capacity)
    assert policy is None or policy.visible_slots(cache, [], prompt, model=m) is None
    logits = m(torch.tensor(prompt), cache)[-1]
    return cache, logits, prompt


@pytest.mark.parametrize("seed", range(5))
def test_the_global_top_n_is_the_papers_greedy_allocation(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(6, 40, generator=g) ** 4  # skewed, as attention is
    scores /= scores.sum(1, keepdim=True)
    for total in (0, 1, 17, 100, 240, 500):
        top_n = allocate_top_n(scores, total)
        assert top_n == allocate_greedy(scores, total)
        assert sum(top_n) == min(total, 240) and all(0 <= n <= 40 for n in top_n)


def test_a_layer_whose_attention_is_concentrated_gets_fewer_slots():
    peaked = torch.tensor([0.9, 0.05, 0.03, 0.02] + [0.0] * 12)
    flat = torch.full((16,), 1 / 16)
    counts = allocate_top_n(torch.stack([peaked, flat]), 12)
    assert counts[0] < counts[1] and sum(counts) == 12


def test_xkv_weighs_each_layer_by_how_far_its_attention_moves_the_residual_stream():
    """The same normalized scores in two layers: with equal weights (layer_weight 0, the paper's) each gets half;
    weighted by the layers' attention shares, the layer whose attention moves the stream more gets more, and the
    allocation is still the greedy one over the weighted scores. A share that is not a positive number counts as
    the smallest one measured."""
    g = torch.Generator().manual_seed(0)
    row = torch.rand(40, generator=g) ** 4
    scores = torch.stack([row, row]) / row.sum()
    shares = torch.tensor([1.6, 0.1])
    paper = XKV(budget=0.2, layer_weight=0.0).allocate(scores, 30, shares)
    assert paper == allocate_top_n(scores, 30) and abs(paper[0] - paper[1]) <= 1
    for power in (0.5, 1.0):
        weighted = XKV(budget=0.2, layer_weight=power).allocate(scores, 30, shares)
        assert weighted[0] > weighted[1] and sum(weighted) == 30
        assert weighted == allocate_greedy(scores * (shares ** power)[:, None], 30)
    assert XKV(budget=0.2).allocate(scores, 30, None) == paper  # no shares measured: the paper's
    assert layer_weights(torch.tensor([4.0, 0.0, float("nan"), 1.0]), 0.5).tolist() == [2.0, 1.0, 1.0, 1.0]


def test_the_prefill_taps_each_layers_attention_share_across_chunks_and_again_when_run_again(engine, monkeypatch):
    """QueryTap.attention_shares: per layer, the norm of what the attention adds to the residual stream over the
    norm of the stream entering the layer, over the window's tokens — the same from a prefill in one piece, in
    chunks, and from the window run again (prefill_window without a tap); by hand from the layers' own parts."""
    import kvchat.engine.policies.budgets as budgets
    from kvchat.engine.model.decoder import QueryTap

    m, cfg, prompt = engine.model, engine.config, engine.encode_prompt(QUESTION)
    layers = list(range(cfg.n_layers))
    rerun, shares = budgets.window_queries, {}
    for how in ("one piece", "chunks of 5", "run again"):
        cache = m.new_cache(256)
        m.query_tap = None if how == "run again" else QueryTap(8, norms=True)
        cache.prefill_prompt(m, prompt, chunk=5 if "chunks" in how else 4096)
        if how != "run again":  # the tap's rows, across the chunks: the window is not run again
            monkeypatch.setattr(budgets, "window_queries", lambda *a: pytest.fail("the window ran again"))
        queries, shares[how] = budgets.prefill_window(m, cache, layers, prompt[-8:])
        monkeypatch.setattr(budgets, "window_queries", rerun)
        assert m.query_tap is None and queries.shape == (cfg.n_layers, 8, cfg.n_heads, cfg.head_dim)
    for how in ("chunks of 5", "run again"):  # (float32 sums in another order)
        torch.testing.assert_close(shares[how], shares["one piece"], rtol=1e-3, atol=1e-5)
    # by hand: the layers run one by one over the whole prompt, the attention's addition taken apart
    cache = m.new_cache(256)
    h = m.embed(torch.tensor(prompt))
    rot = m.rotations(torch.arange(len(prompt)))
    want = []
    for i, layer in enumerate(m.layers):
        added = layer._attention(layer.attn_norm(h), i, rot, cache, 0, None, None)
        added = added if layer.post_attn_norm is None else layer.post_attn_norm(added)
        want.append(added[-8:].norm(dim=-1).mean() / h[-8:].norm(dim=-1).mean())
        h = layer(h, i, rot, cache, 0, None)
    torch.testing.assert_close(shares["one piece"], torch.stack(want), rtol=1e-3, atol=1e-6)
    assert shares["one piece"].min() > 0 and shares["one piece"].max() > 1.2 * shares["one piece"].min()


def test_pyramid_budgets_fall_linearly_and_keep_the_mean():
    counts = pyramid_counts(10, 50.0, 400)
    assert counts == sorted(counts, reverse=True) and sum(counts) == 500
    assert counts[-1] == round(50 / 20) and counts[0] == round(100 - 50 / 20)
    assert pyramid_counts(4, 300.0, 400) == [300] * 4  # the line would pass the input: uniform, as kvpress


def test_window_queries_are_the_prefills_and_leave_the_cache_as_it_was(engine):
    m, cfg = engine.model, engine.config
    prompt = engine.encode_prompt(QUESTION)
    cache = m.new_cache(128)
    expected: list = []
    m.run_layers(m.embed(torch.tensor(prompt)), torch.arange(len(prompt)), cache, 0, queries=expected)
    cache.length = len(prompt)
    before = cache.read(cache.layers, 0, len(prompt))
    got = window_queries(m, cache, prompt[-8:])
    assert got.shape == (cfg.n_layers, 8, cfg.n_heads, cfg.head_dim)
    for layer in range(cfg.n_layers):
        want = expected[layer].reshape(len(prompt), cfg.n_heads, cfg.head_dim)[-8:]
        # GEMMs of another shape: the order of summation differs, by up to ~2e-3 on an x86-64 CPU's AVX-512 path
        torch.testing.assert_close(got[layer], want, rtol=1e-2, atol=5e-3)
    assert torch.equal(cache.read(cache.layers, 0, len(prompt)), before)


def test_the_window_is_scored_from_the_messages_own_prefill_in_chunks_or_not(engine, monkeypatch):
    """The window's queries come from the message's prefill (QueryTap), across its chunks, so they are not run
    through every layer again; the budgets are those the second pass gave; a tap that did not see this message's
    end (a reply of one token left it, another prefill came after) is not used."""
    import kvchat.engine.policies.budgets as budgets

    m, prompt = engine.model, engine.encode_prompt(QUESTION)
    rerun = budgets.window_queries
    choices = {}
    for how in ("second pass", "tap", "tap, chunks of 5"):
        policy = make_policy("xkv", engine, budget=0.4)
        cache = m.new_cache(256)
        policy.visible_slots(cache, [], prompt, model=m)
        if how == "second pass":
            m.query_tap = None
        else:
            monkeypatch.setattr(budgets, "window_queries", lambda *a: pytest.fail("the window ran again"))
        cache.prefill_prompt(m, prompt, chunk=5 if "chunks" in how else 4096)
        choice, slots = policy.choose(m, cache)
        monkeypatch.setattr(budgets, "window_queries", rerun)
        assert m.query_tap is None  # read once
        choices[how] = choice.kept, [None if s is None else s.tolist() for s in slots]
    assert choices["tap"] == choices["second pass"] == choices["tap, chunks of 5"]
    # A tap that ends elsewhere than the cache (another chat's prefill fed it since) is left alone: the window runs
    # again, and the choice is the second pass's.
    policy = make_policy("xkv", engine, budget=0.4)
    cache = m.new_cache(256)
    policy.visible_slots(cache, [], prompt, model=m)
    cache.prefill_prompt(m, prompt)
    m.new_cache(16).prefill_prompt(m, prompt[:3])  # another chat's: the tap now holds its rows
    ran = []
    monkeypatch.setattr(budgets, "window_queries", lambda *a: ran.append(1) or rerun(*a))
    choice, slots = policy.choose(m, cache)
    assert ran == [1] and (choice.kept, [None if s is None else s.tolist() for s in slots]) == choices["second pass"]


@pytest.mark.parametrize("name", BUDGET_POLICIES)
def test_a_budget_of_the_whole_input_gives_the_full_caches_tokens(engine, name):
    m = engine.model
    cache, logits, _ = prefilled(engine, None)
    full_tokens, full = decode(decode_steps(m, cache, 13, 200, None, 0, False, make_policy("full")), logits, 12)
    policy = make_policy(name, engine, budget=1.0)
    cache, logits, prompt = prefilled(engine, policy)
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    tokens, got = decode(step, logits, 12)
    assert tokens == full_tokens
    torch.testing.assert_close(got, full)
    assert policy.last_choice.kept_share == 1.0


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("name", BUDGET_POLICIES)
def test_each_layer_reads_its_budget_of_the_most_attended_slots_and_the_window(engine, name, pooling):
    m, cfg = engine.model, engine.config
    # a short chat: the paper's window, and its choice alone (no look-ahead)
    policy = make_policy(name, engine, budget=0.25, window=8, pooling=pooling, lookahead=0)
    cache, logits, prompt = prefilled(engine, policy)
    n = len(prompt)
    step = decode_steps(m, cache, 5, 200, None, 0, False, policy)
    choice = policy.last_choice
    average = policy.kept_per_layer(n)
    assert choice.input_slots == n and average == max(8, -(-n // 4))
    assert sum(choice.kept) == cfg.n_layers * average  # every layer global here: the budget spent exactly
    if name == "uniform":
        assert set(choice.kept) == {average}
    assert step.base.tolist() == choice.kept
    # One layer's lists, recomputed by hand: the window's scores (softmax over what each of its tokens saw,
    # summed over tokens and the KV head's query heads), pooled over `pool` slots (their mean; or the best of them,
    # ties within a plateau to the larger mean), the top n_i, then the window.
    layer = max(range(cfg.n_layers), key=lambda i: choice.kept[i])
    queries = window_queries(m, cache, prompt[-8:])[layer : layer + 1]
    mass = slot_mass_ref(queries, cache.layer(layer)[0:1, :, :n], n - 8, scale=cfg.softmax_scale)[0]
    pool = policy.pool
    mean = torch.nn.functional.avg_pool1d(mass[:, None], pool, stride=1, padding=pool // 2,
                                          count_include_pad=False)[:, 0]
    best = torch.nn.functional.max_pool1d(mass[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    pooled = best + mean / 256 if pooling == "max" else mean
    n_i = choice.kept[layer] - 8
    for head in range(cfg.n_kv_heads):
        listed = step.chosen[layer, head, : choice.kept[layer]].tolist()
        assert listed[n_i:] == list(range(n - 8, n))
        kept, rest = listed[:n_i], sorted(set(range(n - 8)) - set(listed[:n_i]))
        assert len(set(kept)) == n_i and pooled[head, kept].min() >= pooled[head, rest].max()  # a top n_i
    tokens, _ = decode(step, logits, 4)
    assert len(tokens) == 5 and cache.length == n + 4


@pytest.mark.parametrize("name", BUDGET_POLICIES)
def test_a_working_set_of_the_kept_slots_decodes_as_the_slot_lists_and_holds_only_the_budget(engine, name):
    """working_set=true: each layer's kept slots gathered into a tensor of its own; the same tokens and logits as
    the slot lists over the full cache, the reply's K/V put back into the full cache when it ends, and device
    bytes of the budget (plus the reply's room) rather than every layer times the input."""
    m, cfg = engine.model, engine.config
    runs = {}
    for working_set in (False, True):
        policy = make_policy(name, engine, budget=0.25, working_set=working_set, window=8, lookahead=0)
        cache, logits, prompt = prefilled(engine, policy)
        n = len(prompt)
        step = decode_steps(m, cache, 8, 200, None, 0, False, policy)
        tokens, rows = decode(step, logits, 6)
        if working_set:
            working = step.working
            per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * rows.new_empty(0, dtype=m.dtype).element_size()
            kept = policy.last_choice.kept
            assert working.base == kept
            assert working.device_bytes() == sum(k + working.room for k in kept) * per_slot
            assert sum(kept) <= 0.25 * n * cfg.n_layers + cfg.n_layers  # the budget, rounded up per layer
            step.finish()
        runs[working_set] = tokens, rows, cache.read(range(cfg.n_layers), n, n + 6), cache.length
    (tokens, rows, reply_kv, length), (ws_tokens, ws_rows, ws_reply_kv, ws_length) = runs[False], runs[True]
    assert ws_tokens == tokens and ws_length == length
    # Equal up to float32's order of summation: attention over 10-30 gathered slots against masked attention over
    # the whole cache (SDPA blocks them differently), a difference that grows through the layers.
    finite = torch.isfinite(rows)
    assert torch.equal(finite, torch.isfinite(ws_rows))
    assert (ws_rows - rows)[finite].abs().max() <= 1e-3 * rows[finite].abs().max()
    assert (ws_reply_kv - reply_kv).abs().max() <= 1e-3 * reply_kv.abs().max()


def test_a_host_resident_chat_streams_each_message_through_the_device_and_answers_as_the_device_cache(engine):
    """HostResidentKV: the chat's K/V in host memory, each message run layer by layer over one staged layer at a
    time, scored on the way, the reply over the working set — two messages give the tokens, choices and K/V of the
    same policy over a cache on the device (up to float32's order of summation)."""
    from kvchat.engine.generate import generate
    from kvchat.engine.kv.host_resident import HostResidentKV

    m, cfg = engine.model, engine.config
    second = engine.encode_prompt("What is my brother's city?")
    runs = {}
    for resident in ("device", "host"):
        # a short chat: the paper's window; and its choice alone, which is all a host-resident chat makes
        policy = make_policy("xkv", engine, budget=0.3, working_set=True, window=8, lookahead=0)
        cache = m.new_cache(256) if resident == "device" else HostResidentKV(m, policy, 64)
        out = []
        for prompt in (engine.encode_prompt(QUESTION), second):
            if resident == "device":
                policy.visible_slots(cache, [], prompt, model=m)
            result = generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=6,
                              policy=policy)
            out.append((result.tokens, policy.last_choice.kept))
            assert cache.length == sum(len(p) for p in (engine.encode_prompt(QUESTION), second)[: len(out)]) + sum(
                len(t) - 1 for t, _ in out)
        kv = (cache if resident == "device" else cache.host).read(range(cfg.n_layers), 0, cache.length)
        runs[resident] = out, kv, cache
    (device_out, device_kv, _), (host_out, host_kv, host) = runs["device"], runs["host"]
    assert host_out == device_out  # the same replies, and each message the same kept slots per layer
    assert (host_kv - device_kv).abs().max() <= 1e-3 * device_kv.abs().max()
    # On the device between messages: the working set alone; while reading a message, one layer of the chat
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert host.device_bytes() == sum(k + host.working.room for k in host_out[-1][1]) * per_slot
    assert 0 < host.peak_stage_bytes <= host.length * per_slot  # one layer of the chat, never two
    assert host.device_bytes() < 0.5 * cfg.n_layers * host.length * per_slot


def test_a_host_resident_message_runs_in_chunks_as_in_one_piece(engine):
    """A long message streams through each layer in chunks (as a prefill on the device bounds its activations):
    the same logits, choice and K/V as in one piece."""
    from kvchat.engine.kv.host_resident import HostResidentKV

    m, cfg = engine.model, engine.config
    prompt = engine.encode_prompt(QUESTION)
    got = []
    for chunk in (4096, 7):
        policy = make_policy("xkv", engine, budget=0.3, working_set=True, window=8)  # a short chat: the paper's window
        host = HostResidentKV(m, policy, 16)  # grown on the way
        logits = host.prefill_prompt(m, prompt, chunk=chunk)
        got.append((logits, policy.last_choice.kept, host.host.read(range(cfg.n_layers), 0, len(prompt))))
    (logits, kept, kv), (chunked_logits, chunked_kept, chunked_kv) = got
    assert chunked_kept == kept
    assert (chunked_logits - logits).abs().max() <= 1e-3 * logits.abs().max()
    assert (chunked_kv - kv).abs().max() <= 1e-3 * kv.abs().max()
    host.truncate(len(prompt) - 3)  # a retracted tail: the choice is gone with it, the next reply needs a message
    with pytest.raises(RuntimeError, match="follows its message's prefill"):
        host.decode_step(m, 4, 200)


def test_sliding_window_layers_keep_their_window_in_the_working_set_and_in_a_host_resident_chat(models):
    """Gemma 3's sliding-window layers (window 8 on 6 of 7 layers) keep their last 8 input slots in the working
    set, outside the budget: the working set, the host-resident chat and the slot lists give the same tokens."""
    from kvchat.engine.generate import generate
    from kvchat.engine.kv.host_resident import HostResidentKV
    from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT

    gemma = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")
    m, cfg = gemma.model, gemma.config
    prompt = gemma.encode_prompt(REFERENCE_PROMPT)
    replies = {}
    for mode in ("lists", "working_set", "host"):
        # no look-ahead: a host-resident chat chooses from the window alone
        policy = make_policy("xkv", gemma, budget=0.3, working_set=mode != "lists", lookahead=0)
        cache = HostResidentKV(m, policy, 64) if mode == "host" else m.new_cache(128)
        if mode != "host":
            policy.visible_slots(cache, [], prompt, model=m)
        result = generate(m, cache, prompt, decoder=gemma.tokenizer.stream_decoder(), max_tokens=8, policy=policy)
        replies[mode] = result.tokens, policy.last_choice.kept
        if mode == "host":
            windowed = [i for i in range(cfg.n_layers) if cfg.window(i)]
            assert windowed and all(cache.working.base[i] == cfg.window(i) for i in windowed)
    assert replies["working_set"] == replies["lists"] == replies["host"]


def test_xkv_keeps_more_of_each_layers_attention_than_the_same_budget_spread_evenly(engine):
    """The paper's objective, with its equal weights (layer_weight 0): the most mean retention for the budget."""
    retained = {}
    for name in ("xkv", "uniform", "pyramid"):
        policy = make_policy(name, engine, budget=0.2, **({"layer_weight": 0.0} if name == "xkv" else {}))
        cache, _, _ = prefilled(engine, policy)
        choice, _ = policy.choose(engine.model, cache)
        retained[name] = sum(choice.retention) / len(choice.retention)
    assert retained["xkv"] >= retained["uniform"] and retained["xkv"] >= retained["pyramid"]


@pytest.mark.parametrize("options, message", [
    ({"budget": 0.0}, "in \\(0, 1\\]"),
    ({"budget": 1.5}, "in \\(0, 1\\]"),
    ({"budget": -0.2}, "in \\(0, 1\\]"),
    ({"tokens": 4}, "smaller than the always-kept window of 32"),
    ({"pool": 4}, "odd"),
    ({"pooling": "median"}, "avg or max"),
    ({"working_set": True, "progressive": True}, "not with progressive=true"),
    ({"head": -1}, "count of reply tokens"),
    ({"head": 4, "working_set": True}, "not with working_set"),
    ({"lookahead": -1}, "count of reply tokens \\(0 or more\\), not -1"),
])
def test_a_budget_out_of_range_is_one_line(engine, options, message):
    for name in BUDGET_POLICIES:
        with pytest.raises(KvchatError, match=message) as info:
            make_policy(name, engine, **options)
        assert "\n" not in str(info.value)


def test_a_reply_head_reads_every_slot_then_joins_the_window(engine, monkeypatch):
    """`head`: the reply's first tokens decode over the full cache (its tokens and logits exactly), then the budgets
    are chosen with them in the window and kept like the window's slots; their queries run once together after the
    message's tapped ones, which gives the choice a second pass of the whole window gives."""
    import kvchat.engine.policies.budgets as budgets

    m, head = engine.model, 3
    cache, logits, _ = prefilled(engine, None)
    full_tokens, full = decode(decode_steps(m, cache, 13, 200, None, 0, False, make_policy("full")), logits, 12)
    rerun, ran, chosen = budgets.window_queries, [], {}
    monkeypatch.setattr(budgets, "window_queries", lambda model, c, t: ran.append(len(t)) or rerun(model, c, t))
    for how in ("the message's tap, the head run once", "the whole window run again"):
        policy = make_policy("xkv", engine, budget=0.25, window=8, head=head)
        cache, logits, prompt = prefilled(engine, policy)
        choose = policy.choose
        monkeypatch.setattr(policy, "choose", lambda model, c: chosen.setdefault(how, choose(model, c)))
        step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
        tokens, rows = [int(logits.argmax())], [logits]
        for _ in range(head):  # the head: nothing chosen yet
            rows.append(step(tokens[-1]).clone())
            tokens.append(int(rows[-1].argmax()))
        assert how not in chosen and policy.last_choice is None
        assert tokens == full_tokens[: head + 1]
        torch.testing.assert_close(torch.stack(rows), full[: head + 1], rtol=1e-5, atol=1e-5)
        ran.clear()
        if how == "the whole window run again":
            m.query_tap = None
        step(tokens[-1])  # the choice, then the first token over the kept slots
        assert ran == ([head] if how.startswith("the message") else [8 + head])
        n = len(prompt) + head
        choice, slots = chosen[how]
        assert choice.input_slots == n and policy.kept_per_layer(n) == max(8 + head, -(-n // 4))
        for layer in choice.global_layers:  # the window kept whole: the message's last 8 tokens and the head
            assert all(row[-8 - head :].tolist() == list(range(n - 8 - head, n)) for row in slots[layer])
    tapped, again = chosen["the message's tap, the head run once"][0], chosen["the whole window run again"][0]
    assert tapped.kept == again.kept and tapped.retention == pytest.approx(again.retention, abs=1e-5)
    assert [s.tolist() for s in chosen["the message's tap, the head run once"][1] if s is not None] == [
        s.tolist() for s in chosen["the whole window run again"][1] if s is not None]


def test_a_look_ahead_chooses_with_the_full_caches_own_reply_then_takes_it_back(engine, monkeypatch):
    """`lookahead` with `keep_ahead=false`: at the reply's first token the full cache's own greedy reply is decoded
    for `lookahead` tokens, their queries join the window's in the score, and they leave the cache as it was: the
    choice is the one made by hand over the input with those tokens teacher-forced after it, and the reply, from its
    first token on, decodes over the kept slots."""
    import kvchat.engine.policies.budgets as budgets
    from kvchat.engine.policies.budgets import lookahead_undoable

    m, ahead_n = engine.model, 4
    cache, logits, _ = prefilled(engine, None)
    full_tokens, _ = decode(decode_steps(m, cache, 13, 200, None, 0, False, make_policy("full")), logits, 12)
    policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n, keep_ahead=False)
    cache, logits, prompt = prefilled(engine, policy)
    before = cache.read(cache.layers, 0, len(prompt)).clone()
    seen, look = {}, policy.choose_looking_ahead

    def record(model, c, ahead, kept=0):
        seen.update(ahead=list(ahead), length=c.length, kept=kept)
        seen["chosen"] = look(model, c, ahead, kept=kept)
        return seen["chosen"]

    monkeypatch.setattr(policy, "choose_looking_ahead", record)
    rerun, ran = budgets.window_queries, []
    monkeypatch.setattr(budgets, "window_queries", lambda model, c, t: ran.append(len(t)) or rerun(model, c, t))
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    first = int(logits.argmax())
    step(first)
    assert ran == [ahead_n]  # the window's queries from the message's own prefill; the look-ahead's run once
    assert seen["ahead"] == full_tokens[:ahead_n] and seen["length"] == len(prompt) + ahead_n and seen["kept"] == 0
    assert cache.length == len(prompt) + 1  # the look-ahead taken back, the reply's first token in
    torch.testing.assert_close(cache.read(cache.layers, 0, len(prompt)), before, rtol=0, atol=0)
    choice, slots = seen["chosen"]
    assert choice.input_slots == len(prompt) and policy.last_choice is choice
    assert all(s is None or int(s.max()) < len(prompt) for s in slots)

    # by hand: the input and the look-ahead teacher-forced, the window run again with it
    by_hand = make_policy("xkv", engine, budget=0.25, window=8)
    again, _, _ = prefilled(engine, by_hand)
    m(torch.tensor(full_tokens[:ahead_n]), again)
    m.query_tap = None
    scores, shares = by_hand._scores(m, again, m.cfg.global_layers, prompt[-8:] + full_tokens[:ahead_n], ahead_n)
    want_choice, want = by_hand.choice_from_scores(m.cfg, scores, len(prompt), 8, shares)
    assert want_choice.kept == choice.kept
    assert [s.tolist() for s in want if s is not None] == [s.tolist() for s in slots if s is not None]

    # over a working set of the kept slots: the same choice and tokens as over the slot lists, the look-ahead kept
    # or not
    for keep in (False, True):
        runs = {}
        for working_set in (False, True):
            policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n, working_set=working_set,
                                 keep_ahead=keep)
            cache, logits, prompt = prefilled(engine, policy)
            step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
            runs[working_set] = decode(step, logits, 8)[0], policy.last_choice.kept
            step.finish()
            assert cache.length == len(prompt) + 8
        assert runs[True] == runs[False] and runs[False][1] == choice.kept

    # a look-ahead that fails half-way (here its second step) leaves nothing of itself in the cache
    class FailsAtItsSecondToken:
        def __init__(self, inner):
            self.inner, self.fed = inner, 0

        def __call__(self, token):
            self.fed += 1
            if self.fed > 1:
                raise RuntimeError("device lost")
            return self.inner(token)

    real_lists, real_step = budgets.SlotListDecode, None
    for working_set in (False, True):  # through the slot lists' step, or the cache's own
        policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n, working_set=working_set)
        cache, logits, prompt = prefilled(engine, policy)
        real_step = cache.decode_step
        monkeypatch.setattr(budgets, "SlotListDecode", lambda *a, **k: FailsAtItsSecondToken(real_lists(*a, **k)))
        step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
        monkeypatch.setattr(cache, "decode_step", lambda *a, **k: FailsAtItsSecondToken(real_step(*a, **k)))
        with pytest.raises(RuntimeError, match="device lost"):
            step(int(logits.argmax()))
        assert cache.length == len(prompt)
        monkeypatch.undo()

    # a budget that keeps every slot looks nowhere ahead: the engine's own step, the full cache's tokens exactly
    policy = make_policy("xkv", engine, budget=1.0, lookahead=ahead_n)
    cache, logits, _ = prefilled(engine, policy)
    assert policy.decode_step(m, cache, 0, None, 200, False) is None
    tokens, _ = decode(decode_steps(m, cache, 13, 200, None, 0, False, policy), logits, 12)
    assert tokens == full_tokens

    # a sliding-window layer's ring that the look-ahead would wrap past its window: no look-ahead
    class Ring:
        ring_size, capacity = 16, 4096

    cfg = type("Cfg", (), {"sliding_window": 12})()
    assert lookahead_undoable(Ring(), cfg, 5) and not lookahead_undoable(Ring(), cfg, 6)
    Ring.capacity = 16  # a ring the size of the cache: nothing wraps
    assert lookahead_undoable(Ring(), cfg, 6)
    assert lookahead_undoable(cache, m.cfg, 1000)  # no rings: always


def test_the_look_ahead_is_the_replys_start_where_the_sampler_takes_it(engine):
    """`keep_ahead` (the default): the look-ahead's tokens are the reply's own while the sampler picks them — each
    handed the full cache's logits, nothing decoded twice — and the budgets are chosen where the reply leaves them,
    the tokens taken so far staying in the cache; a reply that ends inside its look-ahead chooses after it ended and
    leaves no more of the look-ahead in the cache than it took."""
    from kvchat.engine.policies.slot_lists import SlotListDecode

    m, ahead_n = engine.model, 4
    cache, logits, _ = prefilled(engine, None)
    full_tokens, full_rows = decode(decode_steps(m, cache, 13, 200, None, 0, False, make_policy("full")), logits, 12)
    window_only = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n, keep_ahead=False)
    cache, logits, prompt = prefilled(engine, window_only)
    decode(decode_steps(m, cache, 13, 200, None, 0, False, window_only), logits, 6)

    # greedy: the reply's first ahead_n + 1 tokens are the full cache's, then it goes on over the kept slots
    policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n)
    cache, logits, prompt = prefilled(engine, policy)
    chosen, look = [], policy.choose_looking_ahead
    policy.choose_looking_ahead = lambda *a, **k: chosen.append(look(*a, **k)) or chosen[-1]
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    tokens, rows = decode(step, logits, ahead_n - 1)
    assert tokens == full_tokens[:ahead_n] and policy.last_choice is None  # inside the look-ahead: no choice yet
    torch.testing.assert_close(rows, full_rows[:ahead_n], rtol=0, atol=2e-2)
    assert step(tokens[-1]) is not None and policy.last_choice is None  # its last logits: still the full cache's
    out = step(full_tokens[ahead_n])  # the first token past it: chosen now, with the look-ahead kept in the cache
    assert policy.last_choice.kept == window_only.last_choice.kept and cache.length == len(prompt) + ahead_n + 1

    # by hand: the look-ahead's tokens over every slot, then the same lists, then the next token
    again, _, _ = prefilled(engine, None)
    lists = SlotListDecode(m, again, 0, len(prompt) + 14, None, False)
    for t in full_tokens[:ahead_n]:
        lists(t)
    (_, slots), = chosen
    for layer, kept in enumerate(slots):
        if kept is not None:
            lists.write(layer, kept)
    torch.testing.assert_close(out, lists(full_tokens[ahead_n]), rtol=0, atol=1e-4)

    # a sampler that leaves the look-ahead at the reply's third token: two kept, the choice made there
    policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n)
    cache, logits, prompt = prefilled(engine, policy)
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    step(full_tokens[0])
    step(full_tokens[1])
    other = (full_tokens[2] + 1) % m.cfg.vocab_size
    step(other)
    assert cache.length == len(prompt) + 3 and policy.last_choice.kept == window_only.last_choice.kept
    kv = cache.read(cache.layers, len(prompt), len(prompt) + 2)
    torch.testing.assert_close(kv, again.read(again.layers, len(prompt), len(prompt) + 2), rtol=0, atol=1e-4)

    # a reply that ends inside its look-ahead (here after its second token): chosen once it ended (for the chat's
    # figures), the rest of the look-ahead taken back
    policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=ahead_n)
    cache, logits, prompt = prefilled(engine, policy)
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    step(full_tokens[0])
    step(full_tokens[1])
    assert policy.last_choice is None
    step.finish()
    assert cache.length == len(prompt) + 2 and policy.last_choice.kept == window_only.last_choice.kept


def test_the_kept_look_ahead_in_a_captured_step_and_a_choice_that_fails(engine, monkeypatch):
    """In a captured step (the stand-in graphs: each replay's logits are the graph's one output, overwritten by the
    next) the kept look-ahead hands each token its own logits: the same tokens and logits as uncaptured. A choice
    that fails where the reply leaves the look-ahead leaves the cache holding what the reply took, and nothing is
    chosen or cut again when the reply is finished."""
    from graph_standin import standin_graphs

    m = engine.model
    runs = []
    for capture in (False, True):
        policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=4)
        cache, logits, prompt = prefilled(engine, policy)
        with standin_graphs() as graphs:
            step = policy.decode_step(m, cache, 0, None, len(prompt) + 14, capture)
            runs.append(decode(step, logits, 10))
            assert len(graphs.graphs) == (1 if capture else 0)  # one graph: the look-ahead's is the budget's
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=1e-5)

    policy = make_policy("xkv", engine, budget=0.25, window=8, lookahead=4)
    cache, logits, prompt = prefilled(engine, policy)
    step = decode_steps(m, cache, 13, 200, None, 0, False, policy)
    first = int(logits.argmax())
    second = int(step(first).argmax())
    step(second)
    monkeypatch.setattr(policy, "_scores", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        step((step.ahead[2] + 1) % m.cfg.vocab_size)  # the reply leaves the look-ahead at its third token
    step.finish()
    assert cache.length == len(prompt) + 2 and policy.last_choice is None


def test_a_budget_runs_on_the_full_cache_only(engine):
    from kvchat.engine.model.attention import SplitAttend

    m = engine.model
    policy = make_policy("xkv", engine, budget=0.2)
    cache, _, _ = prefilled(engine, policy)
    with pytest.raises(KvchatError, match="full cache"):
        policy.decode_step(m, cache, 0, SplitAttend(1, torch.arange(4)), 200, False)


def test_bench_xkv_reports_each_budgets_speed_bytes_and_bound(tmp_path, engine):
    import json
    import statistics

    from cli_run import kvchat

    out = tmp_path / "xkv.json"
    proc = kvchat("bench", "xkv", "--context", "600", "--budgets", "0.4", "--repeats", "1", "--decode-tokens", "4",
                  "--device", "cpu", "--json", str(out))
    assert "xkv      0.4:" in proc.stdout and "uniform  0.4:" in proc.stdout and "of the bound's" in proc.stdout
    assert "xkv+window 0.4:" in proc.stdout and "step ready in" in proc.stdout
    [context] = json.loads(out.read_text())["contexts"]
    full = context["full"]
    assert context["context"] == 600 and len(full["tok_s"]) == 1 and full["bytes_per_token"] > context["weight_bytes"]
    for b in context["budgets"]:
        assert abs(b["kept_share"] - 0.4) < 0.01  # the budget, measured from the lists the step read
        assert context["weight_bytes"] < b["bytes_per_token"] < full["bytes_per_token"] and b["bound"] > 1
        assert b["share_of_bound"] == pytest.approx(b["speedup"] / b["bound"])
        assert b["policy"] == "xkv+host" or b["choose_ms"] > 0  # the host-resident chat chooses within its stream
        assert b["policy"] == "xkv+host" or b["ready_ms"] > 0
        # the time bound: the full step's time less the K/V time the budget leaves unread (the floor at 256 tokens)
        floor_s, full_s = 1 / context["floor"]["tok_s"], 1 / statistics.median(full["tok_s"])
        weights = context["weight_bytes"]
        kv_share = (b["bytes_per_token"] - weights) / (full["bytes_per_token"] - weights)
        assert b["time_bound"] == pytest.approx(full_s / (floor_s + max(full_s - floor_s, 0) * kv_share))
        assert b["share_of_time_bound"] == pytest.approx(b["speedup"] / b["time_bound"])
    assert context["floor"]["context"] == 256 and "the part no budget removes" in proc.stdout
    kept = next(b for b in context["budgets"] if b["policy"] == "xkv")  # as a chat runs it: the look-ahead kept
    assert kept["second_token_ms"] > 0 and kept["leave_ms"] > 0 and "look-ahead kept: second token" in proc.stdout
    held = {b["policy"]: b["working_set_bytes"] for b in context["budgets"]}
    assert held["xkv"] is None and held["uniform"] is None  # slot lists over the full cache hold nothing apart
    assert held["xkv+window"] is None
    # the working set: 40% of the input and the reply's room in every layer, under half the full cache's bytes
    assert 0.4 * context["full_kv_bytes"] * 600 / 604 < held["xkv+working-set"] < 0.5 * context["full_kv_bytes"]
    assert "working set" in proc.stdout
    host = next(b for b in context["budgets"] if b["policy"] == "xkv+host")
    per_slot = context["full_kv_bytes"] // (604 * engine.config.n_layers)  # one slot of one layer
    assert host["working_set_bytes"] == held["xkv+working-set"]  # the same choice, the same working set
    assert host["stage_bytes"] == 600 * per_slot  # one layer of the chat, staged while the message is read
    assert host["stream_ms"] > 0 and host["allocator_peak_bytes"] is None  # no allocator to ask on the CPU
    assert "streamed through the device" in proc.stdout
    bad = kvchat("bench", "xkv", "--budgets", "0", check=False)
    assert bad.returncode != 0 and "--budgets takes shares in (0, 1]" in bad.stderr


def test_progressive_budgets_are_chosen_again_by_the_reply_and_keep_each_layers_count(engine):
    from kvchat.engine.policies.progressive_decode import ProgressiveDecode

    m = engine.model
    policy = make_policy("xkv", engine, budget=0.3, progressive=True, lookahead=0)
    cache, logits, prompt = prefilled(engine, policy)
    step = decode_steps(m, cache, 40, 200, None, 0, False, policy)
    assert isinstance(step, ProgressiveDecode)
    kept = policy.last_choice.kept
    first = step.chosen[:, :, : max(kept)].clone()
    decode(step, logits, 20)  # chosen again after the 16th token
    assert step.selections == 1 and step.base.tolist() == kept
    assert not torch.equal(step.chosen[:, :, : max(kept)], first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{}, {"progressive": True}, {"working_set": True}, {"lookahead": 16}],
                         ids=str)
def test_gpu_budgets_decode_captured_as_eager_and_score_with_the_kernel(options):
    """On CUDA (the window scored by kernels/slot_mass.py's kernel, the lists or the working set read by the decode
    kernel; the look-ahead over the full cache's own step): the budgeted step captured in a CUDA graph gives the
    logits of the same step run uncaptured, after the same choice."""
    engine = Engine(DEFAULT_MODEL, device="cuda")
    runs, chosen = [], []
    for capture in (True, False):
        policy = make_policy("xkv", engine, budget=0.3, **{"lookahead": 0, **options})
        cache, logits, prompt = prefilled(engine, policy)
        step = policy.decode_step(engine.model, cache, 0, None, 200, capture)
        runs.append(decode(step, logits, 20))
        chosen.append(policy.last_choice.kept)
    assert chosen[0] == chosen[1]
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_fused_prefill_taps_the_attention_shares_the_cpu_prefill_does(engine):
    """On CUDA a prefill runs DecoderLayer.fused_prefill (the residual add left to the next norm's kernel): its tap
    gives each layer's attention share of the stream as the CPU's plain prefill does (bf16 against fp32)."""
    from kvchat.engine.model.decoder import QueryTap
    from kvchat.engine.model.decoder import fused_prefill_runs

    shares = []
    for e in (engine, Engine(DEFAULT_MODEL, device="cuda")):
        m, prompt = e.model, e.encode_prompt(QUESTION)
        cache = m.new_cache(256)
        m.query_tap = tap = QueryTap(8, norms=True)
        cache.prefill_prompt(m, prompt)
        m.query_tap = None
        shares.append(tap.attention_shares(list(range(e.config.n_layers)), len(prompt), 8))
    assert fused_prefill_runs(torch.bfloat16, torch.device("cuda"))
    torch.testing.assert_close(shares[1], shares[0], rtol=5e-2, atol=1e-3)
