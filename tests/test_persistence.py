"""Chats on disk: resumed in a new process exactly as if they never stopped, crash-safe, and never losing text."""

from __future__ import annotations

import errno
import json
import os

import pytest

from cli_run import kvchat
from kvchat.app.session.chat import ChatSession
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.storage.db import REPLY_DONE, REPLY_PARTIAL, REPLY_PENDING, RoundRow, Store
from kvchat.storage.failpoints import POINTS
from kvchat.storage.fingerprint import model_fingerprint

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
MESSAGES = ["My name is Ada.", "My sister's name is Mira.", "I live in Lisbon.", "What is my sister's name?",
            "Where do I live?"]
SISTER_NOTED = "Noted: your sister's name is Mira."  # the reply to MESSAGES[1] after MESSAGES[0]


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def new_session(store: Store, model=DEFAULT_MODEL) -> str:
    return store.create_session(title="t", model_fingerprint=model_fingerprint(model, store), model_path=str(model),
                                system_prompt=SYSTEM)


def saved_chat(engine, rounds: int = 3) -> tuple[Store, ChatSession]:
    """A chat of the first `rounds` messages, answered and its K/V saved."""
    store = Store()
    chat = ChatSession(store, engine, new_session(store))
    for m in MESSAGES[:rounds]:
        chat.send(m)
    chat.close()
    return store, chat


def test_resumed_in_new_processes_equals_never_stopped(engine, kvchat_home):
    # One process per message: each restores the chat from disk, answers, saves.
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    resumed = [kvchat("send", sid, m, "--device", "cpu", process=True).stdout.rstrip("\n") for m in MESSAGES]
    # The same chat in one process that never stopped.
    store = Store(kvchat_home / "other")
    chat = ChatSession(store, engine, new_session(store))
    never_stopped = [chat.send(m).text for m in MESSAGES]
    chat.close()
    assert resumed == never_stopped
    assert resumed[3] == "Your sister's name is Mira." and resumed[4] == "You live in Lisbon."
    shown = json.loads(kvchat("show", sid, "--json").stdout)
    assert [r["kv"] for r in shown["rounds"]] == ["on disk"] * 5
    last = shown["last_restore"]
    assert last["tokens_recomputed"] == 0 and last["tokens_loaded"] == shown["rounds"][3]["tokens"][1]
    assert shown["kv_bytes"] < shown["kv_raw_bytes"]


def test_restore_loads_kv_and_matches_a_fresh_prefill(engine, kvchat_home):
    store, chat = saved_chat(engine)
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == chat.cache.length
    n = chat.cache.length
    assert (reopened.cache.kv[:, :, :, :n] == chat.cache.kv[:, :, :, :n]).all()


@pytest.mark.parametrize("damage", ["delete", "flip", "wrong-model"])
def test_damaged_round_kv_is_recomputed_and_said(engine, kvchat_home, damage):
    store, chat = saved_chat(engine)
    seg = store.segments(chat.sid)[1]
    path = store.kv_dir / seg["file"]
    if damage == "delete":
        path.unlink()
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        store.db.execute("UPDATE kv_segments SET model_fingerprint = ? WHERE file = ?", ["0" * 64, seg["file"]])
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    span = seg["token_end"] - seg["token_start"]
    assert stats.tokens_recomputed == span and stats.tokens_loaded == chat.cache.length - span
    assert len(stats.notes) == 1 and stats.notes[0].startswith("round 1:")
    n = chat.cache.length
    # Recomputed in one batch instead of token by token: equal up to rounding (activations are rounded to fp16
    # before F16 weights, and a value on a rounding boundary can go either way).
    assert (reopened.cache.kv[:, :, :, :n] - chat.cache.kv[:, :, :, :n]).abs().max() < 1e-2
    assert reopened.send(MESSAGES[3]).text == "Your sister's name is Mira."
    reopened.close()
    # The recomputed round was stored again: the next open loads everything.
    assert ChatSession(store, engine, chat.sid).restore().tokens_recomputed == 0


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_disk_errors_while_saving_kv_lose_no_text(engine, kvchat_home, monkeypatch, error):
    store = Store()
    chat = ChatSession(store, engine, new_session(store))
    chat.send(MESSAGES[0])
    chat.close()

    def failing_fsync(fd):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr("kvchat.storage.segments.os.fsync", failing_fsync)
    out = chat.send(MESSAGES[1])
    chat.close()
    monkeypatch.undo()
    assert chat.writer.errors and os.strerror(error) in chat.writer.errors[0]
    assert [r.user_text for r in store.rounds(chat.sid)] == MESSAGES[:2]
    assert store.rounds(chat.sid)[1].assistant_text == out.text
    assert not [p for p in store.kv_dir.iterdir() if p.name.startswith(".tmp-")]
    stats = ChatSession(store, engine, chat.sid).restore()
    assert stats.tokens_recomputed > 0 and "no K/V stored" in stats.notes[0]


def _check_store(sid: str, before: list, point: str) -> RoundRow | None:
    """What every interrupted send must leave: a sound database, the earlier rounds as they were, at most one new
    round (the message sent), every segment row on a whole file and no stray files once the sweep has run."""
    store = Store()
    try:
        assert store.integrity_ok(), point
        after = store.rounds(sid)
        assert after[: len(before)] == before, point
        assert len(after) in (len(before), len(before) + 1), point
        for seg in store.segments(sid):  # every committed segment row points at a whole, valid file
            assert (store.kv_dir / seg["file"]).exists(), point
        assert not [p for p in store.kv_dir.iterdir() if p.name.startswith(".tmp-")], point  # swept at open
        store.sweep(orphan_age_s=0)  # a file whose row never committed goes once no save can still claim it
        assert {p.name for p in store.kv_dir.iterdir()} == store.referenced_files(), point
        return after[-1] if len(after) > len(before) else None
    finally:
        store.close()


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_send_says_once_after_the_reply_that_its_kv_was_not_saved(kvchat_home, monkeypatch, error):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    kvchat("send", sid, MESSAGES[0], "--device", "cpu")

    def failing_fsync(fd):
        raise OSError(error, os.strerror(error))

    with monkeypatch.context() as m:
        m.setattr("kvchat.storage.segments.os.fsync", failing_fsync)
        proc = kvchat("send", sid, MESSAGES[1], "--device", "cpu")
        assert proc.stdout == SISTER_NOTED + "\n"  # nothing glued to the reply
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvchat: warning: the K/V of round 1 was not saved (")
        assert os.strerror(error) in lines[0] and lines[0].endswith("recomputed when the chat is next opened")
        as_json = json.loads(kvchat("send", sid, MESSAGES[2], "--device", "cpu", "--json").stdout)
        assert as_json["kv_not_saved"] and as_json["reply_state"] == REPLY_DONE
    # The next send says nothing of the earlier failures: it recomputes those rounds (no damage), and saves them.
    proc = kvchat("send", sid, MESSAGES[3], "--device", "cpu", "--json")
    out = json.loads(proc.stdout)
    assert proc.stderr == "" and out["kv_not_saved"] == [] and out["kv_recomputed"] == []
    assert out["reply"] == "Your sister's name is Mira." and out["round"] == 3 and out["stop_reason"] == "eog"
    assert [r["kv"] for r in json.loads(kvchat("show", sid, "--json").stdout)["rounds"]] == ["on disk"] * 4


# Every write a send makes to the database, in order; a full disk or an I/O error at each must lose no message.
SEND_WRITES = ("add_round", "finish_round", "add_segment", "record_restore", "rename_session")


@pytest.mark.parametrize("sqlite_error", ["database or disk is full", "disk I/O error"])
def test_a_full_disk_or_io_error_at_every_database_write_of_a_send_loses_no_message(kvchat_home, monkeypatch,
                                                                                      sqlite_error):
    import sqlite3

    place = "is full" if "full" in sqlite_error else "an I/O error"
    for method in SEND_WRITES:
        sid = kvchat("new").stdout.strip()  # untitled: the send names it (rename_session)
        kvchat("send", sid, MESSAGES[0], "--device", "cpu")
        Store().db.execute("UPDATE sessions SET title = '' WHERE id = ?", [sid])

        def failing(self, *args, **kwargs):
            with self.transaction():
                raise sqlite3.OperationalError(sqlite_error)

        with monkeypatch.context() as m:
            m.setattr(Store, method, failing)
            proc = kvchat("send", sid, MESSAGES[1], "--device", "cpu", check=False)
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, (method, proc.stderr)
        lines = proc.stderr.splitlines()
        rounds = Store().rounds(sid)
        if method == "add_round":  # the message could not be saved: nothing was answered, and it says so
            assert proc.returncode == 1 and proc.stdout == "" and len(lines) == 1, (method, proc.stderr)
            assert place in lines[0] and [r.user_text for r in rounds] == MESSAGES[:1]
            continue
        assert [r.user_text for r in rounds] == MESSAGES[:2], method  # the message is kept
        assert proc.stdout == SISTER_NOTED + "\n", method  # the reply streamed, nothing glued to it
        if method == "finish_round":  # the reply could not be saved: one line says so, the message waits
            assert proc.returncode == 1 and len(lines) == 1 and place in lines[0], (method, proc.stderr)
            assert "the reply was not saved (the message is" in lines[0]
            assert (rounds[1].assistant_text, rounds[1].reply_state) == ("", REPLY_PENDING)
            continue
        assert (rounds[1].assistant_text, rounds[1].reply_state) == (SISTER_NOTED, REPLY_DONE), method
        if method == "add_segment":  # the K/V could not be indexed: one warning, the round is text
            assert proc.returncode == 0 and len(lines) == 1 and lines[0].startswith("kvchat: warning: the K/V of round 1")
        else:  # what is only bookkeeping (the restore's figures, the title) is let go
            assert proc.returncode == 0 and lines == [], (method, proc.stderr)
        # The chat goes on, recomputing what could not be stored.
        assert kvchat("send", sid, MESSAGES[3], "--device", "cpu").stdout == "Your sister's name is Mira.\n"
        assert Store().integrity_ok()


def test_send_says_when_it_recomputed_damaged_kv(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    for m in MESSAGES[:2]:
        kvchat("send", sid, m, "--device", "cpu", "--no-compact")

    def damage_round_1() -> None:
        store = Store()
        path = store.kv_dir / [s for s in store.segments(sid) if s["round_idx"] == 1][0]["file"]
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        store.close()

    damage_round_1()
    proc = kvchat("send", sid, MESSAGES[3], "--device", "cpu", "--no-compact")
    assert proc.stdout == "Your sister's name is Mira.\n"
    assert proc.stderr.startswith("kvchat: notice: restoring recomputed stored K/V that could not be used: round 1: ")
    assert len(proc.stderr.splitlines()) == 1
    damage_round_1()  # it was stored again when recomputed
    out = json.loads(kvchat("send", sid, MESSAGES[4], "--device", "cpu", "--json").stdout)
    assert len(out["kv_recomputed"]) == 1 and out["kv_recomputed"][0].startswith("round 1: ")


def test_crash_loop(kvchat_home):
    """SIGKILL at every step of sending a message and saving its round: the database stays sound, older rounds are
    intact, the message is kept from the moment it was committed (its reply pending until the reply's commit, then
    whole), and the chat still answers."""
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    kvchat("send", sid, MESSAGES[0], "--device", "cpu")
    for point in POINTS:
        before = Store().rounds(sid)
        proc = kvchat("send", sid, MESSAGES[1], "--device", "cpu", env={"KVCHAT_CRASH_AT": point}, check=False)
        assert proc.returncode == -9, (point, proc.stderr[-500:])
        new = _check_store(sid, before, point)
        if new is None:  # killed before the message's commit: before it, or while the restore stored recomputed K/V
            assert point == "message-text" or point.startswith("segment-"), point
            continue
        assert new.user_text == MESSAGES[1] and new.token_end > new.token_start, point
        # Killed before the reply's commit: the message waits for a reply; after it, the round is whole. (The K/V
        # the restore recomputed is saved in the background, so a segment point may come before either.)
        assert (new.assistant_text == "") == (new.reply_state == REPLY_PENDING), point
        if point in ("message-committed", "reply-token", "round-text"):
            assert new.reply_state == REPLY_PENDING, point
        elif not point.startswith("segment-"):
            assert new.reply_state == REPLY_DONE, point
        if new.reply_state == REPLY_PENDING:  # shown as what it is
            assert "assistant: [no reply saved: kvchat stopped before the reply ended]" in kvchat("show", sid).stdout
    # The lost replies are empty rounds in the chat: it restores and answers from what it holds.
    reply = kvchat("send", sid, "What is my name?", "--device", "cpu").stdout.strip()
    assert reply == "Your name is Ada."
    assert Store().integrity_ok()


@pytest.mark.parametrize("signal_name, point", [("INT", "message-committed"), ("TERM", "reply-token"),
                                                ("INT", "segment-written"), ("INT2", "reply-token")])
def test_ctrl_c_and_sigterm_keep_the_reply_streamed(kvchat_home, signal_name, point):
    """Ctrl-C or SIGTERM during a send: the reply stops at the next token and what streamed is saved, marked
    partial (exit 130); once the reply is saved a signal changes nothing (exit 0); a second Ctrl-C stops at once
    and still keeps what streamed. Nothing is lost, the K/V included, and the chat goes on."""
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    kvchat("send", sid, MESSAGES[0], "--device", "cpu")
    before = Store().rounds(sid)
    proc = kvchat("send", sid, MESSAGES[1], "--device", "cpu", env={"KVCHAT_CRASH_AT": point,
                                                                   "KVCHAT_CRASH_SIGNAL": signal_name}, check=False)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    new = _check_store(sid, before, point)
    assert new is not None and new.user_text == MESSAGES[1]
    if POINTS.index(point) >= POINTS.index("round-committed"):
        assert proc.returncode == 0, proc.stderr
        assert (new.assistant_text, new.reply_state) == (SISTER_NOTED, REPLY_DONE)
    else:
        assert proc.returncode == 130, proc.stderr
        assert new.reply_state == REPLY_PARTIAL
        assert new.assistant_text == proc.stdout.strip() and SISTER_NOTED.startswith(new.assistant_text)
        # Ctrl-C before the reply stops the chat's restore: the message is kept with an empty reply. During the
        # reply, it stops after the piece streamed.
        assert bool(new.assistant_text) == (point == "reply-token")
        assert f"assistant: {new.assistant_text} [stopped: partial reply]" in kvchat("show", sid).stdout
        assert proc.stderr.strip().splitlines()[-1].startswith("kvchat: ")
    assert kvchat("send", sid, "What is my name?", "--device", "cpu").stdout.strip() == "Your name is Ada."
    shown = json.loads(kvchat("show", sid, "--json").stdout)
    assert [r["kv"] for r in shown["rounds"]] == ["on disk"] * 3


def test_bad_session_ids_and_missing_model(kvchat_home, tmp_path):
    proc = kvchat("send", "nope", "hi", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == "kvchat: error: no session 'nope' (see `kvchat sessions`)"
    model = tmp_path / "m.gguf"
    model.write_bytes(DEFAULT_MODEL.read_bytes())
    sid = kvchat("new", "--model", str(model)).stdout.strip()
    kvchat("send", sid, "My name is Ada.", "--device", "cpu")
    model.unlink()
    proc = kvchat("send", sid, "What is my name?", check=False)
    assert proc.returncode == 1 and "is missing; its text is safe" in proc.stderr
    assert json.loads(kvchat("show", sid, "--json").stdout)["rounds"][0]["user"] == "My name is Ada."


def test_rm_deletes_rows_then_files(kvchat_home):
    sid = kvchat("new").stdout.strip()
    kvchat("send", sid, "My name is Ada.", "--device", "cpu")
    store = Store()
    files = [store.kv_dir / s["file"] for s in store.segments(sid)]
    assert files and all(f.exists() for f in files)
    kvchat("rm", sid)
    assert not any(f.exists() for f in files)
    assert json.loads(kvchat("sessions", "--json").stdout) == []


def test_newer_database_is_refused(kvchat_home):
    Store().db.execute("PRAGMA user_version = 99")
    proc = kvchat("sessions", check=False)
    assert proc.returncode == 1 and "newer kvchat" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_kv_writer_survives_an_unexpected_failure(engine, kvchat_home, monkeypatch):
    store = Store()
    chat = ChatSession(store, engine, new_session(store))

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("kvchat.app.session.writer.write_segment", broken)
    chat.send(MESSAGES[0])
    chat.close()  # returns: the failed save does not stop the writer
    monkeypatch.undo()
    chat.send(MESSAGES[1])
    chat.close()
    assert chat.writer.errors == ["round 0: RuntimeError: device lost"]
    assert [s["round_idx"] for s in store.segments(chat.sid)] == [1]


def test_fork_shares_kv_files_and_restores_from_them(engine, kvchat_home):
    store, chat = saved_chat(engine)
    fork = store.fork_session(chat.sid, 2, "fork")
    assert [r.user_text for r in store.rounds(fork)] == MESSAGES[:2]
    assert {s["file"] for s in store.segments(fork)} <= {s["file"] for s in store.segments(chat.sid)}
    forked = ChatSession(store, engine, fork)
    stats = forked.restore()
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == store.rounds(fork)[-1].token_end
    assert forked.send(MESSAGES[3]).text == "Your sister's name is Mira."
    # Deleting the original keeps every file the fork still uses.
    store.unlink_files(store.delete_session(chat.sid))
    assert all((store.kv_dir / s["file"]).exists() for s in store.segments(fork))


def test_retracting_the_last_round_answers_it_again_identically(engine, kvchat_home):
    store = Store()
    chat = ChatSession(store, engine, new_session(store))
    first = [chat.send(m).text for m in MESSAGES[:4]]
    row = chat.retract_last_round()
    assert row.user_text == MESSAGES[3] and len(store.rounds(chat.sid)) == 3
    assert chat.cache.length == row.token_start
    assert chat.send(row.user_text).text == first[3]
    chat.close()
    reopened = ChatSession(store, engine, chat.sid)
    assert reopened.restore().tokens_recomputed == 0


def test_new_system_prompt_drops_stored_kv(engine, kvchat_home):
    store = Store()
    chat = ChatSession(store, engine, new_session(store))
    chat.send(MESSAGES[0])
    chat.close()
    orphans = store.update_session(chat.sid, system_prompt="Answer in one word.")
    store.unlink_files(orphans)
    assert store.segments(chat.sid) == [] and store.session(chat.sid)["system_prompt"] == "Answer in one word."
    assert not any(store.kv_dir.glob("*.kvs"))
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_loaded == 0 and "no longer match" in stats.notes[0]
    # The rounds now carry the spans of the new prompt, their K/V is stored again, and the next open loads it.
    assert stats.tokens_recomputed == store.rounds(chat.sid)[-1].token_end == reopened.cache.length
    reopened.close()
    again = ChatSession(store, engine, chat.sid).restore()
    assert again.tokens_recomputed == 0 and again.tokens_loaded == reopened.cache.length


def test_restore_reports_progress_and_can_be_cancelled(engine, kvchat_home):
    import threading

    from kvchat.app.session.restore import RestoreCancelled

    store, chat = saved_chat(engine)
    seen = []
    ChatSession(store, engine, chat.sid).restore(progress=lambda done, total: seen.append((done, total)))
    ends = [r.token_end for r in store.rounds(chat.sid)]
    assert seen == [(e, ends[-1]) for e in ends]
    cancel = threading.Event()
    reopened = ChatSession(store, engine, chat.sid)

    def stop_after_first(done, total):
        cancel.set()

    with pytest.raises(RestoreCancelled):
        reopened.restore(progress=stop_after_first, cancel=cancel)
    assert reopened.restored is None and reopened.cache.length == 0
    # A cancelled session restores normally afterwards.
    assert reopened.restore().tokens_loaded == ends[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_restore_on_cuda_is_bit_exact_through_the_staging_ring(kvchat_home, monkeypatch):
    from kvchat.storage.staging import HostToDevice

    monkeypatch.setattr(HostToDevice, "CHUNK", 64 << 10)  # many chunks per segment, the ring wraps many times
    monkeypatch.setattr(HostToDevice, "_shared", {})
    engine = Engine(DEFAULT_MODEL, device="cuda")
    store, chat = saved_chat(engine)
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    n = chat.cache.length
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == n
    assert (reopened.cache.kv[:, :, :, :n] == chat.cache.kv[:, :, :, :n]).all()
    # bf16 on the GPU may word answers differently from the CPU; a restored chat must answer as one that never
    # stopped does.
    other = Store(kvchat_home / "other")
    never_stopped = ChatSession(other, engine, new_session(other))
    expected = [never_stopped.send(m).text for m in MESSAGES[:4]][-1]
    assert reopened.send(MESSAGES[3]).text == expected


def test_one_store_read_and_written_from_many_threads_at_once(kvchat_home):
    """The app reads the store (sidebar, chat stats) while the K/V writer thread commits segment rows."""
    import threading

    from kvchat.storage.db import RoundRow

    store = Store()
    sid = store.create_session(title="busy", model_fingerprint="ab" * 32, model_path="m.gguf", system_prompt=None)
    errors, done = [], threading.Event()

    def write():
        try:
            for i in range(150):
                store.add_round(sid, RoundRow(i, "u", "a", i, i + 1, "2026-11-22T00:00:00"))
                store.add_segment(sid, round_idx=i, layer_start=0, layer_end=8, token_start=i, token_end=i + 1,
                                  codec="zstd", dtype="float16", byte_size=1, raw_size=1, checksum="c" * 64,
                                  file=f"{i:064x}.kvs", model_fingerprint="ab" * 32)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    def read():
        try:
            while not done.is_set():
                store.sessions(), store.rounds(sid), store.segments(sid), store.last_restore(sid)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.rounds(sid)) == len(store.segments(sid)) == 150


# ---- segment kinds ----

def segment_row(round_idx: int, name: str, layer_start: int = 0) -> dict:
    return dict(round_idx=round_idx, layer_start=layer_start, layer_end=layer_start + 8, token_start=0, token_end=40,
                codec="zstd", dtype="float16", byte_size=1, raw_size=1, checksum="c" * 64, file=f"{name * 64}.kvs",
                model_fingerprint="ab" * 32)


def kinds_and_files(store: Store, sid: str) -> list[tuple[int, str, str]]:
    return [(s["round_idx"], s["kind"], s["file"][0]) for s in store.segments(sid)]


def test_migration_gives_existing_segments_the_kind_kv(kvchat_home, monkeypatch):
    from kvchat.storage import db as store_db

    with monkeypatch.context() as m:  # a database as kvchat left it before segments had kinds
        m.setattr(store_db, "MIGRATIONS", store_db.MIGRATIONS[:1])
        old = Store()
        sid = old.create_session(title="old", model_fingerprint="ab" * 32, model_path="m.gguf", system_prompt=None)
        old.db["kv_segments"].insert({"session_id": sid, "created": store_db.now(), **segment_row(0, "a")})
        old.db["rounds"].insert({"session_id": sid, "idx": 0, "user_text": "hi", "assistant_text": "hello",
                                 "token_start": 0, "token_end": 9, "created": store_db.now()})
        assert "kind" not in old.db["kv_segments"].columns_dict
        old.close()
    store = Store()
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == len(store_db.MIGRATIONS) == 10
    assert store.kv_budgets(sid) is None and "kv_budgets" in store.db.table_names()  # 009: a table, empty
    assert kinds_and_files(store, sid) == [(0, "kv", "a")]
    assert [r.reply_state for r in store.rounds(sid)] == [REPLY_DONE]  # stored before replies had states: whole
    assert store.segments(sid)[0]["live_from"] == 0  # stored before windows were trimmed: every token held
    assert store.segments(sid)[0]["merged"] == "" and store.layer_stats(sid) is None  # and before merging
    table = store.db["kv_segments"]
    assert table.pks == ["session_id", "round_idx", "layer_start", "kind"]
    assert [ix.columns for ix in table.indexes if ix.origin == "c"] == [["file"]]
    assert [(fk.column, fk.other_table, fk.other_column) for fk in table.foreign_keys] == [("session_id", "sessions",
                                                                                          "id")]
    store.add_segment(sid, kind="key-bounds", **segment_row(0, "b"))  # same round and layer_start, another kind
    assert kinds_and_files(store, sid) == [(0, "key-bounds", "b"), (0, "kv", "a")]
    assert store.integrity_ok() and not store._fetch("PRAGMA foreign_key_check")


def test_segments_of_each_kind_are_kept_copied_and_dropped_alike(kvchat_home):
    from kvchat.storage.db import (SEGMENT_KEY_BOUNDS, SEGMENT_KINDS, SEGMENT_KV, SEGMENT_MERGED, SEGMENT_UNIT_ROWS,
                                   SEGMENT_UNITS, RoundRow, now)

    assert SEGMENT_KINDS == (SEGMENT_KV, SEGMENT_KEY_BOUNDS, SEGMENT_MERGED, SEGMENT_UNITS, SEGMENT_UNIT_ROWS) == (
        "kv", "key-bounds", "merged", "units", "unit-rows")
    store = Store()
    sid = store.create_session(title="kinds", model_fingerprint="ab" * 32, model_path="m.gguf", system_prompt=None)
    for i in range(2):
        store.add_round(sid, RoundRow(i, "u", "a", 40 * i, 40 * i + 40, now()))
    store.add_segment(sid, **segment_row(0, "a"))  # kind "kv" unless told
    store.add_segment(sid, kind=SEGMENT_KEY_BOUNDS, **segment_row(0, "b"))
    store.add_segment(sid, kind=SEGMENT_KV, **segment_row(0, "c"))  # replaces the K/V row only
    store.add_segment(sid, kind=SEGMENT_KEY_BOUNDS, **segment_row(1, "d", layer_start=8))
    store.add_segment(sid, **segment_row(1, "e", layer_start=8))
    with pytest.raises(ValueError, match="unknown KV segment kind 'bounds'"):
        store.add_segment(sid, kind="bounds", **segment_row(1, "f"))
    assert kinds_and_files(store, sid) == [(0, "key-bounds", "b"), (0, "kv", "c"), (1, "key-bounds", "d"),
                                           (1, "kv", "e")]
    fork = store.fork_session(sid, 1, "fork")
    assert kinds_and_files(store, fork) == kinds_and_files(store, sid)[:2]
    b, c = "b" * 64 + ".kvs", "c" * 64 + ".kvs"
    store.drop_segments(sid, 1)
    assert kinds_and_files(store, sid) == [(0, "key-bounds", "b"), (0, "kv", "c")]
    assert store.delete_session(sid) == [] and store.referenced_files() == {b, c}  # they live on in the fork
    assert sorted(store.set_round_spans(fork, [0], [41])) == [b, c] and store.segments(fork) == []
