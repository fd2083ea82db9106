"""Chats stored with layer pairs merged (Krul): what is stored, what a restore gives back, damaged or missing
merged segments, undoing merges, and state files."""

from __future__ import annotations

import pytest
import torch
from cli_run import kvchat

from kvchat.app.session import layout
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.merges import ChatMerges
from kvchat.engine.kv.cross_layer import LayerPair, approximate_pair
from kvchat.engine.engine import Engine
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, Store
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.statefile import export_session, import_state

MESSAGES = ["The quick brown fox jumps over the lazy dog.", "My name is Alice and I live in Paris.",
            "Remember that my sister's birthday is on the 14th of March.", "What is the capital of France?"]
PAIRS = [LayerPair(1, 2)]


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models.get(style="chatml", arch="qwen2", n_layers=4), device="cpu")


@pytest.fixture
def two_groups(monkeypatch):
    """Each round stored as two files, layers 0-1 and 2-3: the pair (1, 2) crosses them."""
    monkeypatch.setattr(layout, "storage_groups", lambda n_layers, _: (range(0, 2), range(2, n_layers)))


def merged_chat(store: Store, engine: Engine, messages=MESSAGES, pairs=PAIRS, share=0.5) -> ChatSession:
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt="Be brief.")
    merges = ChatMerges(store, sid, engine, "", share, allowed=pairs, gamma=0.0)
    chat = ChatSession(store, engine, sid, merges=merges)
    for m in messages:
        chat.send(m, max_tokens=8)
    chat.close()
    return chat


def expected_restore(chat: ChatSession, pairs=PAIRS) -> torch.Tensor:
    """The live cache with each round's merged layers as a restore of them gives them back."""
    kv = chat.cache.kv[:, :, :, : chat.cache.length].clone()
    for r in chat.rounds:
        for p in pairs:
            span = slice(r.token_start, r.token_end)
            both = approximate_pair(kv[p.low, :, :, span], kv[p.high, :, :, span])
            kv[p.low, :, :, span], kv[p.high, :, :, span] = both[0], both[1]
    return kv


def test_merged_rounds_are_stored_as_zeros_plus_a_merged_segment_and_restore_to_the_merge(engine, two_groups):
    store = Store()
    chat = merged_chat(store, engine)
    segs = store.segments(chat.sid)
    kv_rows = [s for s in segs if s["kind"] == SEGMENT_KV]
    merged = [s for s in segs if s["kind"] == SEGMENT_MERGED]
    assert len(kv_rows) == 2 * len(chat.rounds) and all(s["merged"] == "1+2" for s in kv_rows)
    assert len(merged) == len(chat.rounds) and all((s["layer_start"], s["layer_end"]) == (1, 3) for s in merged)
    assert store.layer_stats(chat.sid)["probes"] == 2 * len(MESSAGES) - 1  # the first message: too little before it
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0 and not stats.notes
    n = chat.cache.length
    got = reopened.cache.kv[:, :, :, :n]
    assert torch.equal(got[[0, 3]], chat.cache.kv[[0, 3], :, :, :n])  # layers not merged: bit for bit
    torch.testing.assert_close(got, expected_restore(chat))
    assert not torch.equal(got[1], chat.cache.kv[1, :, :, :n])  # merged: an approximation
    out = kvchat("show", chat.sid)
    assert "layers 1+2 merged" in out.stdout and "1+2 (4 rounds)" in out.stdout


def test_merged_bytes_are_fewer(engine, two_groups, kvchat_home):
    plain = merged_chat(Store(kvchat_home / "a"), engine, pairs=[])
    one = merged_chat(Store(kvchat_home / "b"), engine, pairs=[LayerPair(0, 3), LayerPair(1, 2)])
    both = merged_chat(Store(kvchat_home / "c"), engine, pairs=[LayerPair(0, 3), LayerPair(1, 2)], share=1.0)
    size = lambda chat: sum(s["byte_size"] for s in chat.store.segments(chat.sid))  # noqa: E731
    # a pair stores one layer's K/V, its length ratios and its retained tokens (5%) twice: 4 layers in 3.2, 2.3
    assert size(both) < 0.65 * size(plain) and size(one) < 0.85 * size(plain)
    assert {s["merged"] for s in both.store.segments(both.sid) if s["kind"] == SEGMENT_KV} == {"0+3,1+2"}


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_or_missing_merged_segment_recomputes_its_round(engine, two_groups, damage):
    store = Store()
    chat = merged_chat(store, engine)
    victim = next(s for s in store.segments(chat.sid) if s["kind"] == SEGMENT_MERGED and s["round_idx"] == 2)
    if damage == "corrupt":
        path = store.kv_dir / victim["file"]
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        store.drop_segment_rows(chat.sid, [(2, SEGMENT_MERGED, 1)])
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    assert stats.recomputed_rounds == [2] and any(n.startswith("round 2:") for n in stats.notes)
    if damage == "missing":
        assert any("merged K/V of layers 1+2 missing" in n for n in stats.notes)
    r = chat.rounds[2]
    span = slice(r.token_start, r.token_end)
    torch.testing.assert_close(reopened.cache.kv[0, :, :, span], chat.cache.kv[0, :, :, span])
    assert (reopened.cache.kv[1:3, :, :, span].abs().sum(-1) > 0).all()  # real K/V where the file held zeros
    reopened.close()  # stored again, whole (this session does not merge)
    rows = [s for s in store.segments(chat.sid) if s["kind"] == SEGMENT_KV and s["round_idx"] == 2]
    assert rows and all(s["merged"] == "" for s in rows)
    again = ChatSession(store, engine, chat.sid).restore()
    assert again.tokens_recomputed == 0, again.notes


def test_unmerge_recomputes_merged_rounds_and_stores_them_whole(engine):
    store = Store()
    chat = merged_chat(store, engine)
    store.update_session(chat.sid, settings={"merge": 0.5})
    out = kvchat("unmerge", chat.sid, "--device", "cpu")
    assert "4 merged rounds recomputed" in out.stdout
    segs = Store().segments(chat.sid)
    assert not [s for s in segs if s["kind"] == SEGMENT_MERGED] and all(not s["merged"] for s in segs)
    assert "merge" not in Store().session(chat.sid)["settings"]
    reopened = ChatSession(Store(), engine, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0
    n = chat.cache.length
    torch.testing.assert_close(reopened.cache.kv[:, :, :, :n], chat.cache.kv[:, :, :, :n], atol=1e-5, rtol=1e-5)


def test_a_merged_chat_survives_export_and_import(engine, tmp_path):
    store = Store()
    chat = merged_chat(store, engine)
    out = export_session(store, chat.sid, tmp_path / "chat.kvchat")
    import json
    import zipfile

    manifest = json.loads(zipfile.ZipFile(out).read("manifest.json"))
    assert manifest["version"] == 2 and any(s["kind"] == SEGMENT_MERGED for s in manifest["segments"])
    result = import_state(store, out, current_fingerprint=model_fingerprint(engine.path, store),
                          model_path=engine.path)
    reopened = ChatSession(store, engine, result.session_id)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0
    torch.testing.assert_close(reopened.cache.kv[:, :, :, :chat.cache.length], expected_restore(chat))


def _tiered_upper(session: ChatSession) -> torch.Tensor:
    """Every round's upper K/V as the tiered cache holds it, segment layout [Lu, 2, Hkv, tokens, D]."""
    for r in range(len(session.rounds)):
        session.cache.ensure_upper(r)
    return torch.cat([session.cache.round_upper(r) for r in range(len(session.rounds))], dim=3)


def test_a_merged_chat_opened_under_the_round_policy_unmerges_its_upper_layers(engine):
    from kvchat.engine.policies.round_attention import RoundAttention

    store = Store()
    chat = merged_chat(store, engine, pairs=[LayerPair(2, 3)])
    tiered = ChatSession(store, engine, chat.sid, policy=RoundAttention(watershed=1))
    stats = tiered.restore()
    assert stats.tokens_recomputed == 0 and not stats.notes
    want = expected_restore(chat, [LayerPair(2, 3)])
    torch.testing.assert_close(_tiered_upper(tiered), want[2:])
    torch.testing.assert_close(tiered.cache.lower.kv[:, :, :, :chat.cache.length], want[:2])


def test_a_tiered_chat_merges_in_its_upper_tier_and_either_cache_reads_it(engine):
    from kvchat.engine.policies.round_attention import RoundAttention

    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt="Be brief.")
    # no statistics in a tiered chat: the model's checked pairs, here (0, 1) below the split and (2, 3) above it
    merges = ChatMerges(store, sid, engine, "", 1.0, allowed=[LayerPair(0, 1), LayerPair(2, 3)])
    chat = ChatSession(store, engine, sid, policy=RoundAttention(watershed=1), merges=merges)
    for m in MESSAGES[:3]:
        chat.send(m, max_tokens=8)
    chat.close()
    segs = store.segments(sid)
    assert {s["merged"] for s in segs if s["kind"] == SEGMENT_KV and s["layer_start"] == 2} == {"2+3"}
    assert all(s["merged"] == "" for s in segs if s["kind"] == SEGMENT_KV and s["layer_start"] == 0)
    assert [(s["layer_start"], s["layer_end"]) for s in segs if s["kind"] == SEGMENT_MERGED] == [(2, 4)] * 3
    live = _tiered_upper(chat)  # the live chat keeps its exact K/V
    want = live.clone()
    for r in chat.rounds:
        span = slice(r.token_start, r.token_end)
        want[0, :, :, span], want[1, :, :, span] = approximate_pair(live[0, :, :, span], live[1, :, :, span])
    reopened = ChatSession(store, engine, sid, policy=RoundAttention(watershed=1))
    assert reopened.restore().tokens_recomputed == 0
    torch.testing.assert_close(_tiered_upper(reopened), want)
    assert not reopened.restored.notes
    full = ChatSession(store, engine, sid)
    assert full.restore().tokens_recomputed == 0
    torch.testing.assert_close(full.cache.kv[2:, :, :, :chat.cache.length], want)


def test_a_share_outside_0_to_1_is_refused(engine):
    from kvchat.errors import KvchatError

    with pytest.raises(KvchatError, match="share of layers merged"):
        ChatMerges(Store(), "x", engine, "", 1.5, allowed=[])
    sid = Store().create_session(title="t", model_fingerprint=model_fingerprint(engine.path, Store()),
                                 model_path=engine.path, system_prompt=None)
    proc = kvchat("send", sid, "hello", "--merge", "1.5", "--device", "cpu", check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "1.5" in proc.stderr


def test_merge_stores_an_existing_chat_merged_and_keeps_merging(engine, monkeypatch):
    store = Store()
    chat = merged_chat(store, engine, pairs=[])  # stored whole
    assert not any(s["kind"] == SEGMENT_MERGED for s in store.segments(chat.sid))
    merges = ChatMerges(store, chat.sid, engine, "", 0.5, allowed=PAIRS, gamma=0.0)
    session = ChatSession(store, engine, chat.sid, merges=merges)
    session.restore()
    assert session.store_merged() == len(chat.rounds)
    session.close()
    assert {s["merged"] for s in store.segments(chat.sid) if s["kind"] == SEGMENT_KV} == {"1+2"}
    reopened = ChatSession(store, engine, chat.sid)
    assert reopened.restore().tokens_recomputed == 0
    torch.testing.assert_close(reopened.cache.kv[:, :, :, :chat.cache.length], expected_restore(chat))


def test_merge_and_show_from_the_command_line(engine):
    store = Store()
    chat = merged_chat(store, engine, pairs=[])
    # the model's check, as stored on its first use (the check itself: test_cross_layer.py)
    from dataclasses import asdict

    from kvchat.app.session.artifacts import merge_calibration_path
    from kvchat.engine.calibrate.merge_check import MergeCalibration
    from kvchat.paths import write_json_atomically

    fp = model_fingerprint(engine.path, store)
    write_json_atomically(merge_calibration_path(fp), asdict(MergeCalibration(
        fp, 4, ["1+2"], {"1+2": 1.0}, [0.9] * 4, 0.5, 0.05, 8, "2026-11-23")), "merge calibration")
    out = kvchat("merge", chat.sid, "--share", "0.5", "--device", "cpu")
    assert f"{chat.sid}: " in out.stdout and "rounds stored with layers" in out.stdout
    assert Store().session(chat.sid)["settings"]["merge"] == 0.5  # its new rounds are merged too
    bad = kvchat("merge", chat.sid, "--share", "0", check=False)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_compaction_drops_merged_pairs_with_the_rows_that_name_them(engine, two_groups):
    from test_restore_pipeline import made_up_profile

    from kvchat.app.session.compaction import compact_session
    from kvchat.app.session.profile import profile_planner

    store = Store()
    chat = merged_chat(store, engine)
    fp = model_fingerprint(engine.path, store)
    cheap = made_up_profile(engine, fp, prefill_a=1e-9, prefill_b=1e-15)  # recomputing anything beats loading
    report = compact_session(store, chat.sid, cheap)
    assert report.rounds == list(range(len(chat.rounds)))
    assert store.segments(chat.sid) == [] and {p.name for p in store.kv_dir.iterdir()} == store.referenced_files()
    stats = ChatSession(store, engine, chat.sid, planner=profile_planner(cheap)).restore()
    assert stats.tokens_recomputed == 0 and not stats.notes  # all recomputed by plan, exactly


def test_the_benchmarks_merged_copy_of_a_random_weight_chat(engine):
    """kvchat bench's kv-merge: a fork of the stored chat, re-stored merged at r_l 0.5 by the ranking alone (random
    weights: neither the I-R test nor the check means anything there), restored like kv-load."""
    from kvchat.app.bench.resume_engine import _merged_copy

    store = Store()
    chat = merged_chat(store, engine, pairs=[])
    fork, figures = _merged_copy(store, engine, chat.sid, "llama-3.2-1b")  # a random-weight shape's name
    assert not figures["merge_checked"] and len(figures["merge_pairs"]) == 1 and figures["merge_rounds"] == 4
    plain = sum(s["byte_size"] for s in store.segments(chat.sid))
    assert figures["merge_disk_bytes"] == sum(s["byte_size"] for s in store.segments(fork)) < 0.9 * plain
    assert ChatSession(store, engine, fork).restore().tokens_recomputed == 0


def test_a_merge_setting_that_is_not_a_share_is_a_one_line_error(engine):
    from kvchat.app.session.merges import chat_merges
    from kvchat.errors import KvchatError

    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt=None, settings={"merge": "lots"})
    with pytest.raises(KvchatError, match="merge setting 'lots' is not a share"):
        chat_merges(store, store.session(sid), engine, None)
    assert chat_merges(store, {**store.session(sid), "settings": {}}, engine, None) is None


@pytest.fixture(scope="module")
def gemma(models):
    from kvchat.engine.train.synthetic import REFERENCE_MODELS

    return Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")  # window 8 on 6 of 7 layers


def _exact_stats(engine: Engine, session: ChatSession):
    """The statistics of a probe at each round's end of a cache of the whole chat computed afresh, every slot of
    every layer (no ring, nothing trimmed): what a probe of a round's end reads, whatever the chat holds now."""
    from kvchat.engine.generate import prefill
    from kvchat.engine.policies.layer_stats import LayerStats

    tokens = [t for span in engine.chat.round_spans(session.conversation()) for t in span]
    cache = engine.model.new_cache(len(tokens))
    prefill(engine.model, cache, tokens)
    stats = LayerStats(engine.config.n_layers)
    stats.add_probes(engine.model, cache, [(r.token_end, tokens[r.token_start:r.token_end]) for r in session.rounds])
    return stats


@pytest.mark.parametrize("slack", [16, None], ids=["ring-moved-on", "ring-holds-all"])
def test_merging_a_sliding_window_chat_probes_each_round_end_within_its_window(gemma, monkeypatch, slack):
    """`kvchat merge` of a Gemma 3 chat: the restored cache's rings hold only the chat's last window (and slack) of
    the sliding-window layers, and zeros where rounds were stored trimmed, yet a probe at an early round's end reads
    its own rows' windows: the statistics are those of probes on the whole chat computed afresh, and the chat's cache
    is left as it was. (It raised "layer 0's ring holds slots [..), not all of [..)" once a ring had moved past an
    early round, and read the trimmed zeros before that.)"""
    from kvchat.engine.kv import cache as cache_module
    from kvchat.engine.policies.layer_stats import LayerStats

    if slack is not None:
        # a ring of 24 (the probe's 16 rows read back 23 slots): wrapped several times by the chat
        monkeypatch.setattr(cache_module, "RING_SLACK", slack)
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(gemma.path, store),
                               model_path=gemma.path, system_prompt="Be brief.")
    plain = ChatSession(store, gemma, sid)  # stored before it merged: no statistics yet
    for m in MESSAGES:
        plain.send(m, max_tokens=8)
    plain.close()
    merges = ChatMerges(store, sid, gemma, "", 0.5, allowed=[LayerPair(1, 2)], gamma=0.0)
    session = ChatSession(store, gemma, sid, merges=merges)
    session.restore()
    cache = session.cache
    assert cache.ring_size and cache.length > cache.ring_size or slack is None
    held = cache.kv.clone(), cache.ring.clone(), cache.length
    assert session.store_merged() == len(session.rounds)
    assert torch.equal(cache.kv, held[0]) and torch.equal(cache.ring, held[1]) and cache.length == held[2]
    session.close()
    got, want = LayerStats.from_dict(store.layer_stats(sid)), _exact_stats(gemma, session)
    assert got.probes == want.probes == len(MESSAGES) - 1  # the first round: too little before its end
    torch.testing.assert_close(torch.tensor(got.edge_mass), torch.tensor(want.edge_mass), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(got.distance), torch.tensor(want.distance), atol=1e-4, rtol=1e-4)
    reopened = ChatSession(store, gemma, sid, merges=ChatMerges(store, sid, gemma, "", 0.5, allowed=[LayerPair(1, 2)],
                                                                   gamma=0.0))
    assert reopened.restore().tokens_recomputed == 0
    assert reopened.send("And the capital of Italy?", max_tokens=4).tokens  # the merged chat goes on
    reopened.close()
