"""The main screen: chats on the left, the open chat and the message box on the right, the status bar below.

Threads: everything that touches the engine or the store runs in a thread worker; workers hand results back with
`_later` (a message to this screen, so the worker never waits for the UI and the UI never waits for the model).
Every worker catches every exception and turns it into an error notification: the app never crashes on an engine
or storage error.

The screen is put together from its flows, one module each: opening a chat (chat_opening.py), sending and
streaming a reply (chat_replying.py), the actions on chats and the settings (chat_actions.py), following what other
kvchat processes change in the store (chat_live.py); what workers hand back is in worker_messages.py. This module
holds the bindings, the layout, the worker plumbing, the start and the chat list.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, ProgressBar

from kvchat.app.session.restore import RestoreStats
from kvchat.app.session.service import default_model, is_demo_model
from kvchat.app.terminal_text import terminal_line, terminal_text
from kvchat.app.tui.chat_actions import ChatActions
from kvchat.app.tui.chat_editing import ChatEditing
from kvchat.app.tui.chat_live import ChatLive, Shown
from kvchat.app.tui.chat_opening import ChatOpening, Opening
from kvchat.app.tui.chat_replying import ChatReplying, Generation
from kvchat.app.tui.chat_steps import ChatSteps
from kvchat.app.tui.chat_view import ChatView
from kvchat.app.tui.composer import Composer
from kvchat.app.tui.sidebar import Sidebar
from kvchat.app.tui.status_bar import LastReply, StatusBar
from kvchat.app.tui.worker_messages import Later, describe


class ChatScreen(ChatOpening, ChatReplying, ChatEditing, ChatActions, ChatLive, ChatSteps, Screen):
    """The main screen; its flows (opening a chat, replying, the actions on chats) are mixed in from their modules."""

    # The footer shows the keys a first session needs, and fits 80 columns (tests/test_tui_friction.py): the rest
    # (show=False) are in F1's table, as every key is.
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply being generated (the part written is saved)"),
        # Before the focused box's own ctrl+c (copy), and only while a reply is written (action_stop_reply);
        # `system`: not a key of its own in the key table (help.py), the help's note tells it.
        Binding("ctrl+c", "stop_reply", "Stop", show=False, priority=True, system=True),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False,
                tooltip="Answer the last message again (replaces the reply)"),
        Binding("ctrl+o", "copy", "Copy", show=False,
                tooltip="Copy the selected message (else the last reply) to the clipboard"),
        Binding("ctrl+t", "edit_message", "Edit", show=False,
                tooltip="Edit the selected message (else the last one) and answer it again; the rounds before keep "
                        "their KV, the replaced ones are kept as a fork (a setting)"),
        Binding("f12", "chat_parameters", "Parameters", show=False,
                tooltip="The open chat's own parameters: temperature, top-p, top-k, seed, reply cap, system prompt"),
        Binding("ctrl+n", "new_chat", "New", tooltip="Start a new chat (it is created with its first message)"),
        Binding("f2", "rename", "Rename", show=False, tooltip="Rename the highlighted chat"),
        Binding("f5", "fork", "Fork", show=False, tooltip="Fork the highlighted chat after a round you choose"),
        Binding("f8", "delete", "Delete", show=False,
                tooltip="Delete the highlighted chat and its KV files (asks first)"),
        Binding("f3", "export", "Export", show=False,
                tooltip="Export the highlighted chat to a state file or a transcript: Markdown, text, JSON "
                        "messages (as `kvchat export`)"),
        Binding("f4", "import", "Import", show=False, tooltip="Import a state file as a new chat (as `kvchat import`)"),
        Binding("f9", "settings", "Settings",
                tooltip="Settings: model file, sampling, reply length, the chat's system prompt, KV policy, "
                        "compaction"),
        Binding("ctrl+f", "filter", "Filter", show=False,
                tooltip="Filter the chats by title (ctrl+g searches their messages)"),
        Binding("ctrl+g", "search", "Search", show=False,
                tooltip="Search the messages and replies of every chat; Enter opens the chat at the hit"),
        Binding("f1", "help", "Help", tooltip="Show every key"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.open_sid: str | None = None
        self.open_info: dict | None = None
        self.opening: Opening | None = None
        self.generation: Generation | None = None
        self.last_replies: dict[str, LastReply] = {}
        self.new_chat_system_prompt: str | None = None
        self.shown: Shown | None = None  # the stored rounds the chat view shows (chat_live.py)
        self.told_restores: dict[str, RestoreStats] = {}  # per chat, the last restore whose notes were said
        self._chats_asked = itertools.count(1)  # sequence numbers: an older list never overwrites a newer one
        self._chats_shown = 0

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield ChatView(id="chat-view")
                with Horizontal(id="restore-progress"):
                    yield Label("restoring the chat's KV cache", id="restore-label")
                    yield ProgressBar(id="restore-bar", show_eta=False)
                yield Composer(id="composer")
        yield StatusBar(id="status-bar")
        yield Footer(show_command_palette=False)  # ctrl+p still opens it; its label would not fit

    # ---- handy parts ----

    @property
    def backend(self):
        return self.app.backend

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one(Sidebar)

    @property
    def chat_view(self) -> ChatView:
        return self.query_one(ChatView)

    @property
    def composer(self) -> Composer:
        return self.query_one(Composer)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one(StatusBar)

    def _later(self, fn: Callable[..., Any], *args, **kwargs) -> None:
        """From a worker thread: run fn(*args, **kwargs) on the UI thread, without waiting for it."""
        self.post_message(Later(fn, args, kwargs))

    async def on_later(self, message: Later) -> None:
        try:
            result = message.fn(*message.args, **message.kwargs)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001 - a failed update must not take the app down
            self._error(describe(exc))

    def _error(self, text: str, title: str = "Error") -> None:
        self.notify(text, title=title, severity="error", timeout=8)

    def notify(self, message: str, *, title: str = "", severity: str = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification of the screen as plain text with its control characters escaped: they carry chat
        titles, file names, error messages and other processes' commands, in which "[b]" or an ESC is text."""
        super().notify(terminal_text(message), title=terminal_line(title), severity=severity, timeout=timeout,
                       markup=markup)

    def _report(self, exc: BaseException, doing: str) -> None:
        """From a worker: the failure as an error notification."""
        self._later(self._error, describe(exc), doing)

    def _calibrating(self, activity: str) -> Callable[[int, int], None]:
        """For a worker: the first use of the round policy or of layer merging on a model calibrates it, which
        holds the model for seconds to minutes; say so once, count the steps in the status bar, then show
        `activity` again."""
        told = threading.Event()

        def progress(done: int, total: int) -> None:
            if not told.is_set():
                told.set()
                # shown for as long as a calibration usually takes (the status bar counts its chats meanwhile)
                self._later(partial(self.notify, "Calibrating the model for the round KV policy or for merging "
                                    "(once per model)…", timeout=120))
            self._later(self.status_bar.set_activity,
                        f"calibrating the model: {done}/{total}…" if done < total else activity)

        return progress

    def _model_for_new_chats(self) -> Path:
        prefs = self.app.preferences
        return Path(prefs.model_path) if prefs.model_path else default_model()

    # ---- start ----

    def on_mount(self) -> None:
        self.status_bar.measured = self.app.show_measurements
        self.composer.cursor_blink = self.app.cursor_blink
        self.query_one("#chat-filter", Input).cursor_blink = self.app.cursor_blink
        self.query_one("#restore-progress").display = False
        # The first chat of a model on this machine measures its speeds for planning restores (seconds): say so.
        self.backend.notice = lambda text: self._later(partial(self.notify, text[:1].upper() + text[1:],
                                                               timeout=15))
        self.composer.focus()
        self._follow_store()
        self._start()
        self._start_steps()  # progress of the steps that take seconds; the quick profile refined when idle
        self.set_interval(30, self._redraw_ages)

    @work(thread=True, exit_on_error=False, group="start")
    def _start(self) -> None:
        path = ""
        try:
            if self._store_version is None:  # taken once, before the list is read (a later start only reloads)
                self._take_store_version()
            self._load_chats()
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot open the chat store")
            self._later(self.status_bar.set_model_failed, path)
            return
        try:  # the model of new chats, loaded now so that the first message is answered at once
            path = str(self._model_for_new_chats())
            engine = self.backend.engine(path)
            device = f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}"
            self._later(self._model_ready, path, device)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot load the model")
            self._later(self.status_bar.set_model_failed, path)

    async def _model_ready(self, path: str, device: str) -> None:
        await self.chat_view.set_demo(is_demo_model(path))
        if self.open_sid is None:
            self.status_bar.set_model(path, device)

    # ---- the chat list ----

    def _refresh_chats(self) -> None:
        self._chats_worker()

    @work(thread=True, exit_on_error=False, group="chats")
    def _chats_worker(self) -> None:
        try:
            self._load_chats()
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot list the chats")

    def _load_chats(self) -> None:
        seq = next(self._chats_asked)
        self._later(self._show_chats, seq, self.backend.chat_list())

    def _show_chats(self, seq: int, chats) -> None:
        if seq < self._chats_shown:
            return
        self._chats_shown = seq
        keep = self.sidebar.highlighted_sid if self.sidebar.chat_list.has_focus else self.open_sid
        self.sidebar.show(chats, self.app.clock(), self.app.show_measurements, keep)

    def _redraw_ages(self) -> None:
        if self.sidebar.chats:
            self.sidebar.show(self.sidebar.chats, self.app.clock(), self.app.show_measurements, None)

    def _target(self) -> str | None:
        """The chat an action applies to: the one highlighted in the list, else the open one."""
        sid = self.sidebar.highlighted_sid or self.open_sid
        if sid is None:
            self.notify("No chat is selected.", severity="warning")
        return sid

    # ---- copy, filter, help ----

    def action_copy(self) -> None:
        message = self.chat_view.message_to_copy()
        if message is None or not message.text:
            self.notify("There is no message to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(message.text)
        self.notify(f"Copied the {'reply' if message.role == 'assistant' else 'message'} "
                    f"({len(message.text)} characters).")

    def action_filter(self) -> None:
        self.query_one("#chat-filter", Input).focus()

    def action_search(self) -> None:
        from kvchat.app.tui.dialogs.search import SearchDialog, open_hit

        # The title filter's words, if any, are searched for at once (what a title did not hold, a message may).
        words = self.query_one("#chat-filter", Input).value
        self.app.push_screen(SearchDialog(self.backend.store, words), partial(open_hit, self))

    def action_help(self) -> None:
        from kvchat.app.tui.dialogs.help import HelpScreen

        self.app.push_screen(HelpScreen())
