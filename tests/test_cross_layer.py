"""Cross-layer merging (Krul, MiniCache): the merge itself, the attention statistics that choose the pairs, and the
selector with its check."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.engine.kv.cross_layer import (
    LayerPair, approximate_pair, merge_in_cache, merge_pair, restore_in_cache, retained_count, slerp, unmerge_pair,
)
from kvchat.engine.policies.layer_stats import BUCKETS, LayerStats, _edge_share, _late_attention, probe_layers
from kvchat.engine.policies.merge_selection import candidate_pairs, choose_pairs, greedy_pairs


def _kv(n=40, heads=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, heads, n, d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merging_two_equal_layers_is_exact(dtype):
    kv = _kv(dtype=dtype)
    out = approximate_pair(kv, kv.clone(), retain=0.1)
    if dtype == torch.float32:
        torch.testing.assert_close(out[0], kv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[1], kv, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out[0], kv) and torch.equal(out[1], kv)


@pytest.mark.parametrize("retain", [0.0, 0.05, 0.25, 1.0])
def test_retained_tokens_come_back_exactly_and_the_rest_keep_their_lengths(retain):
    x, y = _kv(seed=1), _kv(seed=2)
    merged = merge_pair(x, y, retain)
    n = x.shape[2]
    assert merged.shape == (2, 2, 2, n + retained_count(n, retain), 16)
    out = unmerge_pair(merged, n)
    keep = merged[1, 0, 0, :n, 1] > 0.5
    assert int(keep.sum()) == retained_count(n, retain)
    assert torch.equal(out[0][:, :, keep], x[:, :, keep]) and torch.equal(out[1][:, :, keep], y[:, :, keep])
    rest = ~keep
    torch.testing.assert_close(out[0][:, :, rest].norm(dim=-1), x[:, :, rest].norm(dim=-1))
    torch.testing.assert_close(out[1][:, :, rest].norm(dim=-1), y[:, :, rest].norm(dim=-1))
    # the two layers share one direction where merged
    a = out[0][:, :, rest] / out[0][:, :, rest].norm(dim=-1, keepdim=True)
    b = out[1][:, :, rest] / out[1][:, :, rest].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(a, b)


def test_the_tokens_that_differ_most_are_the_ones_retained():
    x = _kv(seed=3)
    y = x.clone() + 0.01 * _kv(seed=4)
    y[:, :, 7] = -x[:, :, 7] + 0.3 * _kv(seed=5)[:, :, 7]  # far from x in every head
    merged = merge_pair(x, y, retain=1 / 40)
    keep = merged[1, 0, 0, :40, 1] > 0.5
    assert keep.nonzero().flatten().tolist() == [7]


def test_zero_vectors_merge_to_zero_and_a_lone_zero_is_retained():
    x, y = _kv(seed=6), _kv(seed=7)
    x[:, :, 3] = 0
    y[:, :, 3] = 0  # both zero: trimmed sliding-window K/V
    y[:, :, 5] = 0  # one zero: cannot share a direction
    merged = merge_pair(x, y, retain=0)
    out = unmerge_pair(merged, 40)
    assert torch.equal(out[:, :, :, 3], torch.zeros_like(out[:, :, :, 3]))
    assert torch.equal(out[0][:, :, 5], x[:, :, 5]) and torch.equal(out[1][:, :, 5], y[:, :, 5])
    assert merged.shape[3] == 41


def test_similar_layers_lose_less_than_unrelated_ones():
    x = _kv(n=200, seed=8)
    close, far = x + 0.1 * _kv(n=200, seed=9), _kv(n=200, seed=10)
    err = lambda y: (approximate_pair(x, y, retain=0)[1] - y).norm() / y.norm()  # noqa: E731
    assert err(close) < 0.1 < err(far)


def test_a_malformed_merged_form_is_refused():
    merged = merge_pair(_kv(seed=1), _kv(seed=2), retain=0.1)
    with pytest.raises(ValueError, match="merged form"):
        unmerge_pair(merged[:, :, :, :-1], 40)  # one retained row missing
    with pytest.raises(ValueError, match="merged form"):
        unmerge_pair(merged[:1], 40)
    with pytest.raises(ValueError):
        merge_pair(_kv(n=4), _kv(n=5))


def test_slerp_runs_along_the_arc():
    a = torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    torch.testing.assert_close(slerp(a, b, 0.0), a)
    torch.testing.assert_close(slerp(a, b, 1.0), b)
    torch.testing.assert_close(slerp(a, b, 0.5 + 1e-9), slerp(a, b, 0.5), atol=1e-5, rtol=1e-5)
    angle = lambda u, v: torch.acos((u * v).sum(-1).clamp(-1, 1))  # noqa: E731
    mid = slerp(a, b, 0.3)
    torch.testing.assert_close(angle(a, mid), 0.3 * angle(a, b), atol=1e-4, rtol=1e-4)


def test_pairs_parse_and_order():
    assert LayerPair.parse("4+5") == LayerPair(4, 5) and str(LayerPair(0, 7)) == "0+7"
    with pytest.raises(ValueError):
        LayerPair(5, 4)


class _Cache:
    """A KVCache's layer view over a plain tensor (merge_in_cache uses nothing else)."""

    def __init__(self, kv):
        self.kv = kv

    def layer(self, i):
        return self.kv[i]


def test_merging_in_a_cache_is_undone_exactly():
    kv = torch.randn(4, 2, 2, 30, 8)
    cache, before = _Cache(kv.clone()), kv.clone()
    pairs = [LayerPair(0, 3)]
    saved = merge_in_cache(cache, pairs, 10, 30)
    assert torch.equal(cache.kv[:, :, :, :10], before[:, :, :, :10])  # outside the span: untouched
    assert torch.equal(cache.kv[1:3], before[1:3]) and not torch.equal(cache.kv[0], before[0])
    restore_in_cache(cache, pairs, 10, saved)
    assert torch.equal(cache.kv, before)


# ---- statistics ----

def test_uniform_attention_gives_the_edges_a_fifth_of_late_rows():
    probs = torch.full((4, 1000), 1e-3)
    share = float(_edge_share(probs, 996))
    assert abs(share - 0.2) < 0.01


def test_layer_stats_add_pool_and_round_trip():
    stats = LayerStats(3)
    profiles = torch.rand(3, 4, BUCKETS)
    profiles[1] = profiles[0]
    stats.add(torch.tensor([0.9, 0.8, 0.1]), profiles)
    dist = stats.mean_distance()
    assert dist[0][1] == pytest.approx(0.0, abs=1e-9) and dist[0][2] > 0 and dist[1][2] == pytest.approx(dist[0][2])
    both = stats.merge(stats)
    assert both.probes == 2 and both.ir_share() == pytest.approx(stats.ir_share())
    assert LayerStats.from_dict(both.as_dict()).as_dict() == both.as_dict()
    with pytest.raises(ValueError):
        LayerStats(3, 1, [0.0, 0.0], [[0.0] * 3] * 3)


class _Cfg:
    def __init__(self, n_layers, windowed=()):
        self.n_layers, self.windowed = n_layers, set(windowed)

    def window(self, layer):
        return 512 if layer in self.windowed else 0


def _stats(shares, distance):
    stats = LayerStats(len(shares), 1, list(shares), [list(r) for r in distance])
    return stats


def test_algorithm_1_skips_input_sensitive_layers_and_takes_disjoint_pairs_up_to_r_l():
    n = 6
    shares = [0.9, 0.9, 0.2, 0.9, 0.9, 0.9]  # layer 2 is input-sensitive
    d = [[abs(i - j) * 1.0 for j in range(n)] for i in range(n)]
    d[0][4] = d[4][0] = 0.1  # the most similar pair
    stats = _stats(shares, d)
    ranked = candidate_pairs(stats, _Cfg(n))
    assert ranked[0] == LayerPair(0, 4) and all(2 not in (p.low, p.high) for p in ranked)
    chosen = greedy_pairs(ranked, n, 0.5)
    used = [x for p in chosen for x in (p.low, p.high)]
    assert len(used) == len(set(used)) >= 3 and chosen[0] == LayerPair(0, 4)
    assert len(greedy_pairs(ranked, n, 0.3)) == 1  # 2 layers >= 6 * 0.3
    assert choose_pairs(stats, _Cfg(n), 0.5, allowed=[LayerPair(3, 5)]) == [LayerPair(3, 5)]
    assert choose_pairs(stats, _Cfg(n), 0.0) == [] and choose_pairs(LayerStats(n), _Cfg(n), 0.5) == []
    # a sliding-window layer pairs only with another
    windowed = candidate_pairs(stats, _Cfg(n, windowed={0, 1}))
    assert all((p.low in {0, 1}) == (p.high in {0, 1}) for p in windowed)


def test_probing_leaves_the_cache_as_it_was(models):
    from kvchat.engine.engine import Engine
    from kvchat.engine.generate import prefill

    engine = Engine(models.get(style="chatml", arch="qwen2"), device="cpu")
    model = engine.model
    tokens = list(range(5, 125))
    cache = model.new_cache(128)
    prefill(model, cache, tokens)
    before = cache.kv.clone()
    edge, profiles = probe_layers(model, cache, 100, tokens[84:100])
    assert torch.equal(cache.kv, before) and cache.length == 120
    L = engine.config.n_layers
    assert edge.shape == (L,) and profiles.shape == (L, 16, BUCKETS)
    assert ((edge >= 0) & (edge <= 1 + 1e-5)).all()
    torch.testing.assert_close(profiles.sum(-1), torch.ones(L, 16), atol=1e-4, rtol=0)
    # the probe's queries are the model's own: the last row's attention matches a fresh step's
    q = model.layers[0].queries(model.embed(torch.tensor(tokens[99:100])), model.rotations(torch.tensor([99])))
    probs = _late_attention(cache, 0, q, 99, 100, engine.config)
    assert probs.shape == (1, 100) and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    assert probe_layers(model, cache, 20, tokens[4:20]) is None  # too little before the rows


# ---- the model's check ----

def test_the_check_keeps_only_pairs_that_keep_the_answers_and_is_stored(kvchat_home):
    import json

    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.calibrate.watershed import AGREEMENT
    from kvchat.engine.engine import Engine
    from kvchat.app.session.artifacts import load_merge_calibration, merge_calibration_path
    from kvchat.app.session.policies import ensure_merge_calibration
    from kvchat.engine.calibrate.merge_check import calibrate_merges
    from kvchat.errors import KvchatError

    engine = Engine(DEFAULT_MODEL, device="cpu")
    heard = []  # progress: chat runs, never going back, done == total once at the end
    cal = calibrate_merges(engine, "a" * 64, chats=3, max_checks=4, progress=lambda *p: heard.append(p))
    assert [d for d, _ in heard] == sorted(d for d, _ in heard) and heard[0][0] == 1
    assert heard[-1][0] == heard[-1][1] and sum(1 for d, t in heard if d == t) == 1
    assert cal.n_layers == 8 and len(cal.ir_share) == 8 and cal.agreement
    assert cal.unit == "answers" and cal.chats == 3  # the embedded model is held to whole answers
    for pair, agreed in cal.agreement.items():  # accepted exactly when the merged replies agreed enough
        assert (pair in cal.accepted) == (agreed >= AGREEMENT)
    assert set(cal.accepted) | set(cal.rejected) == set(cal.agreement)
    used = [x for p in cal.pairs for x in (p.low, p.high)]
    assert len(used) == len(set(used))
    # first use stores it; later uses read it; a damaged or foreign file is a one-line error naming it
    stored = ensure_merge_calibration(engine, "b" * 64, chats=2)
    assert load_merge_calibration("b" * 64, 8).accepted == stored.accepted
    path = merge_calibration_path("b" * 64)
    good = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(KvchatError, match="corrupt"):
        load_merge_calibration("b" * 64, 8)
    path.write_text(json.dumps({**good, "accepted": ["3+99"]}))
    with pytest.raises(KvchatError, match="corrupt"):
        load_merge_calibration("b" * 64, 8)
    merge_calibration_path("c" * 64).write_text(json.dumps(good))
    with pytest.raises(KvchatError, match="another model"):
        load_merge_calibration("c" * 64, 8)
    path.write_text(json.dumps({**good, "version": 0}))
    assert load_merge_calibration("b" * 64, 8) is None  # an older check is made again, not trusted


def test_the_check_by_answers_loses_an_answer_for_any_token_it_changes():
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.calibrate.watershed import calibration_chats, reference_reply
    from kvchat.engine.engine import Engine
    from kvchat.engine.calibrate.merge_check import merged_agreement

    engine = Engine(DEFAULT_MODEL, device="cpu")
    _, dev = calibration_chats(engine, 4, phrasing="dev")
    _, trained = calibration_chats(engine, 4)
    assert [m for _, m in dev] != [m for _, m in trained]  # sentences the model was never trained on
    refs = [reference_reply(engine, c, m) for c, m in dev]
    assert merged_agreement(engine, refs, [], by_answer=True) == 1.0
    harmful = [LayerPair(0, 1), LayerPair(4, 7)]  # input-sensitive layers: the answers change
    by_answer = merged_agreement(engine, refs, harmful, by_answer=True)
    assert by_answer < 1.0 and by_answer <= merged_agreement(engine, refs, harmful)
    # given up on once it cannot pass: the most it could still have reached, below the bar and not below the truth
    early = merged_agreement(engine, refs, harmful, by_answer=True, give_up_below=1.0)
    assert by_answer <= early < 1.0 and early == 1 - 1 / len(refs)  # stopped at its first changed answer
