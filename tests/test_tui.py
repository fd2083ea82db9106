"""The terminal app's flows, driven through Textual's Pilot with the embedded model on the CPU."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from textual.widgets import ProgressBar, Select

from kvchat.app.session.chat import ChatSession
from kvchat.app.session.restore import RestoreRun
from kvchat.app.tui.chat_screen import ChatScreen
from kvchat.app.tui.chat_view import ReplyView
from kvchat.app.tui.composer import Composer
from kvchat.app.tui.dialogs.confirm import ConfirmDialog
from kvchat.app.tui.dialogs.export_dialog import ExportDialog
from kvchat.app.tui.dialogs.fork import ForkDialog
from kvchat.app.tui.dialogs.help import HelpScreen, key_rows, key_table
from kvchat.app.tui.dialogs.settings import SettingsDialog
from kvchat.app.tui.dialogs.text_prompt import TextPrompt
from kvchat.app.tui.preferences import Preferences
from kvchat.engine.kv.tiered import TieredKV
from kvchat.paths import data_dir
from kvchat.storage.db import Store
from tui_support import (make_app, notifications, screen, seed_chat, shown_messages, status_text, wait_for,
                         wait_idle)

ROOT = Path(__file__).resolve().parent.parent


def store() -> Store:
    return Store(data_dir())


def assert_restored_from_disk(app) -> None:
    status = status_text(app)
    assert re.search(r"restored from disk: [1-9]\d* tokens loaded, 0 recomputed, [\d.]+ ms", status), status


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def open_from_list(pilot, index: int) -> None:
    """Through the keys: the filter box, Enter into the list, down to the chat, Enter."""
    await pilot.press("ctrl+f", "enter")
    chat_list = screen(pilot.app).sidebar.chat_list
    chat_list.highlighted = 0
    for _ in range(index):
        await pilot.press("down")
    await pilot.press("enter")


async def test_first_message_starts_a_chat_streams_the_reply_and_saves_the_round():
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: "cpu" in status_text(app), what="the model")
        await type_and_send(pilot, "My name is Ada.")
        await wait_for(pilot, lambda: screen(app).query(ReplyView), what="the reply view")
        await wait_idle(pilot)
        reply = screen(app).query_one(ReplyView)
        assert reply.pieces > 1  # it arrived token by token, not at once
        assert shown_messages(app) == [("user", "My name is Ada."), ("assistant", "Noted: your name is Ada.")]
        [chat] = store().sessions()
        assert chat["title"] == "My name is Ada." and chat["n_rounds"] == 1 and chat["kv_bytes"] > 0
        status = status_text(app)
        assert re.search(r"context 26/4096 · [\d.]+ tok/s · first token [\d.]+ ms", status), status
        assert re.search(r"KV [\d.]+ KiB on disk / 208 KiB raw", status), status
        assert "in memory" in str(screen(app).sidebar.chat_list.get_option_at_index(0).prompt)

        await type_and_send(pilot, "What is my name?")
        await wait_idle(pilot)
        assert shown_messages(app)[-1] == ("assistant", "Your name is Ada.")  # answered from the kept KV
        assert [r.assistant_text for r in store().rounds(chat["id"])] == ["Noted: your name is Ada.",
                                                                          "Your name is Ada."]
    app.backend.close()


async def test_escape_stops_the_reply_and_the_part_written_is_saved(slow_tokens):
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await type_and_send(pilot, "My name is Ada.")
        await wait_for(pilot, lambda: any(v.pieces for v in screen(app).query(ReplyView)), what="a first token")
        await pilot.press("escape")
        await wait_idle(pilot)
        [chat] = store().sessions()
        [row] = store().rounds(chat["id"])
        assert row.assistant_text and row.assistant_text != "Noted: your name is Ada."
        assert "Noted: your name is Ada.".startswith(row.assistant_text.strip())
        assert shown_messages(app)[-1] == ("assistant", row.assistant_text)
        assert [str(n.render()) for n in screen(app).query(".note")] == ["stopped"]
    app.backend.close()


async def test_switching_chats_while_generating_stops_that_reply_and_restores_the_other_from_disk(slow_tokens):
    other = seed_chat("Bob's chat", ["My name is Bob."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await type_and_send(pilot, "My name is Ada.")
        await wait_for(pilot, lambda: any(v.pieces for v in screen(app).query(ReplyView)), what="a first token")
        await wait_for(pilot, lambda: len(screen(app).sidebar.chats) == 2, what="the new chat in the list")
        new = screen(app).open_sid
        ids = [c.id for c in screen(app).sidebar.chats]
        await open_from_list(pilot, ids.index(other))
        await wait_idle(pilot)
        assert screen(app).open_sid == other
        assert shown_messages(app) == [("user", "My name is Bob."), ("assistant", "Noted: your name is Bob.")]
        assert_restored_from_disk(app)
        [row] = store().rounds(new)  # the stopped reply is saved in its own chat
        assert row.user_text == "My name is Ada." and "Noted: your name is Ada.".startswith(row.assistant_text)
        assert row.assistant_text != "Noted: your name is Ada."
        assert any("Stopped the reply" in n for n in notifications(app))
        assert not notifications(app, "error")

        await open_from_list(pilot, [c.id for c in screen(app).sidebar.chats].index(new))
        await wait_idle(pilot)
        assert shown_messages(app) == [("user", "My name is Ada."), ("assistant", row.assistant_text)]
    app.backend.close()


async def test_a_slow_restore_shows_progress_and_switching_away_cancels_it(monkeypatch):
    long_chat = seed_chat("long", ["My name is Ada.", "I live in Lisbon.", "My dog is Rex."])
    short_chat = seed_chat("short", ["My name is Bob."])
    real = RestoreRun._load_round
    gate = threading.Event()

    def slow_load(self, i, *args):
        if i >= 1:  # the long chat's restore stalls after its first round until the test has switched away
            gate.wait(20)
        return real(self, i, *args)

    monkeypatch.setattr(RestoreRun, "_load_round", slow_load)
    monkeypatch.setattr(ChatScreen, "PROGRESS_AFTER_S", 0.1)
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        ids = [c.id for c in screen(app).sidebar.chats]
        await open_from_list(pilot, ids.index(long_chat))
        await wait_for(pilot, lambda: screen(app).query_one("#restore-progress").display, what="the progress bar")
        await wait_for(pilot, lambda: screen(app).query_one(ProgressBar).progress == 26, what="round 1 restored")
        assert screen(app).query_one(ProgressBar).total == store().rounds(long_chat)[-1].token_end
        await open_from_list(pilot, ids.index(short_chat))
        gate.set()
        await wait_idle(pilot)
        assert screen(app).open_sid == short_chat
        assert not screen(app).query_one("#restore-progress").display
        assert not app.backend.is_in_memory(long_chat)  # its restore stopped; nothing half-restored is kept
        assert app.backend.is_in_memory(short_chat)
        assert not notifications(app, "error")  # a cancelled restore is silent
        assert shown_messages(app) == [("user", "My name is Bob."), ("assistant", "Noted: your name is Bob.")]
        assert_restored_from_disk(app)
    app.backend.close()


async def test_rename_and_delete_with_confirmation():
    keep = seed_chat("keep me", ["My name is Bob."])
    doomed = seed_chat("old title", ["My name is Ada."])
    kv_files = {s["file"] for s in store().segments(doomed)}
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        sidebar = screen(app).sidebar
        sidebar.highlight(doomed)
        await pilot.press("f2")
        assert isinstance(app.screen, TextPrompt)
        await pilot.press(*["backspace"] * len("old title"), *"Ada's chat", "enter")
        await wait_idle(pilot)
        assert store().session(doomed)["title"] == "Ada's chat"
        assert sidebar.title_of(doomed) == "Ada's chat"

        sidebar.highlight(doomed)
        await pilot.press("f8")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")
        await wait_idle(pilot)
        assert len(store().sessions()) == 2

        sidebar.highlight(doomed)
        await pilot.press("f8", "y")
        await wait_idle(pilot)
        assert [s["id"] for s in store().sessions()] == [keep]
        assert [c.id for c in sidebar.chats] == [keep]
        assert not any((store().kv_dir / f).exists() for f in kv_files)  # its KV files are gone too
    app.backend.close()


async def test_fork_at_a_chosen_round_opens_the_fork_restored_from_the_shared_kv():
    source = seed_chat("source", ["My name is Ada.", "I live in Lisbon."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        screen(app).sidebar.highlight(source)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, ForkDialog), what="the fork dialog")
        await pilot.press("up", "enter")  # after round 1 of 2
        await wait_idle(pilot)
        fork = screen(app).open_sid
        assert fork not in (None, source)
        assert store().session(fork)["title"] == "source (fork)"
        assert [r.user_text for r in store().rounds(fork)] == ["My name is Ada."]
        assert len(store().rounds(source)) == 2
        assert shown_messages(app) == [("user", "My name is Ada."), ("assistant", "Noted: your name is Ada.")]
        assert_restored_from_disk(app)
    app.backend.close()


async def test_export_then_import_and_a_bad_file_changes_nothing(tmp_path, monkeypatch):
    sid = seed_chat("to export", ["My name is Ada."])
    monkeypatch.chdir(tmp_path)  # the paths typed below are the files' names: each key costs a redraw
    out = tmp_path / "ada.kvstate"
    bad = tmp_path / "bad.kvstate"
    bad.write_bytes(b"PK\x03\x04 this is not a zip at all")
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        screen(app).sidebar.highlight(sid)
        await pilot.press("f3")
        assert isinstance(app.screen, ExportDialog)
        app.screen.query_one("#export-path").value = str(out)
        await pilot.press("enter")
        await wait_idle(pilot)
        manifest = __import__("zipfile").ZipFile(out).read("manifest.json")
        assert json.loads(manifest)["segments"]  # with its KV, as `kvchat export` writes it

        await pilot.press("f4")
        assert isinstance(app.screen, TextPrompt)
        await pilot.press(*bad.name, "enter")
        await wait_idle(pilot)
        [error] = notifications(app, "error")
        assert "bad.kvstate is not a valid kvchat state file" in error
        assert [s["id"] for s in store().sessions()] == [sid]

        await pilot.press("f4")
        await pilot.press(*out.name, "enter")
        await wait_for(pilot, lambda: len(store().sessions()) == 2, what="the import")
        await wait_idle(pilot)
        imported = screen(app).open_sid
        # The exported chat is still there: the copy gets a title of its own, and says so.
        assert imported != sid and store().session(imported)["title"] == "to export (2)"
        assert any("imported as “to export (2)”" in n for n in notifications(app, "warning"))
        assert_restored_from_disk(app)
    app.backend.close()


async def test_regenerate_replaces_the_last_reply_and_copy_takes_the_selected_message():
    sid = seed_chat("ada", ["My name is Ada."])
    before = store().rounds(sid)[0]
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await open_from_list(pilot, 0)
        await wait_idle(pilot)
        await pilot.press("ctrl+r")
        await wait_idle(pilot)
        [after] = store().rounds(sid)
        assert after.created != before.created  # a new round, answered again (greedy: the same words)
        assert after.assistant_text == "Noted: your name is Ada."
        assert shown_messages(app) == [("user", "My name is Ada."), ("assistant", "Noted: your name is Ada.")]

        await pilot.press("ctrl+o")
        assert app.clipboard == "Noted: your name is Ada."  # nothing selected: the last reply
        await pilot.click(".message.user")
        await pilot.press("ctrl+o")
        assert app.clipboard == "My name is Ada."
    app.backend.close()


async def test_composer_newline_key_and_history_of_sent_messages():
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        composer = screen(app).query_one(Composer)
        await pilot.press(*"My name is Ada.", "ctrl+j", *"Hi.")
        assert composer.text == "My name is Ada.\nHi."
        await pilot.press("enter")
        await wait_idle(pilot)
        assert shown_messages(app)[0] == ("user", "My name is Ada.\nHi.")
        await pilot.press(*"draft", "up")
        assert composer.text == "My name is Ada.\nHi."
        await pilot.press("down")
        assert composer.text == "draft"
    app.backend.close()


async def test_settings_change_reply_length_and_the_chats_system_prompt():
    sid = seed_chat("ada", ["My name is Ada."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await open_from_list(pilot, 0)
        await wait_idle(pilot)
        await pilot.press("f9")
        assert isinstance(app.screen, SettingsDialog)
        app.screen.query_one("#max-tokens").value = "abc"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsDialog)  # refused, with a notification saying why
        assert "max-tokens must be a whole number, not 'abc'" in notifications(app, "error")
        app.screen.query_one("#max-tokens").value = "3"
        app.screen.query_one("#system-prompt").load_text("You remember facts.")
        await pilot.press("ctrl+s")
        await wait_idle(pilot)
        assert app.preferences.max_tokens == 3
        assert json.loads((data_dir() / "app-settings.json").read_text())["max_tokens"] == 3
        assert store().session(sid)["system_prompt"] == "You remember facts."
        assert "re-prefilled from text: 0 tokens loaded" in status_text(app)  # the old K/V no longer applies
        await type_and_send(pilot, "What is my name?")
        await wait_idle(pilot)
        assert len(app.backend.engine(store().session(sid)["model_path"]).tokenizer.encode(
            store().rounds(sid)[-1].assistant_text, add_bos=False)) <= 3
    app.backend.close()


async def test_the_gpu_memory_setting_is_checked_saved_and_planned_within():
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_idle(pilot)
        assert app.backend.gpu_memory is None  # default: what the GPU has free
        await pilot.press("f9")
        app.screen.query_one("#gpu-memory").value = "12 gigs"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsDialog)  # refused, with a notification saying why
        assert any("GPU memory: '12 gigs' is not a size" in n for n in notifications(app, "error"))
        app.screen.query_one("#gpu-memory").value = "12GiB"
        await pilot.press("ctrl+s")
        await wait_idle(pilot)
        assert json.loads((data_dir() / "app-settings.json").read_text())["gpu_memory"] == "12GiB"
        assert (app.backend.gpu_memory, app.backend.gpu_memory_name) == (12 << 30, "the GPU memory setting")
    app.backend.close()
    (data_dir() / "app-settings.json").write_text(json.dumps({"gpu_memory": "lots", "max_tokens": 7}))
    assert (Preferences.load().gpu_memory, Preferences.load().max_tokens) == ("", 7)  # a hand edit: only it is reset
    override = make_app(gpu_memory=8 << 30)  # `kvchat --gpu-memory 8GiB`: this run, over the setting
    assert (override.backend.gpu_memory, override.backend.gpu_memory_name) == (8 << 30, "--gpu-memory")


async def test_the_xkv_policy_and_its_budget_are_set_checked_and_the_open_chat_answers_under_them():
    sid = seed_chat("ada", ["My name is Ada."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await open_from_list(pilot, 0)
        await wait_idle(pilot)
        await pilot.press("f9")
        app.screen.query_one("#kv-policy", Select).value = "xkv"
        app.screen.query_one("#kv-budget").value = "1.5"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsDialog)  # refused, with a notification saying why
        assert any("KV budget is a share of the chat's K/V in (0, 1], not 1.5" in n
                   for n in notifications(app, "error"))
        app.screen.query_one("#kv-budget").value = "0.3"
        await pilot.press("ctrl+s")
        await wait_idle(pilot)
        saved = json.loads((data_dir() / "app-settings.json").read_text())
        assert (saved["kv_policy"], saved["kv_budget"], app.backend.kv_budget) == ("xkv", 0.3, 0.3)
        await pilot.press(*"What is my name?", "enter")
        await wait_idle(pilot)
        rows = store().rounds(sid)
        # a chat this short keeps a handful of tokens a layer: the answer is the model's, saved as shown
        assert shown_messages(app)[-1] == ("assistant", rows[-1].assistant_text) and rows[-1].assistant_text
        budgets = store().kv_budgets(sid)
        assert (budgets["policy"], budgets["budget"]) == ("xkv", 0.3)
        assert len(notifications(app, "error")) == 1  # the refused budget's, nothing since
    app.backend.close()


async def test_the_round_policy_chosen_in_the_settings_is_saved_and_the_open_chat_reopens_under_it(monkeypatch,
                                                                                                   tmp_path):
    from kvchat.app.session import artifacts

    # A model whose calibration is not shipped (the embedded model's is: made here again, it must be the same)
    monkeypatch.setattr(artifacts, "SHIPPED_CALIBRATION", tmp_path / "none.calibration.json")
    sid = seed_chat("ada", ["My name is Ada."])  # stored under the full cache: all layers per round
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await open_from_list(pilot, 0)
        await wait_idle(pilot)
        assert not isinstance(app.backend._open[sid].session.cache, TieredKV)
        await pilot.press("f9")
        assert isinstance(app.screen, SettingsDialog)
        assert app.screen.query_one("#kv-policy", Select).value == "full"
        app.screen.query_one("#kv-policy", Select).value = "round"
        told, notify = [], app.notify  # every notification, also those that time out during the calibration
        app.notify = lambda message, *args, **kwargs: (told.append(message), notify(message, *args, **kwargs))[1]
        await pilot.press("ctrl+s")
        await wait_idle(pilot, timeout=180)  # the model's calibration: the KL curve, then the check of L_w
        assert app.preferences.kv_policy == "round"
        assert json.loads((data_dir() / "app-settings.json").read_text())["kv_policy"] == "round"
        # The model had no calibration in this fresh home: it is made now, and said.
        assert any("Calibrating the model for the round KV policy or for merging" in n for n in told)
        made = json.loads(next((data_dir() / "calibrations").glob("*[0-9a-f].json")).read_text())
        shipped = json.loads(artifacts.DEFAULT_MODEL.with_suffix(".calibration.json").read_text())
        # The shipped file is what calibrating gives: every decision the same, the KL curve and the agreements to the
        # 4th decimal (another CPU's SIMD rounds the sums of a softmax differently in the 6th).
        approx = {"curve": pytest.approx(shipped["curve"], abs=1e-4),
                  "agreement": pytest.approx(shipped["agreement"], abs=1e-3), "date": None}
        assert {**made, "date": None} == {**shipped, **approx}
        assert any("reopening “ada” under it" in n for n in told)
        session = app.backend._open[sid].session
        assert isinstance(session.cache, TieredKV)
        assert_restored_from_disk(app)  # the full cache's segments hold the lower and the upper layers
        await type_and_send(pilot, "What is my name?")
        await wait_idle(pilot)
        assert app.backend._open[sid].session is session  # answered under the round policy, not reopened
        assert shown_messages(app)[-1] == ("assistant", "Your name is Ada.")
        assert not notifications(app, "error")
    assert Preferences.load().kv_policy == "round"
    app.backend.close()


def test_an_unknown_saved_kv_policy_falls_back_to_the_full_cache_and_keeps_the_rest(kvchat_home):
    kvchat_home.mkdir(parents=True, exist_ok=True)
    (kvchat_home / "app-settings.json").write_text(json.dumps({"kv_policy": "round-bogus", "max_tokens": 7}))
    prefs = Preferences.load()
    assert prefs.kv_policy == "full" and prefs.max_tokens == 7
    app = make_app()
    assert app.preferences.kv_policy == "full"
    assert make_app(kv_policy="round").preferences.kv_policy == "round"  # --kv-policy, for this run only
    assert Preferences.load().kv_policy == "full"


async def test_engine_and_storage_errors_are_notifications_never_a_crash(tmp_path):
    sid = seed_chat("lost model", [("My name is Ada.", "Noted: your name is Ada.")], with_kv=False)
    with store().transaction() as db:
        db.execute("UPDATE sessions SET model_path = ? WHERE id = ?", [str(tmp_path / "gone.gguf"), sid])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        await open_from_list(pilot, 0)
        await wait_idle(pilot)
        assert shown_messages(app) == [("user", "My name is Ada."), ("assistant", "Noted: your name is Ada.")]
        assert any("gone.gguf is missing; its text is safe" in n for n in notifications(app, "error"))
        await type_and_send(pilot, "What is my name?")
        await wait_idle(pilot)
        assert len(notifications(app, "error")) == 2
        assert screen(app).query_one(Composer).text == "What is my name?"  # the message is given back
        assert len(store().rounds(sid)) == 1
        assert app.is_running
    app.backend.close()


async def test_help_lists_every_key_and_the_readme_has_the_same_table():
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
    keys = [k for k, _ in key_rows()]
    for needed in ("enter", "ctrl+j", "escape", "ctrl+r", "ctrl+o", "ctrl+n", "f2", "f5", "f8", "f3", "f4", "f9",
                   "f1", "ctrl+q"):
        assert needed in keys
    assert key_table() in (ROOT / "README.md").read_text()


def test_kvchat_help_still_lists_the_commands():
    from cli_run import kvchat

    out = kvchat("--help").stdout
    assert "With no command, kvchat opens the terminal app" in out
    for command in ("new", "send", "sessions", "show", "rm", "export", "import", "generate"):
        assert re.search(rf"^\s+{command}\s", out, flags=re.M), command


def test_a_failed_regeneration_keeps_the_old_reply(kvchat_home, monkeypatch):
    from kvchat.app.session.service import ChatService
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.sampling import SamplingParams

    backend = ChatService(device="cpu")
    sid = backend.create_chat(DEFAULT_MODEL)
    first = backend.send(sid, "My name is Ada.", max_tokens=16, sampling=SamplingParams())
    old_reply = first.round.assistant_text

    def broken_send(self, *a, **k):
        raise RuntimeError("the GPU fell over")

    monkeypatch.setattr(ChatSession, "send", broken_send)
    with pytest.raises(RuntimeError):
        backend.send(sid, "", max_tokens=16, sampling=SamplingParams(), regenerate=True)
    monkeypatch.undo()
    rounds = backend.store.rounds(sid)
    assert [r.user_text for r in rounds] == ["My name is Ada."] and rounds[0].assistant_text == old_reply != ""
    # The chat goes on: reopened from the store, the old round's K/V is recomputed from its text.
    again = backend.send(sid, "What is my name?", max_tokens=16, sampling=SamplingParams())
    assert again.result.text


def test_the_app_runs_a_chat_under_loopserve(kvchat_home):
    from kvchat.app.session.service import ChatService
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.sampling import SamplingParams

    backend = ChatService(device="cpu")
    try:
        sid = backend.create_chat(DEFAULT_MODEL)
        for message in ("My name is Ada.", "What is my name?"):
            reply = backend.send(sid, message, max_tokens=16, sampling=SamplingParams(), kv_policy="loopserve")
        session = backend._open[sid].session
        assert reply.result.text == "Your name is Ada." and session.message_policy.name == "loopserve"
        assert session.message_policy.last_decode is not None  # the reply decoded through the policy's step
    finally:
        backend.close()


def test_a_chat_put_out_of_memory_stops_reading_its_upper_layers(kvchat_home):
    from kvchat.app.session.service import CHATS_IN_MEMORY, ChatService
    from kvchat.app.session.artifacts import save_calibration
    from kvchat.engine.calibrate.watershed import Calibration
    from kvchat.storage.fingerprint import model_fingerprint
    from kvchat.assets import DEFAULT_MODEL

    sids = [seed_chat(f"chat {n}", [f"My name is Ada{n}."]) for n in range(CHATS_IN_MEMORY + 1)]
    fp = model_fingerprint(DEFAULT_MODEL, store())
    save_calibration(Calibration(fingerprint=fp, model_name="demo", n_layers=8, watershed=2, curve=[0.0] * 8,
                                 chats=1, source="memory-dialogues", seed=0, date="2026-11-22T00:00:00+00:00"))
    backend = ChatService(device="cpu")
    try:
        for sid in sids[:CHATS_IN_MEMORY]:
            backend.restore(sid, kv_policy="round")
        first = backend._open[sids[0]].session
        assert not first.upper_reads.fetcher._closed
        backend.restore(sids[-1], kv_policy="round")  # one chat too many: the least recently used goes
        assert sids[0] not in backend._open and first.upper_reads.fetcher._closed
        second = backend._open[sids[1]].session
        backend.forget(sids[1])
        assert second.upper_reads.fetcher._closed
    finally:
        backend.close()


async def test_the_empty_screen_says_what_the_demo_model_can_do_and_an_empty_message_is_refused():
    from textual.widgets import Markdown

    from kvchat.app.tui.chat_view import DEMO_LINE

    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: "cpu" in status_text(app), what="the model")
        welcome = screen(app).query_one("#welcome", Markdown)
        await wait_for(pilot, lambda: DEMO_LINE in welcome.source, what="the demo line")
        assert "--model" in DEMO_LINE and "F9" in DEMO_LINE
        await pilot.press("space", "space", "enter")
        await pilot.pause()
        assert "The message is empty: type something to send." in notifications(app, "warning")
        assert not store().sessions() and not shown_messages(app)
    app.backend.close()
