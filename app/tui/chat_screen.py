"""The main screen: chats on the left, the open chat and the message box on the right, the status bar below.

Threads: everything that touches the engine or the store runs in a thread worker; workers hand results back with
`_later` (a message to this screen, so the worker never waits for the UI and the UI never waits for the model).
Every worker catches every exception and turns it into an error notification: the app never crashes on an engine
or storage error.
"""

from __future__ import annotations

from functools import partial

import inspect
import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, ProgressBar

from kvchat.app.session.chat import RestoreCancelled
from kvchat.app.session.service import ChatStats, Transcript, default_model, is_demo_model
from kvchat.engine.reply_guard import STOP_NOTES
from kvchat.app.tui.chat_view import ChatView, ReplyView
from kvchat.app.tui.composer import Composer
from kvchat.app.tui.sidebar import Sidebar
from kvchat.app.tui.status_bar import LastReply, StatusBar
from kvchat.errors import KvchatError


def describe(exc: BaseException) -> str:
    """One sentence for the user: our own errors say what went wrong; anything else is named as unexpected."""
    if isinstance(exc, KvchatError):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc}"

class Later(Message):
    """A function a worker wants run on the UI thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs


@dataclass(eq=False)
class Opening:
    """One opening of a chat: its restore may be cancelled by switching away."""

    sid: str
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    progress: tuple[int, int] = (0, 0)


@dataclass(eq=False)
class Generation:
    """One reply being generated. `sid` is None until the worker has created the chat of a first message."""

    sid: str | None
    view: ReplyView | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False  # the user switched away: the reply is saved but no longer shown


class ChatScreen(Screen):
    PROGRESS_AFTER_S = 0.3  # a restore shows a progress bar once it has taken this long

    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply being generated (the part written is saved)"),
        Binding("ctrl+r", "regenerate", "Regenerate", tooltip="Answer the last message again (replaces the reply)"),
        Binding("ctrl+o", "copy", "Copy", tooltip="Copy the selected message (else the last reply) to the clipboard"),
        Binding("ctrl+n", "new_chat", "New", tooltip="Start a new chat (it is created with its first message)"),
        Binding("f2", "rename", "Rename", tooltip="Rename the highlighted chat"),
        Binding("f5", "fork", "Fork", tooltip="Fork the highlighted chat after a round you choose"),
        Binding("f8", "delete", "Delete", tooltip="Delete the highlighted chat and its KV files (asks first)"),
        Binding("f3", "export", "Export", tooltip="Export the highlighted chat to a state file (as `kvchat export`)"),
        Binding("f4", "import", "Import", tooltip="Import a state file as a new chat (as `kvchat import`)"),
        Binding("f9", "settings", "Settings",
                tooltip="Settings: model file, sampling, reply length, the chat's system prompt, KV policy, "
                        "compaction"),
        Binding("ctrl+f", "filter", "Filter", tooltip="Filter the chats by title"),
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
        yield Footer()

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
        self._start()
        self.set_interval(30, self._redraw_ages)

    @work(thread=True, exit_on_error=False, group="start")
    def _start(self) -> None:
        try:
            self._load_chats()
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot open the chat store")
            return
        try:  # the model of new chats, loaded now so that the first message is answered at once
            path = self._model_for_new_chats()
            engine = self.backend.engine(path)
            device = f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}"
            self._later(self._model_ready, str(path), device)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot load the model")

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

    # ---- opening a chat: the restore starts at once ----

    def on_sidebar_opened(self, event: Sidebar.Opened) -> None:
        self.open_chat(event.sid)

    def open_chat(self, sid: str) -> None:
        if sid == self.open_sid and self.opening is not None and not self.opening.cancel.is_set():
            self.composer.focus()
            return
        self._leave()
        self.open_sid = sid
        self.open_info = None
        opening = self.opening = Opening(sid)
        self.sidebar.highlight(sid)
        self.status_bar.set_chat(None, None)
        self.status_bar.set_activity("restoring…")
        self.set_timer(self.PROGRESS_AFTER_S, lambda: self._show_progress(opening))
        self._open_worker(opening)
        self.composer.focus()

    def _leave(self) -> None:
        """Switching away: cancel the open chat's restore, stop (and save) a reply being generated."""
        if self.opening is not None:
            self.opening.cancel.set()
            self.opening = None
        self._hide_progress()
        gen = self.generation
        if gen is not None and not gen.abandoned:
            gen.abandoned = True
            gen.cancel.set()
            self.notify(f"Stopped the reply in “{self.sidebar.title_of(gen.sid)}”; what it had written is saved.")

    def stop_everything(self) -> None:
        """Before quitting: the same as switching away."""
        self._leave()

    @work(thread=True, exit_on_error=False, group="open")
    def _open_worker(self, opening: Opening) -> None:
        try:
            self._later(self._show_transcript, opening, self.backend.transcript(opening.sid))
            stats = self.backend.restore(opening.sid, progress=lambda done, total: self._later(
                self._restore_progress, opening, done, total), cancel=opening.cancel,
                kv_policy=self.app.preferences.kv_policy, calibrating=self._calibrating("restoring…"))
        except RestoreCancelled:
            self._later(self._restore_ended, opening)  # the user moved on: nothing to say
            return
        except Exception as exc:  # noqa: BLE001
            self._later(self._restore_ended, opening)
            self._report(exc, "Cannot open the chat")
            return
        self._later(self._restored, opening, stats)
        if stats.restore is not None and (stats.restore.tokens_recomputed or stats.restore.kept_rounds):
            try:  # the recomputed rounds are being stored again: show their size once they are on disk
                self.backend.drain()
                self._later(self._restored, opening, self.backend.chat_stats(opening.sid))
            except Exception as exc:  # noqa: BLE001
                self._report(exc, "Cannot save the chat's KV")

    async def _show_transcript(self, opening: Opening, transcript: Transcript) -> None:
        if self.opening is not opening:
            return
        self.open_info = transcript.info
        await self.chat_view.show_rounds(transcript.rounds, transcript.info["system_prompt"],
                                         demo=is_demo_model(transcript.info["model_path"]))
        self.composer.set_history([r.user_text for r in transcript.rounds])
        self.status_bar.set_model(transcript.info["model_path"], self.status_bar.device)

    def _restore_progress(self, opening: Opening, done: int, total: int) -> None:
        opening.progress = (done, total)
        if self.opening is opening and self.query_one("#restore-progress").display:
            self.query_one(ProgressBar).update(total=max(total, 1), progress=done)

    def _show_progress(self, opening: Opening) -> None:
        if self.opening is opening and not opening.done:
            done, total = opening.progress
            self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
            self.query_one("#restore-progress").display = True

    def _hide_progress(self) -> None:
        self.query_one("#restore-progress").display = False

    def _restore_ended(self, opening: Opening) -> None:
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")

    def _restored(self, opening: Opening, stats: ChatStats) -> None:
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")
            self.status_bar.set_chat(stats, self.last_replies.get(opening.sid))
        self._refresh_chats()  # its KV is in memory now

    # ---- sending, streaming, stopping ----

    async def on_composer_submitted(self, event: Composer.Submitted) -> None:
        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.",
                        severity="warning")
            return
        gen = self.generation = Generation(self.open_sid)
        gen.view = await self.chat_view.add_exchange(event.text)
        self.composer.accept(event.text)
        self.status_bar.set_activity("generating…")
        self._send_worker(gen, event.text, False, self._model_for_new_chats_or_none())

    def _model_for_new_chats_or_none(self) -> Path | None:
        if self.open_sid is not None:
            return None
        try:
            return self._model_for_new_chats()
        except KvchatError as exc:
            self._error(str(exc))
            return None

    @work(thread=True, exit_on_error=False, group="generate")
    def _send_worker(self, gen: Generation, text: str, regenerate: bool, model: Path | None) -> None:
        prefs = self.app.preferences
        try:
            if gen.sid is None:
                if model is None:
                    raise KvchatError("there is no model to start a chat with; choose one in the settings (F9)")
                gen.sid = self.backend.create_chat(model, system_prompt=self.new_chat_system_prompt)
                self._later(self._chat_created, gen)
            reply = self.backend.send(gen.sid, text, max_tokens=prefs.max_tokens, sampling=prefs.sampling,
                                      on_token=lambda _tok, piece: self._later(self._streamed, gen, piece),
                                      cancel=gen.cancel, regenerate=regenerate, kv_policy=prefs.kv_policy,
                                      calibrating=self._calibrating("generating…"), guard=prefs.guard)
        except Exception as exc:  # noqa: BLE001
            self._later(self._reply_failed, gen, text, describe(exc))
            return
        self._later(self._reply_done, gen, reply)
        try:  # the round's K/V goes to disk in the background; then the status bar shows its size
            problems = self.backend.drain()
            self._later(self._kv_saved, gen.sid, self.backend.chat_stats(gen.sid), problems)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot save the chat's KV")

    def _chat_created(self, gen: Generation) -> None:
        self.new_chat_system_prompt = None
        if not gen.abandoned and self.open_sid is None:
            self.open_sid = gen.sid
        self._refresh_chats()

    async def _streamed(self, gen: Generation, piece: str) -> None:
        if not gen.abandoned and gen.view is not None and gen.view.is_attached:
            await gen.view.append(piece)

    async def _reply_done(self, gen: Generation, reply) -> None:
        if self.generation is gen:
            self.generation = None
        result = reply.result
        self.last_replies[gen.sid] = LastReply(result.decode_tokens_per_second, 1000 * result.first_token_seconds)
        if gen.sid == self.open_sid:
            self.status_bar.set_activity("saving KV…")
            if gen.view is not None and gen.view.is_attached:
                note = STOP_NOTES.get(result.stop_reason, "")
                await gen.view.finish(reply.round.assistant_text, note)
            else:  # the view was replaced meanwhile (switched away and back): show the stored rounds
                self._reload_transcript(gen.sid)
        self._refresh_chats()

    def _kv_saved(self, sid: str, stats: ChatStats, problems: list[str]) -> None:
        for problem in problems:
            self.notify(f"KV not saved ({problem}); it will be recomputed when the chat is opened",
                        severity="warning")
        if sid == self.open_sid and self.generation is None:
            self.status_bar.set_activity("")
            self.status_bar.set_chat(stats, self.last_replies.get(sid))
        self._refresh_chats()

    async def _reply_failed(self, gen: Generation, text: str, why: str) -> None:
        if self.generation is gen:
            self.generation = None
        self._error(why, "No reply")
        if gen.sid is not None and gen.sid == self.open_sid:
            self.status_bar.set_activity("")
            self._reload_transcript(gen.sid)  # show what the store holds, nothing more
        elif gen.sid is None and self.open_sid is None:
            await self.chat_view.show_welcome()
        if not gen.abandoned and text and not self.composer.text.strip():
            self.composer.load_text(text)  # the message is not lost

    @work(thread=True, exit_on_error=False, group="open")
    def _reload_transcript(self, sid: str) -> None:
        try:
            transcript = self.backend.transcript(sid)
            stats = self.backend.chat_stats(sid)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot read the chat")
            return
        self._later(self._reloaded, sid, transcript, stats)

    async def _reloaded(self, sid: str, transcript: Transcript, stats: ChatStats) -> None:
        if sid != self.open_sid or self.generation is not None:
            return
        self.open_info = transcript.info
        await self.chat_view.show_rounds(transcript.rounds, transcript.info["system_prompt"],
                                         demo=is_demo_model(transcript.info["model_path"]))
        self.composer.set_history([r.user_text for r in transcript.rounds])
        self.status_bar.set_chat(stats, self.last_replies.get(sid))

    def action_stop(self) -> None:
        gen = self.generation
        if gen is not None and not gen.cancel.is_set():
            gen.cancel.set()
            self.status_bar.set_activity("stopping…")

    async def action_regenerate(self) -> None:
        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.",
                        severity="warning")
            return
        if self.open_sid is None:
            self.notify("No chat is open.", severity="warning")
            return
        gen = self.generation = Generation(self.open_sid)
        await self.chat_view.drop_last_reply()
        gen.view = await self.chat_view.add_reply()
        self.status_bar.set_activity("generating…")
        self._send_worker(gen, "", True, None)

    def action_copy(self) -> None:
        message = self.chat_view.message_to_copy()
        if message is None or not message.text:
            self.notify("There is no message to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(message.text)
        self.notify(f"Copied the {'reply' if message.role == 'assistant' else 'message'} "
                    f"({len(message.text)} characters).")

    # ---- chats: new, rename, delete, fork, export, import ----

    async def action_new_chat(self) -> None:
        self._leave()
        self.open_sid = self.open_info = None
        self.sidebar.chat_list.highlighted = None
        await self.chat_view.show_welcome()
        self.composer.set_history([])
        self.status_bar.set_chat(None, None)
        self.status_bar.set_activity("")
        self.composer.focus()

    def action_filter(self) -> None:
        self.query_one("#chat-filter", Input).focus()

    def action_rename(self) -> None:
        from kvchat.app.tui.dialogs.text_prompt import TextPrompt

        sid = self._target()
        if sid is None:
            return
        title = self.sidebar.title_of(sid)

        def renamed(new_title: str | None) -> None:
            if new_title and new_title != title:
                self._store_worker(lambda: self.backend.rename(sid, new_title), "Cannot rename the chat",
                                   f"Renamed to “{new_title}”.")

        self.app.push_screen(TextPrompt("Rename chat", "" if title == "(untitled)" else title), renamed)

    def action_delete(self) -> None:
        from kvchat.app.tui.dialogs.confirm import ConfirmDialog

        sid = self._target()
        if sid is None:
            return
        title = self.sidebar.title_of(sid)

        async def answered(yes: bool | None) -> None:
            if not yes:
                return
            gen = self.generation
            if gen is not None and gen.sid == sid and not gen.abandoned:
                gen.abandoned = True
                gen.cancel.set()
            if sid == self.open_sid:
                await self.action_new_chat()
            self._store_worker(lambda: self.backend.delete(sid), "Cannot delete the chat", f"Deleted “{title}”.")

        self.app.push_screen(ConfirmDialog(f"Delete “{title}” and the KV files only it uses?"), answered)

    @work(thread=True, exit_on_error=False, group="store")
    def _store_worker(self, change: Callable[[], Any], failure: str, success: str,
                      then: Callable[[Any], Any] | None = None) -> None:
        """A change to the store; on success a notification, the list redrawn, and `then(result)` on the UI."""
        try:
            result = change()
        except Exception as exc:  # noqa: BLE001
            self._report(exc, failure)
            return
        self._later(self.notify, success)
        if then is not None:
            self._later(then, result)
        self._refresh_chats()

    def action_fork(self) -> None:
        sid = self._target()
        if sid is not None:
            self._fork_worker(sid)

    @work(thread=True, exit_on_error=False, group="store")
    def _fork_worker(self, sid: str) -> None:
        try:
            transcript = self.backend.transcript(sid)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot fork the chat")
            return
        self._later(self._ask_fork, sid, transcript)

    def _ask_fork(self, sid: str, transcript: Transcript) -> None:
        from kvchat.app.tui.dialogs.fork import ForkChoice, ForkDialog

        if not transcript.rounds:
            self.notify("The chat has no rounds to fork.", severity="warning")
            return

        def chosen(choice: ForkChoice | None) -> None:
            if choice is not None:
                self._store_worker(lambda: self.backend.fork(sid, choice.rounds, choice.title),
                                   "Cannot fork the chat", f"Forked after round {choice.rounds}: “{choice.title}”.",
                                   then=self.open_chat)

        self.app.push_screen(ForkDialog(transcript.info["title"] or "(untitled)", transcript.rounds), chosen)

    def action_export(self) -> None:
        from kvchat.app.tui.dialogs.export_dialog import ExportChoice, ExportDialog

        sid = self._target()
        if sid is None:
            return
        title = self.sidebar.title_of(sid)
        stem = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:40] or sid

        def chosen(choice: ExportChoice | None) -> None:
            if choice is not None:
                self._store_worker(lambda: self.backend.export(sid, Path(choice.path), choice.text_only),
                                   "Cannot export the chat", f"Exported “{title}” to {choice.path}.")

        self.app.push_screen(ExportDialog(title, str(Path.cwd() / f"{stem}.kvstate")), chosen)

    def action_import(self) -> None:
        from kvchat.app.tui.dialogs.text_prompt import TextPrompt

        def chosen(path: str | None) -> None:
            if path is not None:
                self._import_worker(path)

        self.app.push_screen(TextPrompt("Import a state file as a new chat", placeholder="path/to/chat.kvstate"),
                             chosen)

    @work(thread=True, exit_on_error=False, group="store")
    def _import_worker(self, path: str) -> None:
        try:
            result = self.backend.import_file(Path(path), self._model_for_new_chats())
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Import failed; nothing was changed")
            return
        for notice in result.notices:
            self._later(self.notify, notice, severity="warning")
        self._later(self.notify, f"Imported {result.rounds} rounds from {Path(path).name}.")
        self._later(self.open_chat, result.session_id)
        self._refresh_chats()

    # ---- settings and help ----

    def action_settings(self) -> None:
        from kvchat.app.tui.dialogs.settings import SettingsChoice, SettingsDialog

        sid = self.open_sid
        prompt = (self.open_info or {}).get("system_prompt") if sid else self.new_chat_system_prompt
        title = self.sidebar.title_of(sid) if sid else None
        if sid is not None and self.open_info is None:
            self.notify("The chat is still opening; try again in a moment.", severity="warning")
            return

        def chosen(choice: SettingsChoice | None) -> None:
            if choice is not None:
                self._settings_worker(choice, sid)

        self.app.push_screen(SettingsDialog(self.app.preferences, prompt, title), chosen)

    @work(thread=True, exit_on_error=False, group="store")
    def _settings_worker(self, choice, sid: str | None) -> None:
        from kvchat.engine.engine import ModelInfo

        prefs = choice.preferences
        try:
            if prefs.model_path:
                path = Path(prefs.model_path).expanduser().resolve()
                if not path.is_file():
                    raise KvchatError(f"the model file {path} does not exist")
                ModelInfo.read(path)  # a bad file is refused now, not at the next new chat
                prefs.model_path = str(path)
            prefs.save(self.app.home)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Settings not saved")
            return
        # A new system prompt reopens the open chat anyway: the new policy then needs no reopening of its own.
        self._later(self._preferences_saved, prefs, reopen=choice.system_prompt is None or sid is None)
        if choice.system_prompt is None:
            return
        if sid is None:
            self._later(setattr, self, "new_chat_system_prompt", choice.system_prompt or None)
            return
        try:
            self.backend.set_system_prompt(sid, choice.system_prompt)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "System prompt not changed")
            return
        self._later(self._system_prompt_changed, sid)

    def _preferences_saved(self, prefs, reopen: bool = True) -> None:
        policy_changed = prefs.kv_policy != self.app.preferences.kv_policy
        self.app.preferences = prefs
        self.backend.compact_kv = prefs.compact_kv
        self.notify("Settings saved.")
        if self.open_sid is None:
            self._start()  # load the model of new chats and show it
        if policy_changed:
            self._kv_policy_changed(prefs.kv_policy, reopen)

    def _kv_policy_changed(self, name: str, reopen: bool) -> None:
        """Chats opened from now on run under the new policy. The open chat is reopened under it at once, unless a
        reply is being written: stopping that reply for a setting would lose more than it gains."""
        sid = self.open_sid
        if sid is None:
            self.notify(f"KV policy: {name}, for the chats opened from now on.")
        elif self.generation is not None:
            self.notify(f"KV policy: {name}, for the chats opened from now on; “{self.sidebar.title_of(sid)}” "
                        f"switches to it at its next message.")
        else:
            self.notify(f"KV policy: {name}; reopening “{self.sidebar.title_of(sid)}” under it.")
            if reopen:
                self.opening = None  # open_chat would otherwise keep the restore it already has
                self.open_chat(sid)

    def _system_prompt_changed(self, sid: str) -> None:
        self.notify("System prompt changed; the chat's KV is recomputed.")
        if sid == self.open_sid:
            self.opening = None  # reopen: its stored K/V no longer applies
            self.open_chat(sid)

    def action_help(self) -> None:
        from kvchat.app.tui.dialogs.help import HelpScreen

        self.app.push_screen(HelpScreen())
