"""The app's edit key (ctrl+t), the chat's parameters dialog (f12), the export dialog's formats and the theme kept
across restarts, through Textual's Pilot."""

from __future__ import annotations

import json

from textual.widgets import Input, Select

from kvchat.app.tui.chat_view import MessageView
from kvchat.app.tui.dialogs.chat_parameters import ChatParametersDialog
from kvchat.app.tui.dialogs.export_dialog import ExportDialog
from kvchat.app.tui.composer import Composer
from kvchat.app.tui.dialogs.edit_message import EditMessageDialog
from kvchat.app.tui.preferences import Preferences
from kvchat.paths import data_dir
from kvchat.storage.db import Store, chat_parameters
from tui_support import (make_app, notifications, screen, seed_chat, shown_messages, status_text, wait_for,
                         wait_idle)


def store() -> Store:
    return Store(data_dir())


async def open_chat(pilot, sid: str) -> None:
    await wait_for(pilot, lambda: screen(pilot.app).sidebar.chats, what="the chat list")
    screen(pilot.app).open_chat(sid)
    await wait_idle(pilot)


async def test_ctrl_t_edits_the_selected_message_keeps_the_rounds_before_and_forks_the_old_branch():
    sid = seed_chat("ada", ["My name is Ada.", "I live in Paris."])
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        view = screen(app).chat_view
        view.select([m for m in view.query(MessageView) if m.role == "assistant"][0])  # a reply: its round's message
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, EditMessageDialog) and app.screen.query_one(Composer).text == "My name is Ada."
        await pilot.press("escape")
        view.select(view.user_messages()[1])
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, EditMessageDialog)
        box = app.screen.query_one(Composer)
        assert box.text == "I live in Paris." and box.has_focus  # prefilled with the message, the cursor at its end
        # A multi-line message: ctrl+j starts a new line, Enter sends
        await pilot.press(*" Not Rome.", "ctrl+j")
        assert box.text == "I live in Paris. Not Rome.\n" and isinstance(app.screen, EditMessageDialog)
        box.load_text("I live in Rome.\nNot Paris.")
        await pilot.press("enter")
        await wait_idle(pilot)
        assert [r.user_text for r in store().rounds(sid)] == ["My name is Ada.", "I live in Rome.\nNot Paris."]
        assert shown_messages(app)[2][1] == "I live in Rome.\nNot Paris."
        [fork] = [s["id"] for s in store().sessions() if s["id"] != sid]
        assert [r.user_text for r in store().rounds(fork)] == ["My name is Ada.", "I live in Paris."]
        said = " ".join(notifications(app))
        assert "Edited round 1: kept the K/V of round 0 (in memory); only the edited round was computed" in said
        # What the edit reused stays in the status bar until the next reply
        assert "edited round 1: kept the K/V of round 0 (in memory); only the edited round was computed" in \
            status_text(app)
        # With the setting off, the replaced branch is dropped.
        app.preferences.keep_edited_branch = False
        await screen(app).edit_message(0, "My name is Bob.")
        await wait_idle(pilot)
        assert [r.user_text for r in store().rounds(sid)] == ["My name is Bob."]
        assert len(store().sessions()) == 2
        await pilot.press(*"What is my name?", "enter")
        await wait_idle(pilot)
        assert "edited round" not in status_text(app)
    app.backend.close()


async def test_f12_sets_the_chat_s_parameters_and_a_bad_one_is_refused():
    sid = seed_chat("ada", [("My name is Ada.", "Noted: your name is Ada.")], with_kv=False)
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await open_chat(pilot, sid)
        await pilot.press("f12")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatParametersDialog), what="the parameters dialog")
        app.screen.query_one("#chat-top-p", Input).value = "2"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatParametersDialog)  # refused, still open
        assert "top-p must be in (0, 1]" in " ".join(notifications(app, "error"))
        app.screen.query_one("#chat-top-p", Input).value = ""
        app.screen.query_one("#chat-temperature", Input).value = "0.5"
        app.screen.query_one("#chat-reply-cap", Input).value = "7"
        await pilot.press("ctrl+s")
        await wait_idle(pilot)
        assert chat_parameters(store().session(sid)) == {"temperature": 0.5, "top_p": None, "top_k": None,
                                                          "seed": None, "reply_cap": 7}
    app.backend.close()


async def test_the_export_dialog_writes_the_format_chosen(tmp_path):
    sid = seed_chat("ada", [("My name is Ada.", "Noted: your name is Ada.")], with_kv=False)
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app).sidebar.chats, what="the chat list")
        screen(app).sidebar.highlight(sid)
        await pilot.press("f3")
        assert isinstance(app.screen, ExportDialog)
        app.screen.query_one("#export-path", Input).value = str(tmp_path / "ada.kvstate")
        app.screen.query_one("#export-format", Select).value = "json"
        await pilot.pause()
        assert app.screen.query_one("#export-path", Input).value == str(tmp_path / "ada.json")
        app.screen.query_one("#export-path", Input).focus()
        await pilot.press("enter")
        await wait_idle(pilot)
        assert json.loads((tmp_path / "ada.json").read_text()) == [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Noted: your name is Ada."}]
    app.backend.close()


async def test_the_theme_chosen_is_kept_across_restarts():
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.theme != "nord"
        app.theme = "nord"
        await pilot.pause(0.1)
    app.backend.close()
    assert Preferences.load().theme == "nord"
    again = make_app()
    async with again.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert again.theme == "nord"
    again.backend.close()
