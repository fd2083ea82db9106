"""The actions on chats, as a part of the main screen: new, rename, delete, fork, export, import, and the settings.
Each asks in a dialog (app/tui/dialogs/), then changes the store in a thread worker and reports the result."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from textual import work

from kvchat.app.session.service import Transcript
from kvchat.errors import KvchatError


class ChatActions:
    """The chat-management actions of `ChatScreen` (a mixin: it uses the screen's parts, state, `_later`,
    `_report`, `_leave` and `open_chat`)."""

    async def action_new_chat(self) -> None:
        self._leave()
        self.open_sid = self.open_info = self.shown = None
        self.sidebar.chat_list.highlighted = None
        await self.chat_view.show_welcome()
        self.composer.set_history([])
        self.status_bar.set_chat(None, None)
        self.status_bar.set_activity("")
        self.composer.focus()

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
                self._store_worker(lambda: self.backend.export(sid, Path(choice.path), choice.text_only, choice.fmt),
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

    def action_chat_parameters(self) -> None:
        """f12: the open chat's own parameters and system prompt (dialogs/chat_parameters.py)."""
        sid = self.open_sid
        if sid is None or self.open_info is None:
            self.notify("No chat is open." if sid is None else "The chat is still opening; try again in a moment.",
                        severity="warning")
            return
        self._chat_parameters_worker(sid)

    @work(thread=True, exit_on_error=False, group="store")
    def _chat_parameters_worker(self, sid: str) -> None:
        try:
            parameters, info = self.backend.parameters(sid), self.backend.chat_info(sid)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot read the chat's parameters")
            return
        self._later(self._ask_chat_parameters, sid, parameters, info)

    def _ask_chat_parameters(self, sid: str, parameters: dict, info: dict) -> None:
        from kvchat.app.tui.dialogs.chat_parameters import ChatParametersChoice, ChatParametersDialog

        prefs = self.app.preferences
        defaults = {"temperature": prefs.temperature, "top_p": prefs.top_p, "top_k": prefs.top_k, "seed": prefs.seed,
                    "reply_cap": None}

        def chosen(choice: ChatParametersChoice | None) -> None:
            if choice is None:
                return

            def change() -> None:
                self.backend.set_parameters(sid, choice.parameters)
                if choice.system_prompt is not None:
                    self.backend.set_system_prompt(sid, choice.system_prompt)

            then = (lambda _: self._system_prompt_changed(sid)) if choice.system_prompt is not None else None
            self._store_worker(change, "Parameters not saved", "The chat's parameters are saved.", then=then)

        self.app.push_screen(ChatParametersDialog(info["title"] or "(untitled)", parameters, defaults,
                                                  info["system_prompt"]), chosen)

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
        self.backend.kv_budget = prefs.kv_budget  # xkv: from the next message on
        self.app.apply_gpu_memory(prefs)  # planned from the next message (or chat opened) on
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
