"""LouisKV's retrieval over units (engine.kv.units, engine.policies.unit_retrieval, .louiskv) and its Quest-style
baseline (engine.policies.quest), on the embedded model: what a unit is, which slots a reply reads, when it chooses
again, and the retrieval trigger's calibration."""

from __future__ import annotations

import pytest
import torch

from cli_run import kvchat
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.calibrate.retrieval_trigger import TriggerCalibration, calibrate_trigger
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.kv.units import (cluster_units, in_stored_precision, joined, page_units, slots_of_best_units,
                                    unit_scores)
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.budgets import window_queries
from kvchat.errors import KvchatError

FACTS = ("My dog is called Rex. Our canoe is called Blue Heron. My sister lives in Lisbon. I was born in Porto. "
         "The cat is called Miso. ")
QUESTION = "What is my dog called?"


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def keys(seed: int, g=2, h=2, n=50, d=16) -> torch.Tensor:
    return torch.randn(g, h, n, d, generator=torch.Generator().manual_seed(seed))


def test_a_cluster_is_summarized_by_the_mean_of_its_keys():
    k = keys(0)
    units = cluster_units(k, start=10, tokens_per_cluster=8)
    assert (units.start, units.end, units.n_units) == (10, 60, 7) and units.member.shape == (2, 2, 50)
    for g in range(2):
        for h in range(2):
            for u in units.member[g, h].unique().tolist():
                mean = k[g, h, units.member[g, h] == u].mean(0)  # in 8 bits' precision, as units are stored
                summary = units.summary[g, h, u, 0]
                assert torch.equal(summary, in_stored_precision(summary))
                # e4m3 keeps 3 bits of each component: 1/16 of it at most, or 2^-9 of the largest (subnormals)
                torch.testing.assert_close(summary, mean, rtol=1 / 16, atol=float(mean.abs().max()) / 512)


def test_no_key_of_a_page_scores_above_the_pages_bound():
    k = keys(1)
    units = page_units(k, start=0, page=16)
    assert units.n_units == 4 and units.member[0, 0].tolist() == [i // 16 for i in range(50)]
    q = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(2))
    lo, hi = units.summary[:, :, :, 0], units.summary[:, :, :, 1]
    bound = torch.maximum(q[:, :, None] * lo, q[:, :, None] * hi).sum(-1)  # [G, Hkv, P]
    products = (q[:, :, None] * k).sum(-1)  # [G, Hkv, n]
    assert (products <= bound.gather(2, units.member) + 1e-5).all()


def test_scores_are_a_softmax_over_units_averaged_over_the_kv_heads_query_heads():
    summary = cluster_units(keys(3), 0, 8).summary  # [G=2, Hkv=2, U, 1, D]
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))  # H = 4: two query heads a KV head
    scores = unit_scores(q, summary, 0.25)
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, 2))
    want = torch.softmax(0.25 * q.view(2, 2, 2, 16) @ summary[:, :, :, 0].transpose(2, 3), -1).mean(2)
    torch.testing.assert_close(scores, want)


def test_the_best_units_are_read_whole_and_the_last_is_cut_at_the_budget():
    member = torch.tensor([[[0, 0, 1, 1, 1, 2, 2, 0]]])  # slots 100..107
    slots = torch.arange(100, 108)
    scores = torch.tensor([[[0.2, 0.5, 0.3]]])
    assert slots_of_best_units(scores, member, slots, 4).tolist() == [[[102, 103, 104, 105]]]  # unit 1, then 2's first
    assert slots_of_best_units(scores, member, slots, 100).tolist() == [[list(range(100, 108))]]
    # pooled over 3 slots: each slot ranked by the best unit beside it, so unit 1's neighbours 101 and 105 come first
    assert slots_of_best_units(scores, member, slots, 5, pool=3).tolist() == [[[101, 102, 103, 104, 105]]]
    _, joined_member, joined_slots = joined([cluster_units(keys(5, n=20), 0, 8), cluster_units(keys(6, n=9), 30, 8)])
    assert joined_slots.tolist() == list(range(20)) + list(range(30, 39)) and joined_member.max() == 3 + 2 - 1


def long_prompt(engine) -> list[int]:
    return engine.encode_prompt(FACTS * 8 + QUESTION)


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_a_region_no_larger_than_the_budget_gives_the_full_caches_tokens(engine, name):
    m, prompt = engine.model, long_prompt(engine)
    replies = []
    for policy in (None, make_policy(name, engine, tau=0.5) if name == "louiskv" else make_policy(name, engine)):
        cache = m.new_cache(len(prompt) + 20)
        if policy is not None:
            policy.visible_slots(cache, [], prompt, model=m)
        replies.append(generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=10,
                                policy=policy).tokens)
    assert replies[0] == replies[1]  # 1,024 slots cover the whole prompt: no choice is made


@pytest.mark.parametrize("window", [1, 6])
@pytest.mark.parametrize("name", ["louiskv", "quest"])
@pytest.mark.parametrize("told", ["before the prefill", "after it"])
def test_each_layer_reads_the_sinks_the_buffer_and_its_best_units(engine, name, told, window, monkeypatch):
    """The first choice, from the input's last `window` tokens' queries (each row a softmax over the units, averaged
    with the KV head's query heads): kept by the message's prefill when the policy is told of the message before it
    (as generation does), else run again over the cache; the same lists either way."""
    import kvchat.engine.policies.budgets as budgets

    m, cfg, prompt = engine.model, engine.config, long_prompt(engine)
    extra = {"tau": 0.5} if name == "louiskv" else {}
    policy = make_policy(name, engine, tokens=48, sinks=4, buffer=16, unit_tokens=8, window=window, **extra)
    cache = m.new_cache(len(prompt) + 20)
    if told == "before the prefill":
        policy.visible_slots(cache, [0], prompt, model=m)
        monkeypatch.setattr(budgets, "window_queries", lambda *a: pytest.fail("the last token ran again"))
    m(torch.tensor(prompt), cache)
    if told == "after it":
        policy.visible_slots(cache, [0], prompt, model=m)
    step = policy.decode_step(m, cache, 0, None, len(prompt) + 20, False)
    first = len(prompt)
    # what the step's lists hold after the prefill's choice, recomputed from the definitions
    q = window_queries(m, cache, prompt[-window:])  # [L, T, H, D]
    layers = list(range(cfg.n_layers))
    units = policy.units(cache, layers, 4, first - 16)
    summary, member, slots = joined([units])
    rows = [unit_scores(q[:, t], summary, cfg.softmax_scale) for t in range(window)]  # each row alone, then averaged
    best = slots_of_best_units(torch.stack(rows).mean(0), member, slots, 48, policy.pool)
    always = list(range(4)) + list(range(first - 16, first))
    for layer in layers:
        n = int(step.base[layer])
        assert n == 4 + 16 + 48
        for head in range(cfg.n_kv_heads):
            assert step.chosen[layer, head, :n].tolist() == sorted(always + best[layer, head].tolist())
    if name == "quest":  # whole pages of 8 slots (the region's last page may be shorter), but for one cut
        from collections import Counter

        pages = Counter((s - 4) // 8 for s in best[0, 0].tolist())
        last_page = (first - 16 - 4 - 1) // 8
        short = (first - 16 - 4) - 8 * last_page
        partial = [p for p, n in pages.items() if n != (short if p == last_page else 8)]
        assert len(partial) <= 1


def test_louiskv_retrieves_again_only_where_the_query_turns(engine):
    m, prompt = engine.model, long_prompt(engine)
    counts = {}
    for tau in (-1.0, 1.0):  # r never below -1: only the prefill's choice; always below 1: after every token
        policy = make_policy("louiskv", engine, tokens=48, buffer=16, tau=tau)
        cache = m.new_cache(len(prompt) + 20)
        policy.visible_slots(cache, [], prompt, model=m)
        out = generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=8, policy=policy)
        counts[tau] = (policy.selections, policy.decoded, len(out.tokens))
    assert counts[-1.0][0] == 1
    # the prefill's choice, then one before each later token's step (the last one's trigger chooses for no token)
    assert counts[1.0][0] == counts[1.0][1] and counts[1.0][1] == counts[1.0][2] - 1  # the last token is not fed


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_the_captured_step_and_its_choice_replay_decode_as_the_eager_ones(engine, name):
    """On a CUDA graph the trigger runs inside the step and a choice is one more replay over every global layer,
    the unflagged layers' lists kept (through the CPU stand-in for CUDA graphs): the same tokens, triggers, choices
    and lists as the eager step, which chooses for the flagged layers alone."""
    from graph_standin import standin_graphs

    m, prompt = engine.model, long_prompt(engine)
    extra = {"tau": 0.5} if name == "louiskv" else {}
    runs = []
    for graph in (False, True):
        policy = make_policy(name, engine, tokens=48, sinks=4, buffer=16, unit_tokens=8, **extra)
        cache = m.new_cache(len(prompt) + 20)
        policy.visible_slots(cache, [0], prompt, model=m)
        made = []
        real = policy.decode_step
        policy.decode_step = lambda *a: made.append(real(*a)) or made[-1]
        with standin_graphs() as graphs:
            out = generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=10,
                           policy=policy, cuda_graph=graph)
        cuts = torch.stack(policy.reply_cuts)
        runs.append((out.tokens, policy.selections, cuts.tolist(), made[0].chosen.clone(), made[0].base.clone()))
        if graph:
            step_graph, choice_graph = graphs.graphs
            assert step_graph.replays == len(out.tokens) - 1 and choice_graph.replays == policy.selections - 1
    assert runs[0][:3] == runs[1][:3]
    assert torch.equal(runs[0][3], runs[1][3]) and torch.equal(runs[0][4], runs[1][4])
    cuts = torch.tensor(runs[0][2])
    if name == "louiskv":  # some token flagged some layers and not others: the kept lists were exercised
        assert bool(((cuts.sum(1) > 0) & (cuts.sum(1) < cuts.shape[1])).any())
    else:
        assert bool(cuts.all())


def test_a_rounds_clusters_are_computed_once_for_every_later_message(engine, monkeypatch):
    import kvchat.engine.policies.louiskv as louiskv

    made = []
    real = louiskv.cluster_units
    monkeypatch.setattr(louiskv, "cluster_units", lambda k, start, *a: made.append((start, k.shape[2])) or real(
        k, start, *a))
    m = engine.model
    policy = make_policy("louiskv", engine, tokens=16, buffer=8, tau=0.5)
    cache = m.new_cache(1024)
    starts = []
    for message in (FACTS * 3, FACTS * 2 + "Remember that.", QUESTION):
        prompt = engine.encode_prompt(message)
        starts.append(cache.length)
        policy.visible_slots(cache, starts[:-1], prompt, model=m)
        generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=4, policy=policy)
    spans = [s for s, _ in made]
    assert len(spans) == len(set((s, n) for s, n in made))  # nothing clustered twice
    # the first message's own span (after the sinks, before the buffer) alone; then, once it is a closed round,
    # round 0 whole, once, kept in the cache for the third message (which clusters round 1 whole)
    assert spans.count(0) == 1 and spans[0] == 4
    assert (0, starts[1]) in cache.units and (starts[1], starts[2]) in cache.units


def test_bad_options_are_one_line(engine):
    for options in ({"tokens": 0}, {"buffer": 0}, {"tau": 1.5}, {"unit_tokens": 0}, {"pool": 4}):
        with pytest.raises(KvchatError):
            make_policy("louiskv", engine, **options)
    for window in (0, 300):  # the first choice's window: 1 to the buffer's 256 tokens
        with pytest.raises(KvchatError, match=f"window is 1 to buffer \\(256\\) tokens, not {window}"):
            make_policy("louiskv", engine, tau=0.5, window=window)
    with pytest.raises(KvchatError, match="centroid, bounds or pages, not 'mean'"):
        make_policy("louiskv", engine, tau=0.5, summary="mean")
    with pytest.raises(KvchatError, match="instep is 0 .* or 1 .*, not 2"):
        make_policy("quest", engine, instep=2)
    with pytest.raises(KvchatError, match="calibrate its retrieval trigger|tau"):
        make_policy("louiskv", engine)  # no threshold and nothing calibrated here: make_policy is pure
    with pytest.raises(KvchatError, match="3 thresholds"):
        make_policy("louiskv", engine, tau=(0.5, 0.5, 0.5))
    with pytest.raises(KvchatError, match="one per global layer separated by commas, not 'abc'"):
        make_policy("louiskv", engine, tau="abc")
    assert make_policy("louiskv", engine, tau=",".join(["0.5"] * 8)).tau == (0.5,) * 8  # as --option gives it
    proc = kvchat("eval", "--chats", "1", "--kv-policy", "louiskv", "--option", "tau=abc", check=False)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "not 'abc'" in proc.stderr


def test_the_trigger_is_calibrated_per_global_layer(engine):
    cal = calibrate_trigger(engine, "f" * 64, chats=4)
    r_share = cal.share
    assert cal.layers == list(range(8)) and len(cal.tau) == 8 and cal.steps > 8 and 0 < r_share < 1
    assert TriggerCalibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ValueError):
        TriggerCalibration.from_dict({**cal.to_dict(), "tau": [2.0] * 8})
    policy = make_policy("louiskv", engine, tau=tuple(cal.tau))
    assert policy.tau == tuple(cal.tau)


def test_a_chat_runs_under_louiskv_and_the_model_is_calibrated_on_first_use(kvchat_home):
    """`send --kv-policy louiskv`: the model's retrieval trigger is calibrated on its first use and stored; a chat
    whose input the budget covers whole answers as the full cache does."""
    import json

    messages = ["My name is Ada.", "My sister's name is Mira.", "What is my sister's name?"]
    replies = {}
    for policy in ("full", "louiskv"):
        sid = kvchat("new").stdout.strip()
        replies[policy] = [kvchat("send", sid, m, "--device", "cpu", "--kv-policy", policy, "--json").stdout
                           for m in messages]
    assert [json.loads(r)["reply"] for r in replies["louiskv"]] == [json.loads(r)["reply"] for r in replies["full"]]
    assert [json.loads(r)["kv_policy"] for r in replies["louiskv"]] == ["louiskv"] * 3
    (trigger,) = (kvchat_home / "calibrations").glob("*.trigger.json")
    assert len(json.loads(trigger.read_text())["tau"]) == 8


def test_a_choice_at_a_boundary_rewrites_the_flagged_layers_alone_as_a_choice_of_all_would(engine):
    m, prompt = engine.model, long_prompt(engine)
    policy = make_policy("louiskv", engine, tokens=48, sinks=4, buffer=16, unit_tokens=8, tau=0.5)
    cache = m.new_cache(len(prompt) + 20)
    policy.visible_slots(cache, [0], prompt, model=m)
    m(torch.tensor(prompt), cache)
    step = policy.decode_step(m, cache, 0, None, len(prompt) + 20, False)
    q = torch.randn(len(step.layers), engine.config.n_heads, engine.config.head_dim,
                    generator=torch.Generator().manual_seed(3))
    before = step.chosen.clone(), step.base.clone()
    flagged = torch.zeros(len(step.layers), dtype=torch.bool)
    flagged[[1, len(step.layers) - 1]] = True
    step.select(q, flagged)
    some = step.chosen.clone(), step.base.clone()
    step.select(q, torch.ones(len(step.layers), dtype=torch.bool))
    for j, layer in enumerate(step.layers):
        n = int(some[1][layer])
        if flagged[j]:  # as the choice of every layer made it
            assert n == int(step.base[layer]) and torch.equal(some[0][layer, :, :n], step.chosen[layer, :, :n])
        else:  # untouched
            assert n == int(before[1][layer]) and torch.equal(some[0][layer], before[0][layer])
    assert not torch.equal(before[0], step.chosen)  # the new queries chose otherwise somewhere
    # the captured choice's fixed-shape pass (every layer chosen, the unflagged ones kept) writes the same lists
    chosen_all = step.chosen.clone()
    step.chosen.copy_(before[0])
    step.base.copy_(before[1])
    step.previous.copy_(q)
    step.redo.copy_(flagged)
    step._choose_flagged()
    assert torch.equal(step.chosen, some[0]) and torch.equal(step.base, some[1])
    assert not torch.equal(step.chosen, chosen_all)


def _lists_after_each_token(engine, name: str, graph: bool, **options):
    """Decode 8 tokens under the policy; after each, whether every global layer's lists are those its latest query
    (the token's own) chooses; and the tokens, choices and final lists."""
    from graph_standin import standin_graphs

    m, prompt = engine.model, long_prompt(engine)
    policy = make_policy(name, engine, tokens=48, sinks=4, buffer=16, unit_tokens=8, **options)
    cache = m.new_cache(len(prompt) + 20)
    policy.visible_slots(cache, [0], prompt, model=m)
    own, steps, real = [], [], policy.decode_step

    def decode_step(*a):
        step = real(*a)
        after = step.after_token

        def checked():
            after()
            lists = step.lists(step.previous, step.summary, step.member, step.always)  # [G, Hkv, n]
            own.append(torch.equal(step.chosen[step.global_index, :, : lists.shape[2]], lists))

        step.after_token = checked
        steps.append(step)
        return step

    policy.decode_step = decode_step
    with standin_graphs():
        out = generate(m, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=8, policy=policy,
                       cuda_graph=graph)
    return own, (out.tokens, policy.selections, steps[0].chosen.clone(), torch.stack(policy.reply_cuts))


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_in_step_each_layer_reads_what_the_tokens_own_query_chooses(engine, name):
    """`instep=1`: each global layer chooses with the query its token just formed, before its attention reads; by
    default the choice after a token serves the next one (so the lists lag a query behind: the check can fail)."""
    extra = {"tau": 1.0} if name == "louiskv" else {}  # r < 1 at every token: every layer chooses every time
    own, _ = _lists_after_each_token(engine, name, False, instep=1, **extra)
    assert len(own) >= 6 and all(own)
    if name == "louiskv":  # one threshold per global layer, as calibrated: each layer checks its own
        n_global = sum(1 for layer in engine.model.layers if not layer.window)
        taus = tuple(1.0 if g % 2 else -1.0 for g in range(n_global))  # odd layers always fire, even ones never
        _, (_, _, _, cuts) = _lists_after_each_token(engine, name, False, instep=1, tau=taus)
        assert cuts.shape[1] == n_global and bool(cuts[:, 1::2].all()) and not bool(cuts[:, 0::2].any())
    lagging, _ = _lists_after_each_token(engine, name, False, **extra)
    assert not all(lagging)


@pytest.mark.parametrize("name", ["louiskv", "quest"])
def test_in_step_choices_decode_the_same_in_the_captured_step(engine, name):
    """In-step choices happen inside the step, kept by the trigger without a host round trip: the captured step
    (through the CPU stand-in for CUDA graphs) gives the eager step's tokens, choices and lists."""
    extra = {"tau": 0.5} if name == "louiskv" else {}
    eager = _lists_after_each_token(engine, name, False, instep=1, **extra)
    captured = _lists_after_each_token(engine, name, True, instep=1, **extra)
    assert eager[1][:2] == captured[1][:2] and torch.equal(eager[1][2], captured[1][2])
    assert torch.equal(eager[1][3], captured[1][3])
    assert eager[0] == captured[0]
    if name == "louiskv":  # at 0.5 some layers fired and some did not: the lists kept were exercised too
        assert bool(captured[1][3].any()) and not bool(captured[1][3].all())


@pytest.mark.parametrize("summary", ["bounds", "pages"])
def test_units_scored_by_bounds_or_pages_hold_every_member_keys_product(engine, summary):
    """`summary=bounds`: each cluster's min and max keys; `pages`: Quest's pages; either way no member key's product
    with a query exceeds its unit's bound, and the units are made from the span's keys (a lazy resume brings them
    in first)."""
    from kvchat.engine.policies.unit_retrieval import span_keys

    m, prompt = engine.model, long_prompt(engine)
    cache = m.new_cache(len(prompt) + 4)
    m(torch.tensor(prompt), cache)
    policy = make_policy("louiskv", engine, tau=0.5, summary=summary, unit_tokens=8)
    policy.visible_slots(cache, [0, 40], prompt[-4:])
    layers = list(range(engine.config.n_layers))
    units = policy.units(cache, layers, 10, 40)
    assert units.summary.shape[3] == 2 and policy.keys_for_units(cache, 10, 40) == (10, 40)
    keys = span_keys(cache, layers, 10, 40).float()
    q = torch.randn(*keys.shape[:2], keys.shape[-1], generator=torch.Generator().manual_seed(5))
    lo, hi = units.summary[:, :, :, 0], units.summary[:, :, :, 1]
    bound = torch.maximum(q[:, :, None] * lo, q[:, :, None] * hi).sum(-1)  # [G, Hkv, U]
    products = (q[:, :, None] * keys).sum(-1)  # [G, Hkv, n]
    assert (products <= bound.gather(2, units.member) + 1e-4).all()
    # scores over every unit of the round (a slice leaves some with no member here): finite, none to an empty one
    scores = unit_scores(torch.randn(len(layers), engine.config.n_heads, keys.shape[-1]), units.summary,
                         engine.config.softmax_scale)
    empty = units.summary[:, :, :, 0, 0] > units.summary[:, :, :, 1, 0]
    assert scores.isfinite().all() and (scores[empty] == 0).all()
    if summary == "bounds":
        assert bool(empty.any())
    if summary == "bounds":  # the clusters' members, each unit's range no wider than its own keys'
        assert torch.equal(units.member, policy._units(cache, layers, 10, 40).member)
