"""The terminal app beside other kvchat processes and after failures: chats changed on disk by another process show
up; rounds by reply state; waiting for another writer; the status bar after any error; ctrl+c; KV save failures and
recomputed restores said once; no control character of stored text reaches the screen.

"Another process" is a second SQLite connection (data_version changes whenever another connection commits) and,
for the chat's writer lock, a child process holding it (storage.chat_lock)."""

from __future__ import annotations

import subprocess
import sys


from kvchat.app.session.chat import ChatSession
from kvchat.app.session.writer import KVWriter
from kvchat.app.tui.chat_live import ChatLive
from kvchat.app.tui.chat_view import ANSWERED_ELSEWHERE_NOTE, NO_REPLY_NOTE, ReplyView
from kvchat.app.tui.dialogs.confirm import ConfirmDialog
from kvchat.app.tui.dialogs.settings import SettingsDialog
from kvchat.errors import KvchatError
from kvchat.paths import data_dir
from kvchat.storage.codec import StorageError
from kvchat.storage.db import REPLY_DONE, REPLY_PARTIAL, REPLY_PENDING, RoundRow, Store, now
from tui_support import (make_app, notifications, screen, seed_chat, shared_engine, shown_messages, status_text,
                         wait_for, wait_idle)

ADA = ("My name is Ada.", "Noted: your name is Ada.")

RECOMPUTED = "recomputed stored K/V that could not be used"


def store() -> Store:
    return Store(data_dir())


def notes(app) -> list[str]:
    return [str(n.render()) for n in screen(app).query(".note")]


class LockHolder:
    """Another kvchat process writing to a chat: a child process that holds the chat's writer lock until released."""

    CODE = ("import sys; from pathlib import Path; from kvchat.storage.chat_lock import ChatLock; "
            "lock = ChatLock.acquire(Path(sys.argv[1]), sys.argv[2], wait_s=0); print('held', flush=True); "
            "sys.stdin.readline(); lock.release()")

    def __init__(self, sid: str):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(data_dir()), sid], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(10)

    def __enter__(self) -> "LockHolder":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def next_row(sid: str, user: str, assistant: str, state: str = REPLY_DONE) -> RoundRow:
    """The chat's next round as another process would write it (spans only shown, never restored here)."""
    rows = store().rounds(sid)
    start = rows[-1].token_end if rows else 0
    return RoundRow(len(rows), user, assistant, start, start + 12, now(), state)


async def open_chat(pilot, sid: str) -> None:
    await wait_for(pilot, lambda: any(c.id == sid for c in screen(pilot.app).sidebar.chats), what="the chat list")
    screen(pilot.app).open_chat(sid)
    await wait_idle(pilot)


# ---- 1. chats changed on disk by another process ----

async def test_rounds_titles_and_deletions_made_by_another_process_show_up():
    sid = seed_chat("ada", [ADA], with_kv=False)
    other_sid = seed_chat("bob", [("My name is Bob.", "Noted: your name is Bob.")], with_kv=False)
    app = make_app()
    other = store()  # another process's connection
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        other.add_round(sid, next_row(sid, "I live in Lisbon.", "Noted: you live in Lisbon."))
        await wait_for(pilot, lambda: len(shown_messages(app)) == 4, what="the new round")
        await wait_idle(pilot)
        assert shown_messages(app)[2:] == [("user", "I live in Lisbon."), ("assistant", "Noted: you live in Lisbon.")]
        assert screen(app).composer.sent == ["My name is Ada.", "I live in Lisbon."]  # Up recalls it too

        other.rename_session(other_sid, "Bob, renamed elsewhere")
        await wait_for(pilot, lambda: screen(app).sidebar.title_of(other_sid) == "Bob, renamed elsewhere",
                       what="the new title")
        assert screen(app).open_sid == sid and len(shown_messages(app)) == 4

        other.unlink_files(other.delete_session(sid))
        await wait_for(pilot, lambda: screen(app).open_sid is None, what="the open chat closed")
        await wait_idle(pilot)
        assert [c.id for c in screen(app).sidebar.chats] == [other_sid]
        assert "“ada” was deleted by another kvchat process." in notifications(app, "warning")
        assert not shown_messages(app) and screen(app).query("#welcome")
        assert "no chat open" in status_text(app)
        assert not notifications(app, "error")
    app.backend.close()


async def test_a_reply_pending_in_another_process_then_finished_or_abandoned():
    sid = seed_chat("ada", [ADA], with_kv=False)
    app = make_app()
    other = store()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        with LockHolder(sid) as holder:
            pending = next_row(sid, "Where do I live?", "", REPLY_PENDING)
            other.add_round(sid, pending)
            await wait_for(pilot, lambda: notes(app) == [ANSWERED_ELSEWHERE_NOTE], what="the pending note")
            assert shown_messages(app)[-2:] == [("user", "Where do I live?"), ("assistant", "")]

            other.finish_round(sid, RoundRow(pending.idx, pending.user_text, "In Lisbon.", pending.token_start,
                                             pending.token_end, pending.created, REPLY_DONE))
            await wait_for(pilot, lambda: shown_messages(app)[-1] == ("assistant", "In Lisbon."),
                           what="the finished reply")
            assert notes(app) == []

            other.add_round(sid, next_row(sid, "And my dog?", "", REPLY_PENDING))
            await wait_for(pilot, lambda: notes(app) == [ANSWERED_ELSEWHERE_NOTE], what="a pending note")
            holder.release()  # that process ends without a commit: only its lock goes
            await wait_for(pilot, lambda: notes(app) == [NO_REPLY_NOTE], what="the abandoned note")
        assert not notifications(app, "error")
    app.backend.close()


async def test_the_apps_send_after_another_process_wrote_rounds_shows_the_stored_chat(monkeypatch):
    # No polling: the open chat's view is stale when the app sends; the reply flow alone must catch up.
    monkeypatch.setattr(ChatLive, "POLL_S", 3600)
    sid = seed_chat("ada", ["My name is Ada."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        other = ChatSession(store(), shared_engine(), sid)  # another process answers a message in the same chat
        other.restore()
        other.send("I live in Lisbon.", max_tokens=24)
        other.close()
        assert len(shown_messages(app)) == 2
        await pilot.press(*"What is my name?", "enter")
        await wait_idle(pilot)
        rows = store().rounds(sid)
        assert [r.user_text for r in rows] == ["My name is Ada.", "I live in Lisbon.", "What is my name?"]
        assert shown_messages(app) == [(role, text) for r in rows
                                       for role, text in (("user", r.user_text), ("assistant", r.assistant_text))]
        assert rows[-1].assistant_text == "Your name is Ada." and rows[-1].reply_state == REPLY_DONE
        assert screen(app).shown.rounds[-1].idx == 2
        assert not notifications(app, "error")
    app.backend.close()


async def test_the_app_and_two_send_processes_racing_on_one_chat_lose_nothing():
    """The race of test_one_writer with the app open on the chat and sending too: every message and reply of all
    three writers in the chat, each writer's in its order, and the app showing the chat as stored."""
    from test_one_writer import check_race, race_processes

    sid = seed_chat("race", ["My name is Ada."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        collect = race_processes(sid, workers=2, rounds=2)  # started: they run while the app sends
        mine = [f"Note app-{r}: my code is KA{r}." for r in range(2)]
        for message in mine:
            await pilot.press(*message, "enter")
            await wait_idle(pilot)
        sent = collect()
        reader = store()

        def stored() -> list[tuple[str, str]]:
            return [(role, text) for r in reader.rounds(sid)
                    for role, text in (("user", r.user_text), ("assistant", r.assistant_text))]

        # Not just the count: a round another process was still answering shows as pending until the next poll.
        await wait_for(pilot, lambda: shown_messages(app) == stored(), what="the stored chat shown")
        rows = store().rounds(sid)
        assert not notifications(app, "error")
    app.backend.close()
    by_app = [(m, r.assistant_text) for m in mine for r in rows if r.user_text == m]
    check_race(shared_engine(), sid, [*sent, [(rows[0].user_text, rows[0].assistant_text), *by_app]])


# ---- 2. rounds by reply state ----

async def test_partial_and_pending_replies_carry_their_note():
    sid = seed_chat("ada", [ADA], with_kv=False)
    other = store()
    other.add_round(sid, next_row(sid, "Tell me a long story.", "Once upon a", REPLY_PARTIAL))
    other.add_round(sid, next_row(sid, "Where do I live?", "", REPLY_PENDING))  # no process holds the lock
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        assert notes(app) == ["stopped", NO_REPLY_NOTE]
        assert [v.note for v in screen(app).query(".message.assistant")] == ["", "stopped", NO_REPLY_NOTE]
    app.backend.close()


# ---- 3. waiting for another writer ----

async def test_a_send_waits_for_another_process_writing_the_chat_and_says_so():
    sid = seed_chat("ada", ["My name is Ada."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        with LockHolder(sid) as holder:
            await pilot.press(*"What is my name?", "enter")
            waiting = f"waiting for another kvchat process writing to this chat (pid {holder.proc.pid}, `kvchat"
            await wait_for(pilot, lambda: waiting in status_text(app), what="the waiting status")
            await pilot.press("escape")  # gives up waiting: nothing was sent, the message comes back
            await wait_idle(pilot)
            [error] = notifications(app, "error")
            assert f"is being written by pid {holder.proc.pid}" in error and "nothing was sent" in error
            assert screen(app).composer.text == "What is my name?"
            assert "waiting" not in status_text(app) and len(store().rounds(sid)) == 1

            await pilot.press("enter")
            await wait_for(pilot, lambda: waiting in status_text(app), what="waiting again")
        await wait_idle(pilot)  # the lock is let go: the reply comes
        assert shown_messages(app)[-1] == ("assistant", "Your name is Ada.")
        assert "waiting" not in status_text(app) and "context" in status_text(app)
    app.backend.close()


# ---- 4. the status bar after errors ----

def activity(app) -> str:
    return screen(app).status_bar.activity


async def test_the_status_bar_recovers_after_a_failed_send_create_restore_open_and_kv_save(monkeypatch):
    sid = seed_chat("ada", [ADA], with_kv=False)
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: "cpu" in status_text(app), what="the model")
        backend = app.backend

        def broken(*args, **kwargs):
            raise KvchatError("the disk is on fire")

        # A first message whose chat cannot be made.
        monkeypatch.setattr(backend, "create_chat", broken)
        await pilot.press(*"Hello", "enter")
        await wait_idle(pilot)
        assert activity(app) == "" and "generating" not in status_text(app)
        assert screen(app).composer.text == "Hello" and screen(app).query("#welcome")
        monkeypatch.undo()

        # A restore that fails: the chat stays open, the bar says what the store knows of it.
        monkeypatch.setattr(backend, "restore", broken)
        screen(app).open_chat(sid)
        await wait_idle(pilot)
        assert "restoring" not in status_text(app) and "not restored yet" in status_text(app)
        assert shown_messages(app) == [("user", ADA[0]), ("assistant", ADA[1])]
        monkeypatch.undo()

        # A send that fails.
        monkeypatch.setattr(backend, "send", broken)
        screen(app).composer.load_text("What is my name?")
        await pilot.press("enter")
        await wait_idle(pilot)
        assert "generating" not in status_text(app) and screen(app).composer.text == "What is my name?"
        monkeypatch.undo()

        # The K/V save after a reply that fails, then the drain itself.
        monkeypatch.setattr(backend, "drain", broken)
        await pilot.press("enter")
        await wait_idle(pilot, timeout=30)
        assert "saving KV" not in status_text(app) and "context" in status_text(app)
        monkeypatch.undo()

        # An open that cannot read the chat at all: back to no chat open.
        await pilot.press("ctrl+n")  # so that opening it again is an opening
        monkeypatch.setattr(backend, "transcript", broken)
        screen(app).open_chat(sid)
        await wait_idle(pilot)
        assert screen(app).open_sid is None and "restoring" not in status_text(app)
        assert "no chat open" in status_text(app)
        monkeypatch.undo()

        errors = notifications(app, "error")
        assert len(errors) == 5 and all(e == "the disk is on fire" for e in errors)
        assert app.is_running
    app.backend.close()


async def test_a_model_that_cannot_be_loaded_leaves_starting(tmp_path):
    app = make_app(model_path=str(tmp_path / "gone.gguf"))
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: notifications(app, "error"), what="the error")
        await wait_idle(pilot)
        status = status_text(app)
        assert status.startswith("gone.gguf · model not loaded · no chat open"), status
        assert "starting" not in status and "loading" not in status
    app.backend.close()


# ---- 5. ctrl+c ----

async def test_ctrl_c_stops_a_reply_and_otherwise_keeps_textuals_meaning(slow_tokens):
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: "cpu" in status_text(app), what="the model")
        await pilot.press(*"My name is Ada.", "enter")
        await wait_for(pilot, lambda: any(v.pieces for v in screen(app).query(ReplyView)), what="a first token")
        await pilot.press("ctrl+c")
        await wait_idle(pilot)
        [chat] = store().sessions()
        [row] = store().rounds(chat["id"])
        assert row.reply_state == REPLY_PARTIAL and "Noted: your name is Ada.".startswith(row.assistant_text.strip())
        assert row.assistant_text != "Noted: your name is Ada."
        assert shown_messages(app)[-1] == ("assistant", row.assistant_text) and notes(app) == ["stopped"]
        assert app.is_running

        # Nothing being written: what ctrl+c did before — a selection in the message box is copied, ...
        composer = screen(app).composer
        composer.load_text("copy me")
        composer.select_all()
        await pilot.press("ctrl+c")
        assert app.clipboard == "copy me"
        # ... and without one, Textual's hint of how to quit; the app goes on.
        composer.load_text("")
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert any("to quit the app" in n for n in notifications(app)) and app.is_running
    app.backend.close()


# ---- 6. KV save failures and recomputed restores, said once ----

async def test_a_failed_kv_save_and_a_recomputed_restore_are_each_said_once(monkeypatch):
    damaged = seed_chat("damaged", ["My name is Ada."])
    seg = store().segments(damaged)[0]
    (store().kv_dir / seg["file"]).write_bytes(b"not a segment")
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, damaged)
        [told] = [n for n in notifications(app, "warning") if RECOMPUTED in n]
        assert told.startswith(f"Restoring “damaged” {RECOMPUTED}: round 0: ") and "\n" not in told

        real = KVWriter._save
        calls = []

        def failing_save(self, *args, **kwargs):
            calls.append(args)
            if len(calls) == 1:
                raise StorageError("no space left on device")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(KVWriter, "_save", failing_save)
        await pilot.press(*"What is my name?", "enter")
        await wait_idle(pilot)
        await pilot.press(*"I live in Lisbon.", "enter")
        await wait_idle(pilot)
        kv_warnings = [n for n in notifications(app, "warning") if n.startswith("KV not saved")]
        assert kv_warnings == ["KV not saved (round 1: no space left on device); the text is saved and its KV is "
                               "recomputed when the chat is next opened"]
        assert [n for n in notifications(app, "warning") if RECOMPUTED in n] == [told]
        assert all("KV not saved" not in text and "no space" not in text for _, text in shown_messages(app))
        assert [r.assistant_text for r in store().rounds(damaged)][1] == "Your name is Ada."
    app.backend.close()


# ---- 7. no control character reaches the screen ----

# Every class: C0 (BEL, BS), ESC sequences (SGR, OSC 52 clipboard write ended by BEL), C1 (CSI as one byte), DEL,
# and a bidi override (escaped in one-line fields: titles).
NASTY = "A\x07B\x08C\x1b[31mD\x1b]52;c;SGVsbG8=\x07E\x9bF\x7fG"
RAW = "\x07\x08\x1b\x9b\x7f"
TITLE = f"T{NASTY}\u202eH"


def screen_text(app) -> str:
    """What the terminal would be sent for the screen on top: the text of every segment of a full redraw (the
    compositor's, the same strips the driver writes), with a line break per row."""
    update = app.screen._compositor.render_update(full=True)
    return "\n".join("".join(segment.text for segment in strip) for strip in update.strips)


def assert_clean(text: str) -> None:
    raw = sorted({f"{ord(ch):#x}" for ch in text if ch in RAW or ch == "\u202e"})
    assert not raw, f"raw control characters on the screen: {raw}"
    assert "\\x07" in text  # and the stored text is there, escaped (a dialog may fold a long title anywhere)


def shows_escaped(app, dialog) -> bool:
    """The dialog is on top and laid out: a loaded machine may draw a pushed screen's first frame blank."""
    return isinstance(app.screen, dialog) and "\\x07" in screen_text(app)


async def test_no_control_character_of_stored_text_reaches_the_screen():
    sid = seed_chat(TITLE, [(f"u{NASTY}", f"a{NASTY}")], with_kv=False, system_prompt=f"s{NASTY}")
    other = store()
    other.add_round(sid, next_row(sid, f"p{NASTY}", f"q{NASTY}", REPLY_PARTIAL))
    app = make_app()
    async with app.run_test(size=(200, 50), notifications=True) as pilot:  # toasts drawn, as outside tests
        await open_chat(pilot, sid)
        text = screen_text(app)
        assert_clean(text)
        for escaped in ("\\x08C", "\\x1b[31mD", "\\x1b]52;c;SGVsbG8=\\x07E", "\\x9bF", "\\x7fG"):
            assert escaped in text
        assert "\\u202eH" in text  # the title's bidi override, escaped in the list
        for shown in (f"u{NASTY}", f"a{NASTY}", f"p{NASTY}", f"q{NASTY}"):  # stored byte-exact, shown escaped
            assert shown in [m for _, m in shown_messages(app)]

        await pilot.press("up")  # the last message recalled into the message box: escaped, sent as shown
        assert_clean(screen_text(app))
        assert screen(app).composer.text == "p" + NASTY.translate({ord(c): f"\\x{ord(c):02x}" for c in RAW})

        # The title and the system prompt in the dialogs, then the title in a notification (a chat deleted elsewhere
        # is named), with markup in it as well.
        await pilot.press("f9")
        await wait_for(pilot, lambda: shows_escaped(app, SettingsDialog), what="the settings, drawn")
        assert_clean(screen_text(app))
        await pilot.press("escape")
        screen(app).sidebar.highlight(sid)
        await pilot.press("f8")
        await wait_for(pilot, lambda: shows_escaped(app, ConfirmDialog), what="the confirmation, drawn")
        assert_clean(screen_text(app))
        await pilot.press("n")
        await wait_idle(pilot)
        other.rename_session(sid, f"[b]{TITLE}[/c]")  # markup in a title is text too
        await wait_for(pilot, lambda: "[b]" in screen(app).sidebar.title_of(sid), what="the new title")
        other.unlink_files(other.delete_session(sid))
        await wait_for(pilot, lambda: screen(app).open_sid is None, what="the chat closed")
        await pilot.pause(0.2)
        [deleted] = [n for n in notifications(app) if "was deleted by another kvchat process" in n]
        assert deleted.startswith("“[b]T") and "\\x1b[31m" in deleted
        text = screen_text(app)
        assert_clean(text)
        assert "“[b]T" in text  # the toast, drawn as plain text
    app.backend.close()
