"""The restore pipeline: a chat's first rounds recomputed while the rest loads, planned from the machine's profile;
compaction of what every plan recomputes; and the planner itself on made-up machines."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from cli_run import kvchat
from kvchat.app.session import layout as session_layout, restore as restore_module
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.layout import storage_groups
from kvchat.app.session.compaction import compact_session
from kvchat.app.session.artifacts import load_profile, profile_path, save_profile
from kvchat.app.session.profile import device_name, ensure_profile, fit_prefill, profile_planner
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.generate import prefill
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep
from kvchat.engine.restore.plan import (HardwareProfile, RestorePlan, RoundLayout, best_overlap_seconds,
                                        check_pyramid, fixed_plan, load_everything, plan_groups, plan_restore,
                                        synthetic_rounds)
from kvchat.storage.db import Store
from kvchat.storage.failpoints import COMPACT_POINTS
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.fingerprint import model_fingerprint

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
FACTS = ["My name is Ada.", "My sister's name is Mira.", "I live in Lisbon.", "My dog is called Rex.",
         "I was born in 1990.", "My car is a blue Fiat."]
QUESTION = "What is my sister's name?"


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def made_up_profile(engine, fingerprint: str, **changes) -> HardwareProfile:
    """A machine where recomputing and loading cost about the same per token and run side by side (a GPU's
    shape), for this model on this device."""
    cfg = engine.config
    base = HardwareProfile(
        fingerprint=fingerprint, device=device_name(engine.device), n_layers=cfg.n_layers, dtype="float32",
        prefill_a=2e-4, prefill_b=1e-9, disk_read_mb_s=20.0, cache_read_mb_s=40.0, decode_mb_s=20.0,
        decode_threads=1, h2d_gb_s=None, compute_slowdown=1.0, load_slowdown=1.0, kv_bytes_per_token=cfg.kv_bytes_per_token(4),
        stored_over_raw=0.85, date="2026-11-22")
    return replace(base, **changes)


def chat_of(engine, facts=FACTS, system=SYSTEM) -> tuple[Store, str]:
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt=system)
    chat = ChatSession(store, engine, sid)
    for m in facts:
        chat.send(m)
    chat.close()
    return store, sid


def fixed(prefix_of_groups):
    """A planner that always recomputes the given rounds per layer group (a pyramid)."""
    return lambda rounds, groups, background: fixed_plan(rounds, groups, prefix_of_groups(len(rounds), len(groups)))


def fresh_prefill(engine, session: ChatSession, n: int | None = None):
    """A new cache prefilled with the chat's first `n` tokens (default: all)."""
    tokens = engine.chat.conversation_tokens(session.conversation())[:n]
    ref = engine.new_cache(len(tokens) + 8)
    prefill(engine.model, ref, tokens)
    return ref


def assert_fresh(cache, engine, session, layers: slice, span: int, first: int) -> None:
    """The recomputed K/V of `layers` for the first `span` tokens (of `first` recomputed at the lowest layers) is a
    fresh prefill's: bit for bit that of the same `first` tokens, and within fp32 rounding (2e-4 of the largest
    value, after 8 layers) of a prefill of the whole chat, whose larger matrix products sum in another order (on
    the embedded model shipped 2026-11-29 up to 1.1e-4; under 1e-4 on the models before)."""
    alone, whole = fresh_prefill(engine, session, first), fresh_prefill(engine, session)
    assert torch.equal(cache.kv[layers, :, :, :span], alone.kv[layers, :, :, :span])
    assert relative_error(cache.kv[layers, :, :, :span], whole.kv[layers, :, :, :span]) < 2e-4


def answer_and_forget(session: ChatSession) -> str:
    text = session.send(QUESTION).text
    session.retract_last_round()
    return text


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("split", ["none", "first", "half", "all"])
def test_split_restores_exactly(engine, kvchat_home, split):
    store, sid = chat_of(engine)
    n = len(store.rounds(sid))
    k = {"none": 0, "first": 1, "half": n // 2, "all": n}[split]
    files = {s["file"] for s in store.segments(sid)}
    reference = ChatSession(store, engine, sid)  # kv-load
    reference.restore()
    expected = answer_and_forget(reference)
    session = ChatSession(store, engine, sid, planner=fixed(lambda rounds, groups: (k,) * groups))
    stats = session.restore()
    ends = [r.token_end for r in store.rounds(sid)]
    planned = ends[k - 1] if k else 0
    assert (stats.tokens_planned, stats.tokens_loaded, stats.tokens_recomputed) == (planned, ends[-1] - planned, 0)
    assert session.cache.length == ends[-1]
    if planned:  # the recomputed prefix is a fresh prefill's K/V (fp32 on the CPU)
        assert_fresh(session.cache, engine, session, slice(None), planned, planned)
    if planned < ends[-1]:  # the rest is what was stored, bit for bit
        assert torch.equal(session.cache.kv[:, :, :, planned:ends[-1]], reference.cache.kv[:, :, :, planned:ends[-1]])
    assert answer_and_forget(session) == expected == "Your sister's name is Mira."
    session.close()
    assert {s["file"] for s in store.segments(sid)} == files  # what the plan recomputed is not written back
    assert stats.compute_ms > 0 if planned else stats.compute_ms == 0


@pytest.mark.parametrize("cores, threads", [(64, 60), (16, 12), (8, 6), (4, 3), (2, 2), (1, 1)])
def test_decoding_beside_a_recompute_leaves_cores_to_it(monkeypatch, cores, threads):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert SegmentPrefetcher.decode_threads() == cores
    assert SegmentPrefetcher.decode_threads_beside_compute() == threads


def test_a_split_restore_decodes_on_fewer_threads(engine, kvchat_home, monkeypatch):
    """While the restoring thread queues a recompute the segments decode on fewer threads; a restore that only
    loads decodes on one per core."""
    store, sid = chat_of(engine)
    made = []

    class Recording(SegmentPrefetcher):
        def __init__(self, *args, decode_threads=None, **kwargs):
            made.append(decode_threads)
            super().__init__(*args, decode_threads=decode_threads, **kwargs)
            assert self._decoders._max_workers == (decode_threads or 16)

    monkeypatch.setattr(restore_module, "SegmentPrefetcher", Recording)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    ChatSession(store, engine, sid).restore()
    ChatSession(store, engine, sid, planner=fixed(lambda rounds, groups: (0,) * groups)).restore()
    ChatSession(store, engine, sid, planner=fixed(lambda rounds, groups: (1,) * groups)).restore()
    assert made == [None, None, 12]


@pytest.fixture
def grouped(monkeypatch):
    """The embedded model's rounds stored as four layer groups of two layers (a big model's layout)."""
    monkeypatch.setattr(session_layout, "GROUP_BYTES_PER_512_TOKENS", 256 << 10)
    assert len(storage_groups(8, 8192)) == len(storage_groups(8, 4096)) == 4  # fp32 on the CPU, bf16 on CUDA


def restored_by_pyramid(engine, pyramid):
    """A chat restored twice: loading everything (the reference, and its answer), and by `pyramid`."""
    store, sid = chat_of(engine)
    reference = ChatSession(store, engine, sid)
    reference.restore()
    expected = answer_and_forget(reference)
    session = ChatSession(store, engine, sid, planner=fixed(lambda rounds, groups: pyramid))
    stats = session.restore()
    return store, reference, expected, session, stats, [r.token_end for r in store.rounds(sid)]


@pytest.mark.parametrize("pyramid", [(3, 2, 2, 1), (4, 4, 3, 3), (6, 5, 0, 0)])
def test_valid_pyramids_restore_exactly(engine, kvchat_home, grouped, pyramid):
    store, reference, expected, session, stats, ends = restored_by_pyramid(engine, pyramid)
    assert {(s["layer_start"], s["layer_end"]) for s in store.segments(session.sid)} == {(0, 2), (2, 4), (4, 6),
                                                                                        (6, 8)}
    assert stats.tokens_planned == ends[pyramid[0] - 1] and stats.tokens_recomputed == 0
    for g, k in enumerate(pyramid):  # each layer group: its recomputed span fresh, the rest as stored
        layers = slice(2 * g, 2 * g + 2)
        span = ends[k - 1] if k else 0
        if span:
            # a group's input is the group below's output for more tokens: fresh for those, cut to its span
            first = ends[pyramid[0] - 1]
            cut = fresh_prefill(engine, session, first)
            assert relative_error(session.cache.kv[layers, :, :, :span], cut.kv[layers, :, :, :span]) < 1e-4
            if k == pyramid[0]:
                assert_fresh(session.cache, engine, session, layers, span, first)
        assert torch.equal(session.cache.kv[layers, :, :, span:ends[-1]],
                           reference.cache.kv[layers, :, :, span:ends[-1]])
    assert answer_and_forget(session) == expected


def test_invalid_pyramids_are_refused(engine):
    groups = (range(0, 2), range(2, 4), range(4, 8))
    check_pyramid(groups, (3, 3, 1))
    with pytest.raises(ValueError, match="invalid pyramid: layers 2-3 would recompute 4 rounds on hidden states of "
                                         "only 3"):
        RestorePlan(groups, (3, 4, 1))
    with pytest.raises(ValueError, match="do not tile"):
        RestorePlan((range(0, 2), range(3, 8)), (1, 1))
    with pytest.raises(ValueError, match="one prefix per layer group"):
        RestorePlan(groups, (1, 1))
    cache = engine.new_cache(64)
    with pytest.raises(ValueError, match="shrinking spans"):
        PrefixRecompute(engine.model, list(range(40)), [PyramidStep(range(0, 4), 10, cache),
                                                        PyramidStep(range(4, 8), 20, cache)])


# ---------------------------------------------------------------- the planner on made-up machines


def gpu_profile(**changes) -> HardwareProfile:
    """An H100 and an 8B model, as measured (docs/benchmarks.md), rounded."""
    base = HardwareProfile(fingerprint="0" * 64, device="cuda made up", n_layers=32, dtype="bfloat16",
                           prefill_a=3.2e-5, prefill_b=9e-10, disk_read_mb_s=1800, cache_read_mb_s=8000,
                           decode_mb_s=400, decode_threads=16, h2d_gb_s=20, compute_slowdown=1.05,
                           load_slowdown=1.0,
                           segment_overhead_ms=0.2, kv_bytes_per_token=131072, stored_over_raw=0.62)
    return replace(base, **changes)


def cpu_profile() -> HardwareProfile:
    """The 2-core CPU and the embedded model: loading wins by far and the streams share the cores."""
    return HardwareProfile(fingerprint="0" * 64, device="cpu made up", n_layers=8, dtype="float32",
                           prefill_a=1.2e-4, prefill_b=6e-8, disk_read_mb_s=800, cache_read_mb_s=4000,
                           decode_mb_s=300, decode_threads=2, h2d_gb_s=None, compute_slowdown=2.0,
                           load_slowdown=2.0, segment_overhead_ms=0.5,
                           kv_bytes_per_token=8192, stored_over_raw=0.85)


def chat_layout(profile, tokens, resident=0.0):
    groups = storage_groups(profile.n_layers, profile.kv_bytes_per_token)
    rounds = synthetic_rounds(profile, tokens, 640, groups, resident)
    return rounds, plan_groups(profile.n_layers, rounds)


def predicted(rounds, groups, profile, k):
    return fixed_plan(rounds, groups, (k,) * len(groups), profile).predicted.total_s


def test_the_planner_balances_the_streams_on_a_gpu():
    p = gpu_profile()
    rounds, groups = chat_layout(p, 32768)
    plan = plan_restore(rounds, groups, p)
    est = plan.predicted
    assert 0 < plan.prefix[0] < len(rounds)
    assert abs(est.compute_s - est.load_s) < 0.15 * max(est.compute_s, est.load_s)  # they finish together
    best_single = min(predicted(rounds, groups, p, 0), predicted(rounds, groups, p, len(rounds)))
    assert est.total_s < 0.6 * best_single
    # no flat split does better (the search is exhaustive over round boundaries)
    assert all(predicted(rounds, groups, p, k) >= est.total_s - 1e-12 for k in range(len(rounds) + 1))


@pytest.mark.parametrize("recompute, load, linear", [(1.0, 1.0, 1.0), (2.0, 1.0, 0.7), (0.3, 0.9, 0.9),
                                                       (1.5, 0.5, 0.0)])
def test_no_split_beats_perfect_overlap(recompute, load, linear):
    """The bound the benchmark reports: where the two streams finish together, and no split below it."""
    best = best_overlap_seconds(recompute, load, linear)
    cost = lambda x: max(recompute * (linear * x + (1 - linear) * x * x), load * (1 - x))  # noqa: E731
    assert min(cost(i / 1000) for i in range(1001)) == pytest.approx(best, rel=1e-3)
    assert best <= min(recompute, load)
    if linear == 1.0:
        assert best == pytest.approx(recompute * load / (recompute + load))


def test_the_planner_never_predicts_below_perfect_overlap():
    p = replace(gpu_profile(), compute_slowdown=1.0, load_slowdown=1.0)
    for tokens in (2048, 8192, 32768):
        rounds, groups = chat_layout(p, tokens)
        plan = plan_restore(rounds, groups, p)
        everything = predicted(rounds, groups, p, len(rounds))
        linear = p.prefill_a * tokens / p.prefill_seconds(tokens)
        bound = best_overlap_seconds(everything, predicted(rounds, groups, p, 0), linear)
        assert bound - 1e-9 <= plan.predicted.total_s <= 1.1 * bound + 0.01


def test_the_planner_recomputes_nothing_where_the_streams_share_a_cpu():
    p = cpu_profile()
    for tokens in (2048, 4000):
        rounds, groups = chat_layout(p, tokens)
        assert plan_restore(rounds, groups, p).prefix == (0,) * len(groups)


def test_a_warm_page_cache_means_less_recompute():
    p = gpu_profile()
    cold = plan_restore(*chat_layout(p, 32768, resident=0.0), p)
    warm = plan_restore(*chat_layout(p, 32768, resident=1.0), p)
    assert warm.prefix[0] < cold.prefix[0]
    assert warm.predicted.total_s < cold.predicted.total_s


def test_a_short_chat_on_a_gpu_is_split_too():
    p = gpu_profile()
    rounds, groups = chat_layout(p, 2048)
    plan = plan_restore(rounds, groups, p)
    assert 0 < sum(plan.prefix) < len(rounds) * len(groups)
    assert plan.predicted.total_s <= 0.8 * min(predicted(rounds, groups, p, 0), predicted(rounds, groups, p, 4))


def test_a_pyramid_splits_rounds_by_layers_when_that_is_worth_it():
    # A long round between short ones: a flat split either recomputes all of it or loads all of it.
    p = gpu_profile(compute_slowdown=1.0, decode_mb_s=2000)
    rounds = [synthetic_rounds(p, n, n, storage_groups(32, 131072))[0] for n in (500, 4000, 500)]
    groups = plan_groups(32, rounds)
    plan = plan_restore(rounds, groups, p)
    assert len(set(plan.prefix)) == 2  # a pyramid: the lower layer groups recompute more rounds
    flat = min(predicted(rounds, groups, p, k) for k in range(len(rounds) + 1))
    assert plan.predicted.total_s < 0.97 * flat


def test_absent_leading_rounds_are_recomputed_by_plan_and_others_after_loading():
    p = cpu_profile()
    rounds = synthetic_rounds(p, 4000, 500)
    compacted = [RoundLayout(r.tokens) for r in rounds[:3]] + rounds[3:]
    groups = plan_groups(8, compacted)
    plan = plan_restore(compacted, groups, p)
    assert plan.prefix == (3,)  # forced: nothing stored for them
    assert plan.store_from == (0,)  # loading would be faster here: worth storing once recomputed
    holed = rounds[:5] + [RoundLayout(rounds[5].tokens)] + rounds[6:]
    plan = plan_restore(holed, plan_groups(8, holed), p)
    assert plan.prefix == (0,) and plan.predicted.fallback_s > 0  # recomputed after loading, not by extending
    assert load_everything(compacted, groups).prefix == (3,)


@pytest.mark.parametrize("shape", [dict(), dict(compute_slowdown=1.2, decode_mb_s=250), dict(overhead=True)])
def test_a_chat_compacted_here_stores_nothing_back_here(shape):
    """Compaction drops what the warm and the cold plan both recompute; a restore on the same machine, warm, cold
    or in between, must not find storing any of it back worth it (a 32k chat on the H100 did, before)."""
    p = gpu_profile(**{k: v for k, v in shape.items() if k != "overhead"})
    if shape.get("overhead"):
        p = replace(p, segment_overhead_ms=5.0)
    layout = lambda resident: synthetic_rounds(replace(p, stored_over_raw=0.6), 32936, 646,  # noqa: E731
                                               storage_groups(32, 131072), resident)
    groups = plan_groups(32, layout(1.0))
    from kvchat.engine.restore.plan import compactable

    keep = compactable([plan_restore(layout(res), groups, p) for res in (0.0, 1.0)])
    assert keep[0] > 0
    for resident in (0.0, 0.5, 1.0):
        compacted = [RoundLayout(r.tokens, tuple(s for s in r.segments
                                                 if i >= keep[[g.start for g in groups].index(s.layers.start)]))
                     for i, r in enumerate(layout(resident))]
        plan = plan_restore(compacted, groups, p)
        assert plan.store_from == plan.prefix and all(k >= c for k, c in zip(plan.prefix, keep))


def test_round_policy_plans_cover_the_lower_tier():
    p = gpu_profile()
    rounds = synthetic_rounds(p, 32768, 640, (range(0, 4), range(4, 32)))  # as the round policy stores them
    groups = plan_groups(32, rounds, (4,))
    background = tuple(g for g, grp in enumerate(groups) if grp.start >= 4)
    plan = plan_restore(rounds, groups, p, background)
    assert plan.prefix[0] > 0 and all(plan.prefix[g] == 0 for g in background)  # upper layers: loaded later


def test_two_streams_slow_each_other_as_measured():
    p = gpu_profile(compute_slowdown=1.0, load_slowdown=1.0)
    assert p.both_seconds(0.4, 0.3) == pytest.approx(0.4)  # fully side by side: the longer one
    cpu = replace(p, compute_slowdown=2.0, load_slowdown=2.0)
    assert cpu.both_seconds(0.4, 0.3) == pytest.approx(0.7)  # sharing the cores: as if in turn
    half = replace(p, compute_slowdown=1.5, load_slowdown=1.0)
    # the recompute at 2/3 speed beside the load (0.3 s), then alone: 0.3 + (0.4 - 0.2)
    assert half.both_seconds(0.4, 0.3) == pytest.approx(0.5)


def test_restores_teach_the_planner_how_the_streams_slow_each_other(engine, kvchat_home):
    from kvchat.engine.restore.plan import OBSERVED_KEPT, OBSERVED_NEEDED, observe

    p = gpu_profile(decode_mb_s=100)  # a 32k chat's streams run long enough to tell
    rounds, groups = chat_layout(p, 32768)
    plan = plan_restore(rounds, groups, p)
    slower = observe(p, plan, 1.5 * plan.predicted.compute_s, plan.predicted.load_s)
    assert slower.observed == [[pytest.approx(1.5), pytest.approx(1.0)]] and slower.slowdowns == (1.05, 1.0)
    for _ in range(OBSERVED_NEEDED - 1):  # a few restores, then their median counts
        slower = observe(slower, plan, 1.5 * plan.predicted.compute_s, plan.predicted.load_s)
    assert slower.slowdowns == (pytest.approx(1.5), pytest.approx(1.0))
    replanned = plan_restore(rounds, groups, slower)
    assert replanned.prefix[0] < plan.prefix[0]  # a slower recompute stream gets less to do
    for _ in range(OBSERVED_KEPT + 3):
        slower = observe(slower, plan, plan.predicted.compute_s, plan.predicted.load_s)
    assert len(slower.observed) == OBSERVED_KEPT and slower.slowdowns == (1.0, 1.0)
    assert observe(p, fixed_plan(rounds, groups, (0,) * 4, p), 0.0, 1.0) is None  # one stream: nothing to learn
    small, small_groups = chat_layout(p, 2048)  # streams of milliseconds measure fixed costs: not learned from
    assert observe(p, plan_restore(small, small_groups, p), 1.0, 1.0) is None
    # The app's planner keeps what it learned in the profile file, for the next process.
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    made_up = made_up_profile(engine, fp, prefill_a=0.01, decode_mb_s=0.5)  # streams of a second or more
    save_profile(made_up)
    store, sid = chat_of(engine)
    planner = profile_planner(made_up)
    stats = ChatSession(store, engine, sid, planner=planner).restore()
    assert stats.tokens_planned and stats.tokens_loaded
    saved, _ = load_profile(fp, made_up.device, 8)
    assert len(saved.observed) == 1 and saved.observed == planner.profile.observed
    # The resume bench's planner does not learn: each of its methods restores the chat compacted and planned by the
    # profile as measured, not by what an earlier method's restores taught it (app/bench/resume_engine.py).
    from kvchat.app.bench.resume_engine import fixed_planner

    save_profile(made_up)
    bench = fixed_planner(made_up)
    assert bench(rounds, groups, ()) == plan_restore(rounds, groups, made_up)
    stats = ChatSession(store, engine, sid, planner=bench).restore()
    assert stats.tokens_planned and stats.tokens_loaded  # both streams ran, as above: the app's planner learned
    assert load_profile(fp, made_up.device, 8)[0].observed == []


def test_fitting_the_prefill_curve():
    a, b = fit_prefill([(n, 3e-5 * n + 1e-9 * n * n) for n in (512, 2048, 8192, 16384)])
    assert a == pytest.approx(3e-5, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    a, b = fit_prefill([(100, 0.01), (200, 0.02), (400, 0.04)])
    assert a == pytest.approx(1e-4) and b == pytest.approx(0, abs=1e-12)


# ---------------------------------------------------------------- profiles


def test_profile_is_measured_once_stored_and_measured_again_when_unusable(engine, kvchat_home):
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    said = []
    profile = ensure_profile(engine, fp, notice=said.append)
    path = profile_path(fp, device_name(engine.device))
    assert path.exists() and load_profile(fp, profile.device, 8) == (profile, None)
    assert profile.prefill_a > 0 and profile.disk_read_mb_s > 0 and profile.decode_mb_s > 0
    assert profile.compute_slowdown >= 1 and profile.load_slowdown >= 1 and profile.observed == []
    assert profile.h2d_gb_s is None and len(profile.prefill_points) >= 2
    path.write_text("{not json")
    assert load_profile(fp, profile.device, 8)[1].endswith("is corrupt or from another version (Expecting "
                                                           "property name enclosed in double quotes: line 1 "
                                                           "column 2 (char 1))")
    save_profile(replace(profile, fingerprint="1" * 64))
    path.write_text(profile_path("1" * 64, profile.device).read_text())  # this model's file holds another's
    assert "belongs to another model" in load_profile(fp, profile.device, 8)[1]
    said.clear()
    again = ensure_profile(engine, fp, notice=said.append, redo=True)
    assert again.fingerprint == fp and load_profile(fp, profile.device, 8)[0] == again
    assert said and said[0].startswith("measuring how fast this machine")


def test_a_corrupt_profile_is_measured_again_with_a_notice(engine, kvchat_home, monkeypatch):
    from kvchat.app.session import profile as hardware_profile

    fp = model_fingerprint(DEFAULT_MODEL, Store())
    path = profile_path(fp, device_name(engine.device))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "fingerprint": fp, "prefill_a": -1}))
    monkeypatch.setattr(hardware_profile, "_measured", {})  # a new process: nothing measured yet
    said = []
    profile = ensure_profile(engine, fp, notice=said.append)
    assert len(said) == 1 and said[0].startswith(f"the profile {path.name} is corrupt or from another version (")
    assert said[0].endswith("; measuring it again…")
    assert load_profile(fp, profile.device, 8) == (profile, None)


# ---------------------------------------------------------------- compaction


def test_compaction_drops_what_every_plan_recomputes(engine, kvchat_home):
    store, sid = chat_of(engine)
    profile = made_up_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    before = sum(s["byte_size"] for s in store.segments(sid))
    report = compact_session(store, sid, profile)
    assert 0 < len(report.rounds) < len(store.rounds(sid)) and report.rounds == list(range(len(report.rounds)))
    left = store.segments(sid)
    assert {s["round_idx"] for s in left} == set(range(len(report.rounds), len(store.rounds(sid))))
    assert report.bytes_left == sum(s["byte_size"] for s in left) < before
    assert {p.name for p in store.kv_dir.iterdir()} == store.referenced_files()  # no file left behind
    assert compact_session(store, sid, profile).dropped == 0  # a second time: nothing more
    # Reopened with the same profile: the compacted rounds recomputed by plan, nothing by fallback, nothing stored.
    session = ChatSession(store, engine, sid, planner=profile_planner(profile))
    stats = session.restore()
    assert stats.tokens_recomputed == 0 and not stats.notes and not stats.kept_rounds
    assert stats.tokens_planned >= store.rounds(sid)[len(report.rounds) - 1].token_end
    assert answer_and_forget(session) == "Your sister's name is Mira."
    session.close()
    assert store.segments(sid) == left
    # Where loading is faster (the CPU's own profile), the left-out rounds are recomputed once and kept.
    session = ChatSession(store, engine, sid, planner=profile_planner(ensure_profile(engine, profile.fingerprint)))
    stats = session.restore()
    assert stats.kept_rounds == report.rounds and stats.notes == [
        f"rounds 0-{report.rounds[-1]}: no K/V stored; recomputed, and stored since loading is faster here"]
    assert stats.tokens_recomputed == store.rounds(sid)[report.rounds[-1]].token_end and stats.tokens_planned == 0
    session.close()
    assert {s["round_idx"] for s in store.segments(sid)} == set(range(len(store.rounds(sid))))


def test_a_compacted_chat_with_damaged_segments_is_recomputed_and_says_so(engine, kvchat_home):
    store, sid = chat_of(engine)
    profile = made_up_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    report = compact_session(store, sid, profile)
    damaged = store.segments(sid)[-1]
    path = store.kv_dir / damaged["file"]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    session = ChatSession(store, engine, sid, planner=profile_planner(profile))
    stats = session.restore()
    last = len(store.rounds(sid)) - 1
    assert stats.recomputed_rounds == [last] and stats.notes[0].startswith(f"round {last}: KV segment")
    assert "corrupt" in stats.notes[0] and stats.tokens_planned > 0
    assert answer_and_forget(session) == "Your sister's name is Mira."
    session.close()  # the damaged round is stored again; the compacted ones are not
    assert {s["round_idx"] for s in store.segments(sid)} == set(range(len(report.rounds), last + 1))


def write_profile(engine, fingerprint, **changes) -> HardwareProfile:
    profile = made_up_profile(engine, fingerprint, **changes)
    save_profile(profile)
    return profile


def test_compaction_crash_loop(engine, kvchat_home):
    """SIGKILL at every step of compacting: the database stays sound, rows and files agree, the chat answers."""
    store, _ = chat_of(engine, FACTS[:1])
    write_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    for point in COMPACT_POINTS:
        store, sid = chat_of(engine, FACTS[:4], f"{SYSTEM} ({point})")  # its files are no other chat's
        rounds = store.rounds(sid)
        proc = kvchat("compact", sid, "--device", "cpu", env={"KVCHAT_CRASH_AT": point}, check=False)
        assert proc.returncode == -9, (point, proc.stderr[-500:])
        store = Store()
        assert store.integrity_ok() and store.rounds(sid) == rounds, point
        for seg in store.segments(sid):
            assert (store.kv_dir / seg["file"]).exists(), point
        store.sweep(orphan_age_s=0)
        assert {p.name for p in store.kv_dir.iterdir()} == store.referenced_files(), point
        store.close()
    out = json.loads(kvchat("compact", sid, "--device", "cpu", "--json").stdout)
    assert out["session"] == sid and out["bytes_left"] > 0
    assert kvchat("send", sid, QUESTION, "--device", "cpu", "--no-compact").stdout.strip() == \
        "Your sister's name is Mira."
    text = kvchat("show", sid).stdout
    assert "tokens recomputed by plan" in text and "plan: recompute round" in text
    assert "0 recomputed because" not in text and "could not be loaded" not in text


def test_send_compacts_in_the_background_unless_told_not_to(engine, kvchat_home):
    store, sid = chat_of(engine, FACTS[:3])
    write_profile(engine, model_fingerprint(DEFAULT_MODEL, store))  # a machine where recomputing pays
    kvchat("send", sid, FACTS[3], "--device", "cpu", "--no-compact")
    assert {s["round_idx"] for s in Store().segments(sid)} == {0, 1, 2, 3}
    kvchat("send", sid, FACTS[4], "--device", "cpu")
    kept = {s["round_idx"] for s in Store().segments(sid)}
    assert 4 in kept and 0 not in kept


def test_export_import_of_a_compacted_chat(engine, kvchat_home, tmp_path):
    from kvchat.storage.statefile import export_session, import_state

    store, sid = chat_of(engine)
    fp = model_fingerprint(DEFAULT_MODEL, store)
    report = compact_session(store, sid, made_up_profile(engine, fp))
    out = export_session(store, sid, tmp_path / "chat.kvstate")
    import zipfile

    manifest = json.loads(zipfile.ZipFile(out).read("manifest.json"))
    assert [a["round_idx"] for a in manifest["absent"]] == report.rounds
    assert all((a["layer_start"], a["layer_end"]) == (0, 8) for a in manifest["absent"])
    imported = import_state(store, out, current_fingerprint=fp, model_path=str(DEFAULT_MODEL))
    assert imported.notices == [f"the state file leaves out the K/V of {len(report.rounds)} of {len(FACTS)} rounds "
                                f"(the chat was compacted: where it was exported, recomputing them is faster than "
                                f"loading them); they are recomputed when the chat is opened, and kept if loading "
                                f"them is faster here"]
    session = ChatSession(store, engine, imported.session_id)  # no profile: load what is there, recompute the rest
    stats = session.restore()
    assert stats.tokens_recomputed == 0 and stats.tokens_planned > 0 and not stats.notes
    assert answer_and_forget(session) == "Your sister's name is Mira."


# ---------------------------------------------------------------- on a GPU: two CUDA streams at once


@pytest.mark.gpu
@pytest.mark.parametrize("pyramid", [(0, 0, 0, 0), (1, 1, 1, 1), (3, 3, 2, 2), (4, 3, 0, 0), (6, 6, 6, 6)])
def test_split_restores_exactly_on_cuda(kvchat_home, grouped, pyramid):
    engine = Engine(DEFAULT_MODEL, device="cuda")
    store, reference, expected, session, stats, ends = restored_by_pyramid(engine, pyramid)
    first = ends[pyramid[0] - 1] if pyramid[0] else 0
    assert stats.tokens_planned == first and stats.tokens_recomputed == 0
    fresh = fresh_prefill(engine, session, first) if first else None
    for g, k in enumerate(pyramid):
        layers, span = slice(2 * g, 2 * g + 2), ends[k - 1] if k else 0
        assert torch.equal(session.cache.kv[layers, :, :, span:ends[-1]],
                           reference.cache.kv[layers, :, :, span:ends[-1]])  # loaded: bit for bit
        if span and k == pyramid[0]:  # recomputed on the side stream: a fresh prefill's K/V
            assert torch.equal(session.cache.kv[layers, :, :, :span], fresh.kv[layers, :, :, :span])
    assert answer_and_forget(session) == expected


@pytest.mark.gpu
def test_profile_and_planned_restore_on_cuda(kvchat_home):
    engine = Engine(DEFAULT_MODEL, device="cuda")
    store, sid = chat_of(engine)
    profile = ensure_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    assert profile.h2d_gb_s > 0 and profile.device.startswith("cuda") and profile.compute_slowdown >= 1
    session = ChatSession(store, engine, sid, planner=profile_planner(profile))
    stats = session.restore()
    assert stats.tokens_recomputed == 0 and stats.predicted_ms > 0 and stats.plan
    assert answer_and_forget(session) == "Your sister's name is Mira."


# ---------------------------------------------------------------- under Round Attention


def round_policy(engine):
    from kvchat.engine.policies import make_policy

    return make_policy("round-topk", engine, watershed=2, k=8)  # every round kept: the full cache's answers


def test_round_policy_restores_split_the_lower_tier_and_recompute_compacted_upper_layers(engine, kvchat_home):
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt=SYSTEM)
    chat = ChatSession(store, engine, sid, policy=round_policy(engine))
    for m in FACTS:
        chat.send(m)
    chat.close()
    loaded = ChatSession(store, engine, sid, policy=round_policy(engine))
    loaded.restore()
    loaded.wait_for_upper()
    expected = answer_and_forget(loaded)
    ends = [r.token_end for r in store.rounds(sid)]
    # The plan covers the lower tier (layers 0-2): the first three rounds recomputed there, the upper layers read
    # in the background as before.
    split = ChatSession(store, engine, sid, policy=round_policy(engine),
                        planner=lambda rounds, groups, background: fixed_plan(
                            rounds, groups, tuple(0 if g in background else 3 for g in range(len(groups))),
                            background=background))
    stats = split.restore()
    assert stats.tokens_planned == ends[2] and stats.tokens_loaded == ends[-1] - ends[2]
    assert torch.equal(split.cache.lower.kv[:, :, :, ends[2]:ends[-1]], loaded.cache.lower.kv[:, :, :, ends[2]:ends[-1]])
    split.wait_for_upper()
    assert answer_and_forget(split) == expected
    # A chat compacted by the full cache's plan lost its first rounds' upper layers too: the round policy's
    # restore recomputes them exactly (all layers of those rounds) and keeps them in host memory.
    profile = made_up_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    report = compact_session(store, sid, profile)
    assert report.rounds
    first = len(report.rounds)
    compacted = ChatSession(store, engine, sid, policy=round_policy(engine))
    stats = compacted.restore()
    assert stats.tokens_planned == ends[first - 1] and stats.tokens_recomputed == 0 and not stats.notes
    for i in range(first):  # exact upper layers, not the approximation of a round recomputed alone
        assert compacted.cache.host[i] is not None and loaded.cache.host[i] is not None
        # fp32 sums in another order (chunked recompute vs the first prefill): 1e-4 apart; a round recomputed
        # without its context would be ~1e-1 off
        assert relative_error(compacted.cache.host[i].float(), loaded.cache.host[i].float()) < 5e-4
    compacted.wait_for_upper()
    assert answer_and_forget(compacted) == expected
