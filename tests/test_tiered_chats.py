"""Chats under the round policy: two segments per round, restore loads the lower layers of every round and reads
the upper layers in the background; missing upper K/V is recomputed and said."""

from __future__ import annotations

import json

import pytest
import torch

from cli_run import kvchat
from kvchat.app.session.artifacts import SHIPPED_CALIBRATION
from kvchat.app.session.chat import ChatSession
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy
from kvchat.engine.kv.tiered import TieredKV
from kvchat.storage.db import Store
from kvchat.storage.fingerprint import model_fingerprint

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
MESSAGES = ["My name is Ada.", "My sister's name is Mira.", "I live in Lisbon.", "What is my sister's name?"]


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def round_chat(engine, store: Store, rounds: int = 3) -> ChatSession:
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt=SYSTEM)
    chat = ChatSession(store, engine, sid, policy=policy(engine))
    for m in MESSAGES[:rounds]:
        chat.send(m)
    chat.close()
    return chat


def reopened_without_segment(engine, store: Store, round_idx: int, layer_start: int):
    """A round-policy chat whose one segment file is gone, and a session about to reopen it: (chat, reopened)."""
    chat = round_chat(engine, store)
    gone = next(s for s in store.segments(chat.sid)
                if s["round_idx"] == round_idx and s["layer_start"] == layer_start and s["kind"] == "kv")
    (store.kv_dir / gone["file"]).unlink()
    return chat, ChatSession(store, engine, chat.sid, policy=policy(engine))


def policy(engine):
    # Every round kept: the answers must then be the full cache's.
    return make_policy("round-topk", engine, watershed=2, k=8)


def test_rounds_are_stored_as_lower_and_upper_segments_and_restored(engine, kvchat_home):
    store = Store()
    chat = round_chat(engine, store)
    segs = store.segments(chat.sid)
    assert sorted((s["round_idx"], s["kind"], s["layer_start"], s["layer_end"]) for s in segs) == [
        (i, kind, lo, hi) for i in range(3) for kind, lo, hi in (("key-bounds", 3, 8), ("kv", 0, 3), ("kv", 3, 8))]
    reopened = ChatSession(store, engine, chat.sid, policy=policy(engine))
    stats = reopened.restore()
    assert isinstance(reopened.cache, TieredKV)
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == chat.cache.length
    n = chat.cache.length
    assert torch.equal(reopened.cache.lower.kv[:, :, :, :n], chat.cache.lower.kv[:, :, :, :n])
    # Upper layers are not on the device until a message picks their round; the background read brings them.
    # Their key bounds come with the lower layers, for rechecks.
    assert reopened.cache.upper.length == 0
    for i in range(3):
        assert torch.equal(reopened.cache.round_bounds(i), chat.cache.round_bounds(i))
    assert torch.equal(reopened._fetch_upper(1).permute(1, 2, 3, 0, 4), chat.cache.round_upper(1))
    assert reopened.send(MESSAGES[3]).text == "Your sister's name is Mira."
    reopened.close()


def test_a_full_cache_chat_opens_under_the_round_policy_and_back(engine, kvchat_home):
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt=SYSTEM)
    full = ChatSession(store, engine, sid)
    for m in MESSAGES[:3]:
        full.send(m)
    full.close()
    tiered = ChatSession(store, engine, sid, policy=policy(engine))
    assert tiered.restore().tokens_recomputed == 0
    assert tiered.send(MESSAGES[3]).text == "Your sister's name is Mira."
    tiered.close()
    again = ChatSession(store, engine, sid)  # rounds stored either way restore into a full cache
    assert again.restore().tokens_recomputed == 0 and again.cache.length == tiered.cache.length
    # Re-stored as the round policy stores them: a lower and an upper segment each, the same K/V.
    split = ChatSession(store, engine, sid, policy=policy(engine))
    split.restore()
    assert split.store_tiers() == 3
    split.close()
    assert {(s["layer_start"], s["layer_end"]) for s in store.segments(sid)} == {(0, 3), (3, 8)}
    assert len(list(store.kv_dir.glob("*.kvs"))) == 12  # and key bounds of each of the 4 rounds
    final = ChatSession(store, engine, sid)
    assert final.restore().tokens_recomputed == 0
    assert torch.equal(final.cache.kv[:, :, :, : again.cache.length], again.cache.kv[:, :, :, : again.cache.length])


def test_missing_upper_kv_is_recomputed_and_said(engine, kvchat_home):
    store = Store()
    chat, reopened = reopened_without_segment(engine, store, round_idx=1, layer_start=3)
    assert reopened.restore().tokens_recomputed == 0  # the lower layers were all there
    assert reopened.send(MESSAGES[3]).text
    assert reopened.cache.stats.recomputed == [1]
    last = store.last_restore(chat.sid)
    assert any(note.startswith("round 1:") and "upper layers recomputed" in note for note in last["notes"])
    reopened.close()


def test_missing_key_bounds_cost_no_recompute_and_are_computed_when_needed(engine, kvchat_home):
    store = Store()
    chat = round_chat(engine, store)
    gone = next(s for s in store.segments(chat.sid) if s["round_idx"] == 1 and s["kind"] == "key-bounds")
    (store.kv_dir / gone["file"]).unlink()
    reopened = ChatSession(store, engine, chat.sid, policy=policy(engine))
    assert reopened.restore().tokens_recomputed == 0
    assert reopened.cache.round_bounds(1) is None and reopened.cache.round_bounds(2) is not None
    reopened.cache._complete_bounds()  # what the first recheck does
    assert torch.equal(reopened.cache.round_bounds(1), chat.cache.round_bounds(1))
    reopened.close()


def test_missing_lower_kv_is_recomputed(engine, kvchat_home):
    chat, reopened = reopened_without_segment(engine, Store(), round_idx=2, layer_start=0)
    stats = reopened.restore()
    assert stats.recomputed_rounds == [2] and stats.notes[0].startswith("round 2:")
    n = chat.cache.length
    assert (reopened.cache.lower.kv[:, :, :, :n] - chat.cache.lower.kv[:, :, :, :n]).abs().max() < 1e-2
    assert reopened.send(MESSAGES[3]).text == "Your sister's name is Mira."
    reopened.close()


def test_retracting_a_round_under_the_round_policy(engine, kvchat_home):
    store = Store()
    chat = round_chat(engine, store)
    reopened = ChatSession(store, engine, chat.sid, policy=policy(engine))
    first = reopened.send(MESSAGES[3]).text
    reopened.retract_last_round()
    assert reopened.send(MESSAGES[3]).text == first
    reopened.close()


def test_send_takes_the_kv_policy(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    kvchat("send", sid, MESSAGES[0], "--device", "cpu", "--kv-policy", "round")  # calibrates on first use
    out = kvchat("send", sid, MESSAGES[1], "--device", "cpu", "--kv-policy", "round").stdout.strip()
    assert out
    store = Store()
    # the embedded model's calibrated watershed (shipped with it: layer 5 since 2026-11-28, 4 before): layers
    # [0, w + 1) and [w + 1, 8) are stored apart
    split = json.loads(SHIPPED_CALIBRATION.read_text())["watershed"] + 1
    assert {(s["layer_start"], s["layer_end"]) for s in store.segments(sid)} == {(0, split), (split, 8)}
    # a round whose K/V files are gone shows as text only, though its key bounds are still on disk
    for seg in store.segments(sid):
        if seg["round_idx"] == 0 and seg["kind"] == "kv":
            (store.kv_dir / seg["file"]).unlink()
    shown = json.loads(kvchat("show", sid, "--json").stdout)["rounds"]
    assert [r["kv"] for r in shown[:2]] == ["text only", "on disk"]
    # LoopServe runs on the full cache: the chat, stored in tiers, is read whole
    out = kvchat("send", sid, MESSAGES[3], "--device", "cpu", "--kv-policy", "loopserve").stdout.strip()
    assert out == "Your sister's name is Mira."
    bad = kvchat("send", sid, "hi", "--device", "cpu", "--kv-policy", "nearest", check=False)
    assert bad.returncode != 0 and "unknown KV policy 'nearest' for chats" in bad.stderr
    assert "full, loopserve, round" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_chat_stored_in_layer_groups_is_stored_again_in_tiers_with_key_bounds(engine, kvchat_home, monkeypatch):
    """A full-cache chat of several layer groups (as an 8B model's is stored): the restore reads the groups above
    the split in the background, and store_tiers still re-stores every round as lower, upper and key bounds."""
    from kvchat.app.session import layout
    from kvchat.app.bench.resume_engine import split_stored_rounds

    monkeypatch.setattr(layout, "storage_groups", lambda n_layers, kv_bytes: (range(0, 4), range(4, 8)))
    store = Store()
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt=SYSTEM)
    chat = ChatSession(store, engine, sid)
    for m in MESSAGES[:3]:
        chat.send(m)
    chat.close()
    assert {(s["layer_start"], s["layer_end"]) for s in store.segments(sid)} == {(0, 4), (4, 8)}
    split_stored_rounds(store, engine, sid, policy(engine))
    assert sorted((s["round_idx"], s["kind"], s["layer_start"], s["layer_end"]) for s in store.segments(sid)) == [
        (i, kind, lo, hi) for i in range(3) for kind, lo, hi in (("key-bounds", 3, 8), ("kv", 0, 3), ("kv", 3, 8))]
    reopened = ChatSession(store, engine, sid, policy=policy(engine))
    reopened.restore()
    assert reopened.cache.key_bounds.known == [True, True, True]
    reopened.close()


def test_a_dropped_tiered_chat_frees_its_cache_at_once(engine, kvchat_home):
    """A tiered chat's cache asks its session for rounds (upper_source, token_source) and the session holds the
    cache: held strongly both ways, a dropped chat's K/V stayed on the GPU until the cycle collector ran, and a run
    under an 8 GiB budget ran out of memory with the last resume's tiers beside the next one's (docs/benchmarks.md,
    issue 41)."""
    import gc
    import weakref

    store = Store()
    sid = round_chat(engine, store).sid
    collecting = gc.isenabled()
    gc.disable()
    try:
        session = ChatSession(store, engine, sid, policy=policy(engine))
        session.restore()
        session.send("And my name?", max_tokens=4)  # a message: the cache asks the session for rounds
        session.close()
        gone = weakref.ref(session.cache), weakref.ref(session)
        del session
        assert [ref() for ref in gone] == [None, None]
    finally:
        if collecting:
            gc.enable()
