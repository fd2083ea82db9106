"""A lazy resume (issue 44, app/session/lazy.py): a reopened louiskv chat answers its first message from its units
and the rows its layers choose — by their units' frames (storage.unit_frames) where its rounds were stored with
them, else whole rounds — brought in on demand, then restores the rest; it stores exactly what a fully restored chat
stores, over 20 rounds; a chat that does not allow it, or a round that cannot be read, is restored whole, and said
so."""

from __future__ import annotations

from kvchat.app.session.chat import ChatSession
from kvchat.app.session.service import ChatService
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.policies import make_policy
from kvchat.engine.sampling import SamplingParams
import pytest
import torch

from kvchat.storage.db import SEGMENT_KV, SEGMENT_UNIT_ROWS, SEGMENT_UNITS, Store
from kvchat.storage.unit_frames import UnitFramesFile
from tui_support import shared_engine

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
FACTS = ["My dog is called Rex.", "Our canoe is called Blue Heron.", "My sister lives in Lisbon.",
         "I was born in Porto.", "The cat is called Miso.", "My locker number is 417.", "My boss's name is Edith.",
         "The boat is called Kestrel.", "My favorite color is teal.", "I love dumplings.", "My brother lives in Oslo.",
         "The garden gnome is called Bert."]
# The first is answered lazily: its first token comes from the units its layers chose (a reply that may differ from a
# fully restored chat's, as any louiskv reply may from the full cache's); a greeting, whose reply does not, so that
# the two chats go on with the same text and their K/V can be compared byte for byte.
LATER = ["Hello!", "Where does my sister live?", "Thanks!", "What is the boat called?",
         "My cousin's name is Ivo.", "Where was I born?", "What is my locker number?", "What is my dog called?",
         "What is the cat called?", "What is my boss's name?", "Remember that the kettle is called Zed.",
         "What is my favorite color?", "What do I love?", "Where does my brother live?", "What is my cousin's name?",
         "What is the kettle called?", "What is the canoe called?", "Thank you.", "What is the gnome called?",
         "Good night."]


def louiskv():
    return make_policy("louiskv", shared_engine(), tau=0.5, tokens=8, buffer=8, unit_tokens=8)


def stored_chat(store: Store, unit_rows: bool = False, engine=None) -> str:
    """The 12 facts' chat; `unit_rows`: answered by a session with lazy resumes on, which stores each round's unit
    frames too (in `engine`'s precision: frames of another are read as whole rounds)."""
    engine = engine or shared_engine()
    sid = ChatService(device="cpu").create_chat(DEFAULT_MODEL, SYSTEM)
    session = ChatSession(store, engine, sid, policy=make_policy("louiskv", engine, tau=0.5, tokens=8, buffer=8,
                                                                 unit_tokens=8), lazy_resume=unit_rows)
    for text in FACTS:
        session.send(text, max_tokens=12, sampling=SamplingParams())
    session.writer.drain()
    assert not session.writer.errors
    session.close()
    return sid


def unit_rows_of(store: Store, sid: str) -> dict[int, str]:
    return {s["round_idx"]: s["file"] for s in store.segments(sid) if s["kind"] == SEGMENT_UNIT_ROWS}


def continued(store: Store, sid: str, messages: list[str], lazy: bool, max_tokens: int = 12) -> ChatSession:
    session = ChatSession(store, shared_engine(), sid, policy=louiskv(), lazy_resume=lazy)
    for text in messages:
        session.send(text, max_tokens=max_tokens, sampling=SamplingParams())
    session.writer.drain()
    return session


def damage_round(store: Store, sid: str, idx: int) -> None:
    """Flip a byte in the middle of round idx's first K/V segment file (shared with every fork of the chat)."""
    seg = next(s for s in store.segments(sid) if s["kind"] == SEGMENT_KV and s["round_idx"] == idx)
    path = store.kv_dir / seg["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def stored_kv(store: Store, sid: str, first: int) -> dict[int, list[str]]:
    """Each round from `first` on: its K/V segments' files (content-addressed: the same file is the same bytes)."""
    out: dict[int, list[str]] = {}
    for seg in sorted(store.segments(sid), key=lambda s: (s["round_idx"], s["layer_start"])):
        if seg["kind"] == SEGMENT_KV and seg["round_idx"] >= first:
            out.setdefault(seg["round_idx"], []).append(seg["file"])
    return out


def test_a_chat_reopened_lazily_and_continued_for_20_rounds_stores_what_a_fully_restored_one_does(kvchat_home,
                                                                                                    monkeypatch):
    # (this model's frames are a few hundred bytes: read across gaps of up to 16 KiB, a layer's reads take in most
    # of each file, and the bytes before the first token below would measure that, not the choice)
    monkeypatch.setattr("kvchat.storage.unit_frames.READ_ACROSS", 0)
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    assert len(unit_rows_of(store, sid)) == len(FACTS)
    fork = store.fork_session(sid, len(FACTS), "restored whole")
    lazily = continued(store, sid, LATER[:1], lazy=True)
    restore = lazily.sent_restore  # what the first message after opening recorded
    for text in LATER[1:]:
        lazily.send(text, max_tokens=12, sampling=SamplingParams())
    lazily.writer.drain()
    whole = continued(store, fork, LATER, lazy=False)
    rows = lazily.lazy_rows
    assert rows is not None and rows.completed
    # before the first token: the unit frames its layers' choices (and its sinks and buffer) lie in, in some of
    # the rounds: 13% of the chat's K/V bytes here (2026-11-28), against 61% read by whole rounds
    assert 0 < rows.rounds_before_first_token < len(FACTS) and rows.frames_read > 0
    assert 0 < rows.bytes_before_first_token < 0.25 * rows.chat_bytes
    assert len(rows.loaded) == len(FACTS) and rows.whole_restore_because is None  # the rest read after it
    assert [r.assistant_text for r in lazily.rounds] == [r.assistant_text for r in whole.rounds]
    lazy_kv, whole_kv = stored_kv(store, sid, len(FACTS)), stored_kv(store, fork, len(FACTS))
    assert len(lazy_kv) == len(LATER) and lazy_kv == whole_kv  # the same bytes, round by round
    assert restore.plan.startswith("lazy:") and restore.tokens_loaded > 0
    assert any(n.startswith(f"opened lazily: {rows.rounds_before_first_token} of {len(FACTS)} rounds")
               for n in restore.notes)


def test_a_lazily_answered_reply_of_one_token_still_leaves_the_store_exact(kvchat_home):
    """A reply that ends at its first token makes no decode step, which is where a lazy resume finishes: the session
    finishes it, so the round is stored as a fully restored chat stores it."""
    store = Store()
    sid = stored_chat(store)
    fork = store.fork_session(sid, len(FACTS), "restored whole")
    lazily = continued(store, sid, LATER[:1], lazy=True, max_tokens=1)
    whole = continued(store, fork, LATER[:1], lazy=False, max_tokens=1)
    assert lazily.lazy_rows.completed and lazily.message_policy.lazy is None
    assert lazily.rounds[-1].assistant_text == whole.rounds[-1].assistant_text
    assert stored_kv(store, sid, len(FACTS)) == stored_kv(store, fork, len(FACTS))


def test_a_chat_without_stored_units_or_with_a_damaged_round_is_restored_whole_and_says_so(kvchat_home):
    store = Store()
    sid = stored_chat(store)
    # one round's units gone: not opened lazily, said in the restore's notes
    fork = store.fork_session(sid, len(FACTS), "no units")
    store.drop_segment_rows(fork, [(3, SEGMENT_UNITS, 0)])
    session = continued(store, fork, LATER[:1], lazy=True)
    assert session.lazy_rows is None
    assert "not opened lazily: 1 of 12 rounds have no stored retrieval units" in session.sent_restore.notes
    # the first round's K/V damaged: the lazy answer stops before its first token, the chat is restored whole (the
    # round recomputed) and the message answered
    damaged = store.fork_session(sid, len(FACTS), "damaged")
    damage_round(store, damaged, 0)
    session = continued(store, damaged, LATER[:1], lazy=True)
    notes = " ".join(session.sent_restore.notes)
    assert "the lazy resume stopped (round 0:" in notes and "restored whole" in notes
    assert session.rounds[-1].assistant_text


def test_a_round_that_cannot_be_read_after_the_first_token_makes_the_rest_a_whole_restore(kvchat_home):
    store = Store()
    sid = stored_chat(store)
    probe_session = continued(store, store.fork_session(sid, len(FACTS), "probe"), LATER[:1], lazy=True)
    probe = probe_session.lazy_rows
    untouched = sorted(set(range(len(FACTS))) - probe.read_before_first_token)
    assert untouched  # the message's layers read some rounds, not all
    damaged = store.fork_session(sid, len(FACTS), "damaged later")
    damage_round(store, damaged, untouched[0])
    session = continued(store, damaged, LATER[:1], lazy=True)
    rows = session.lazy_rows
    assert rows.read_before_first_token == probe.read_before_first_token  # the same reads up to the first token
    assert rows.whole_restore_because.startswith(f"round {untouched[0]}:")
    notes = " ".join(session.sent_restore.notes)
    assert f"then restored whole (round {untouched[0]}:" in notes and session.sent_restore.tokens_recomputed > 0
    assert session.rounds[-1].assistant_text == probe_session.rounds[-1].assistant_text


@pytest.mark.parametrize("device", ["cpu", "cpu, the kernel's checksums",
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unit_frames_bring_in_exactly_the_chosen_rows_and_fewer_bytes_than_whole_rounds(kvchat_home, device,
                                                                                           monkeypatch):
    """On a GPU the chat's units are laid out, the frames found and checked on the device (the chat answered there
    too: its frames in the GPU cache's precision), their checksums by one kernel (kernels/frame_checksums.py: on
    the CPU its torch reference stands in for it, so that the way it is called is checked here, damage included)."""
    import kvchat.app.session.lazy as lazy_module
    from kvchat.kernels.frame_checksums import frame_checksums_ref

    if device.startswith("cpu, "):
        monkeypatch.setattr(lazy_module, "triton_kernel_runs_on", lambda device: True)
        monkeypatch.setattr(lazy_module, "frame_checksums", frame_checksums_ref)
        device = "cpu"
    store = Store()
    if device == "cuda":
        from kvchat.engine.engine import Engine

        engine = Engine(str(DEFAULT_MODEL), device="cuda")
    else:
        engine = shared_engine()
    sid = stored_chat(store, unit_rows=True, engine=engine)

    def policy():
        return make_policy("louiskv", engine, tau=0.5, tokens=8, buffer=8, unit_tokens=8)

    reference = ChatSession(store, engine, store.fork_session(sid, len(FACTS), "whole"), policy=policy())
    reference.restore()
    session = ChatSession(store, engine, sid, policy=policy(), lazy_resume=True)
    assert session.restore_lazily()
    rows, cache, full = session.lazy_rows, session.cache, reference.cache
    layer, n_heads = 1, cache.kv.shape[2]
    chosen = torch.stack([torch.arange(h, full.length, 7)[:20] for h in range(n_heads)]).to(device)  # [Hkv, 20]
    rows.ensure(layer, chosen)
    assert rows.frames_read > 0 and not rows.loaded  # by frames: no round read whole
    rows.verify()  # every frame read matches its checksum
    for h in range(n_heads):
        for slot in chosen[h].tolist():
            assert torch.equal(cache.kv[layer, :, h, slot], full.kv[layer, :, h, slot])
    # what a frame brings is its unit's rows, no other layer's and no row outside the units
    assert not cache.kv[layer + 1].any()
    held = (cache.kv[layer] != 0).any(-1).any(0)  # [Hkv, slots]
    assert held[:, : full.length].sum() < 0.5 * n_heads * full.length
    before = rows.bytes_read
    rows.ensure(layer, chosen)  # held already: nothing read again
    assert rows.bytes_read == before
    # a frame damaged in the file is caught by the message's check (`verify`), whichever way the sums are made
    from kvchat.app.session.lazy import LazyResumeFailed

    damaged = ChatSession(store, engine, store.fork_session(sid, len(FACTS), "damaged"), policy=policy(),
                          lazy_resume=True)
    assert damaged.restore_lazily()
    path = store.kv_dir / damaged.lazy_rows.frames[0]["file"]  # round 0's (slot 0 is chosen, a sink)
    with UnitFramesFile(path, fingerprint=rows.fingerprint) as frames_file:
        header = frames_file.header
    good = path.read_bytes()
    data = bytearray(good)
    for a, b in zip(header.first_row, header.first_row[1:]):  # a byte of every frame
        if b > a:
            data[header.size + (a + b) // 2 * header.row_bytes] ^= 0x55
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    damaged.lazy_rows.ensure(layer, chosen)  # read, summed, not looked at yet
    with pytest.raises(LazyResumeFailed, match=f"round 0: unit frames {path.name} are corrupt"):
        damaged.lazy_rows.verify()
    damaged.close()
    path.write_bytes(good)
    # the same choice through whole rounds reads more
    store.drop_segment_rows(sid, [(i, SEGMENT_UNIT_ROWS, 0) for i in unit_rows_of(store, sid)])
    by_rounds = ChatSession(store, engine, sid, policy=policy(), lazy_resume=True)
    assert by_rounds.restore_lazily()
    by_rounds.lazy_rows.ensure(layer, chosen)
    assert by_rounds.lazy_rows.frames_read == 0 and by_rounds.lazy_rows.bytes_read > 2 * rows.bytes_read


@pytest.mark.parametrize("damage", ["frames", "index"])
def test_damaged_unit_frames_stop_the_lazy_answer_and_the_chat_is_restored_whole(kvchat_home, damage):
    """A byte of every frame of a round flipped (found by the frames' checksums), or of its index (found when its
    file is opened, beside the other rounds' files on the reader threads)."""
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    whole_reply = continued(store, store.fork_session(sid, len(FACTS), "whole"), LATER[:1], lazy=False)
    probe = continued(store, store.fork_session(sid, len(FACTS), "probe"), LATER[:1], lazy=True).lazy_rows
    first = min(probe._touched)  # a round the message read in part
    path = store.kv_dir / unit_rows_of(store, sid)[first]
    with UnitFramesFile(path, fingerprint=probe.fingerprint) as file:
        header = file.header
    data = bytearray(path.read_bytes())
    for a, b in zip(header.first_row, header.first_row[1:]):  # a byte of every frame flipped: what a partial read
        if b > a and damage == "frames":                          # sees (rows, not byte offsets: frames are raw)
            data[header.size + (a + b) // 2 * header.row_bytes] ^= 0x55
    if damage == "index":
        data[100] ^= 0x55  # (a member count of the index)
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    session = continued(store, store.fork_session(sid, len(FACTS), "damaged frames"), LATER[:1], lazy=True)
    notes = " ".join(session.sent_restore.notes)
    assert f"the lazy resume stopped (round {first}: unit frames" in notes and "restored whole" in notes
    assert ("does not match its checksum" if damage == "frames" else "its index does not match") in notes
    assert session.rounds[-1].assistant_text == whole_reply.rounds[-1].assistant_text


def test_a_chat_stored_without_unit_frames_gets_them_when_it_is_first_opened_lazily(kvchat_home):
    store = Store()
    sid = stored_chat(store)
    assert not unit_rows_of(store, sid)
    first = continued(store, sid, LATER[:1], lazy=True)
    assert first.lazy_rows.frames_read == 0 and first.lazy_rows.completed  # whole rounds, then the frames stored
    assert set(unit_rows_of(store, sid)) == set(range(len(FACTS) + 1))
    first.close()
    second = continued(store, sid, LATER[1:2], lazy=True)
    assert second.lazy_rows.frames_read > 0


def test_an_answered_lazy_message_leaves_the_policy_holding_no_cache(kvchat_home):
    """The policy outlives the chat's session (the bench's runs, the app's chat service): once a message is answered
    it must not keep the chat's cache alive, or a second open allocates a second cache beside it."""
    import gc
    import weakref

    store = Store()
    sid = stored_chat(store, unit_rows=True)
    policy = louiskv()
    session = ChatSession(store, shared_engine(), sid, policy=policy, lazy_resume=True)
    session.send(LATER[0], max_tokens=4, sampling=SamplingParams())
    session.writer.drain()
    assert policy.last_prefill is not None and policy.last_prefill.reads  # what it read stays, for stats
    held = weakref.ref(session.cache.kv)
    session.close()
    gc.disable()  # by reference counting alone: a cycle through the session kept a 32k cache on the GPU until the
    try:          # cycle collector ran, so the bench's next open allocated its cache beside it (19.1 GiB, not 10.4)
        del session
        assert held() is None
    finally:
        gc.enable()


def test_a_closed_chat_lets_go_of_its_unit_frames_before_its_resume_completed(kvchat_home):
    """A chat closed before its lazy resume completed (closed, or its answer stopped at its first token outside
    ChatSession.send, as the bench's warm-up runs are) must close the unit-frames files it opened and let go of the
    session: left to Python's cycle collector, they kept their descriptors open and the chat's cache on the device
    (the bench's peak GPU memory of 14.5-19.0 GiB against kv-split's 10.4, H200, 2026-11-29)."""
    import gc
    import os
    import time
    import weakref
    from pathlib import Path

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd here")
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    files = {str(store.kv_dir / name) for name in unit_rows_of(store, sid).values()}

    def opened() -> set[str]:
        held = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return files & held

    policy = louiskv()  # (it outlives the session, as the bench's and the app's policies do)
    session = ChatSession(store, shared_engine(), sid, policy=policy, lazy_resume=True)
    assert session.restore_lazily()
    # every round's file is opened from the open on (beside the units' reads), before any layer asks for it
    deadline = time.monotonic() + 10
    while opened() != files and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opened() == files
    rows, n_heads = session.lazy_rows, session.cache.kv.shape[2]
    chosen = torch.stack([torch.arange(h, session.cache.length, 5)[:20] for h in range(n_heads)])
    rows.ensure(1, chosen)
    assert rows.frames_read > 0 and policy.lazy is rows
    assert 0 < len(rows._files) < len(files)  # the rounds the layer touched taken; the rest closed with the chat
    held = weakref.ref(session.cache.kv)
    session.close()
    assert not opened() and not rows._files
    gc.disable()  # by reference counting alone
    try:
        del session, rows
        assert held() is None
    finally:
        gc.enable()


def test_unit_frames_of_another_precision_are_read_as_whole_rounds_not_misread(kvchat_home):
    """A chat answered on a CPU (float32) and reopened on a GPU (bfloat16) holds frames of the other precision:
    those rounds are read whole (and their frames written again once the chat is whole), never read as rows of the
    cache's precision, nor gathered beside frames of another row size (which raised a ValueError past the lazy
    answer's fallback)."""
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    seg = next(s for s in store.segments(sid) if s["kind"] == SEGMENT_UNIT_ROWS and s["round_idx"] == 0)
    other = "bfloat16" if seg["dtype"] != "bfloat16" else "float32"
    store.add_segment(sid, **{**{k: v for k, v in seg.items() if k not in ("session_id", "created")},
                              "dtype": other})
    session = ChatSession(store, shared_engine(), sid, policy=louiskv(), lazy_resume=True)
    assert session.restore_lazily()
    rows, n_heads = session.lazy_rows, session.cache.kv.shape[2]
    assert 0 not in rows.frames and 1 in rows.frames
    chosen = torch.stack([torch.arange(h, session.cache.length, 3)[:40] for h in range(n_heads)])
    rows.ensure(1, chosen)  # round 0 (slot 0 is chosen) whole, the others by frames
    assert 0 in rows.loaded and rows.frames_read > 0
    session.close()


def test_a_slot_outside_the_chat_stops_the_lazy_answer_by_frames_too(kvchat_home):
    """Every round has unit frames, so a layer's reads do not wait for the device to find its rounds; a slot past
    the chat's end (or before its start) is still an error, never a read of another slot's rows."""
    from kvchat.app.session.lazy import LazyResumeFailed

    store = Store()
    sid = stored_chat(store, unit_rows=True)
    session = ChatSession(store, shared_engine(), sid, policy=louiskv(), lazy_resume=True)
    assert session.restore_lazily()
    rows, n_heads, length = session.lazy_rows, session.cache.kv.shape[2], session.cache.length
    assert len(rows.frames) == len(FACTS)
    for slot in (length, -1):
        chosen = torch.stack([torch.arange(h, length, 5)[:20] for h in range(n_heads)])
        chosen[0, 3] = slot
        with pytest.raises(LazyResumeFailed, match="outside"):
            rows.ensure(1, chosen)
    session.close()


def test_frames_left_unchecked_until_the_completion_make_it_a_whole_restore_not_an_error(kvchat_home):
    """The message checks the frames it read before its first token (`verify` at its last layer); frames read and
    never looked at by then are checked when the rest is brought in, after the first token: a damaged one there is
    a round that cannot be read (the session's whole restore, which recomputes it), never an error after the token."""
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    session = ChatSession(store, shared_engine(), sid, policy=louiskv(), lazy_resume=True)
    assert session.restore_lazily()
    rows, n_heads, length = session.lazy_rows, session.cache.kv.shape[2], session.cache.length
    path = store.kv_dir / rows.frames[0]["file"]
    with UnitFramesFile(path, fingerprint=rows.fingerprint) as frames_file:
        header = frames_file.header
    data = bytearray(path.read_bytes())
    for a, b in zip(header.first_row, header.first_row[1:]):
        if b > a:
            data[header.size + (a + b) // 2 * header.row_bytes] ^= 0x55
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    rows.ensure(1, torch.stack([torch.arange(h, length, 7)[:20] for h in range(n_heads)]))  # round 0's, unchecked
    rows.complete()
    assert rows.whole_restore_because.startswith(f"round 0: unit frames {path.name} are corrupt")
    assert "then restored whole (round 0: unit frames" in " ".join(rows.stats.notes)
    reference = ChatSession(store, shared_engine(), store.fork_session(sid, len(FACTS), "whole"), policy=louiskv())
    reference.restore()
    assert torch.equal(session.cache.kv[..., :length, :], reference.cache.kv[..., :length, :])
    session.close()


def test_a_checksum_kernel_that_cannot_run_here_leaves_the_checks_to_torch(kvchat_home, monkeypatch, caplog):
    """Where the frame-checksum kernel fails to compile (a triton or driver it never ran on), the log says so once
    and the checks are torch's: the same rows, still checked (a damaged frame still stops the lazy answer)."""
    import logging

    import kvchat.app.session.lazy as lazy_module

    def no_kernel(*args):
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(lazy_module, "triton_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(lazy_module, "frame_checksums", no_kernel)
    monkeypatch.setattr(lazy_module, "_checksum_kernel_failed", None)
    store = Store()
    sid = stored_chat(store, unit_rows=True)
    reference = ChatSession(store, shared_engine(), store.fork_session(sid, len(FACTS), "whole"), policy=louiskv())
    reference.restore()
    session = ChatSession(store, shared_engine(), sid, policy=louiskv(), lazy_resume=True)
    assert session.restore_lazily()
    rows, n_heads, length = session.lazy_rows, session.cache.kv.shape[2], session.cache.length
    chosen = torch.stack([torch.arange(h, length, 7)[:20] for h in range(n_heads)])
    with caplog.at_level(logging.WARNING, logger=lazy_module.__name__):
        rows.ensure(1, chosen)
        rows.ensure(2, chosen)
    rows.verify()
    warned = [r for r in caplog.records if "frame checksum kernel unavailable" in r.getMessage()]
    assert len(warned) == 1 and "RuntimeError: PassManager::run failed)" in warned[0].getMessage()
    for h in range(n_heads):
        assert torch.equal(session.cache.kv[1, :, h, chosen[h]], reference.cache.kv[1, :, h, chosen[h]])
    session.close()


def test_a_chat_whose_units_were_stored_in_bfloat16_opens_lazily_from_them(kvchat_home, monkeypatch):
    """Chats saved before 2026-11-29 hold bfloat16 units segments (the 8-bit format came after): a lazy open reads
    them as they are, rebuilds none, answers, and stores the new round's units in 8 bits beside them."""
    import kvchat.app.session.units as units_module
    from test_louiskv_units import pack_units_bfloat16

    store = Store()
    monkeypatch.setattr(units_module, "pack_units", pack_units_bfloat16)
    sid = stored_chat(store)
    monkeypatch.undo()
    before = {s["round_idx"]: (s["file"], s["dtype"]) for s in store.segments(sid) if s["kind"] == SEGMENT_UNITS}
    assert len(before) == len(FACTS) and {dtype for _, dtype in before.values()} == {"bfloat16"}
    session = continued(store, sid, LATER[:1], lazy=True)
    assert session.lazy_rows is not None and session.lazy_rows.completed
    assert not [n for n in session.sent_restore.notes if "retrieval units" in n or "not opened lazily" in n]
    assert session.rounds[-1].assistant_text
    after = {s["round_idx"]: (s["file"], s["dtype"]) for s in store.segments(sid) if s["kind"] == SEGMENT_UNITS}
    assert {i: after[i] for i in before} == before and after[len(FACTS)][1] == "uint8"
    session.close()
