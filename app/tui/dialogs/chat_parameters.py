"""The open chat's own parameters (f12): temperature, top-p, top-k, seed and reply cap, each empty for the default
(the app's settings, F9), and its system prompt; the same as `kvchat params`."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from kvchat.app.terminal_text import terminal_text
from kvchat.app.tui.dialogs.save_or_cancel import SaveOrCancel
from kvchat.errors import KvchatError

# (field id, storage.db.CHAT_PARAMETERS name, label, type)
FIELDS = (("chat-temperature", "temperature", "temperature", float),
          ("chat-top-p", "top_p", "top-p", float),
          ("chat-top-k", "top_k", "top-k", int),
          ("chat-seed", "seed", "seed", int),
          ("chat-reply-cap", "reply_cap", "reply cap", int))
NO_DEFAULT = {"seed": "random", "reply_cap": "the model's", "temperature": "", "top_p": "", "top_k": ""}
HINT = ("Temperature 0: greedy; top-k 0: off; the reply cap in tokens (a `kvchat send --reply-cap` still wins). The "
        "empty fields show the default they take.")


@dataclass
class ChatParametersChoice:
    parameters: dict  # every parameter: a value, or None for the default
    system_prompt: str | None  # None: unchanged


class ChatParametersDialog(SaveOrCancel, ModalScreen[ChatParametersChoice | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, chat_title: str, parameters: dict, defaults: dict, system_prompt: str | None) -> None:
        """`defaults`: what each parameter is when the chat has none (shown as the empty field's placeholder)."""
        super().__init__(classes="dialog")
        self.chat_title, self.parameters, self.defaults = chat_title, parameters, defaults
        self.shown_prompt = terminal_text(system_prompt or "")

    def compose(self) -> ComposeResult:
        with Vertical(classes="box wide"):
            yield Label(f"Parameters of “{self.chat_title}” (empty: the default from the settings, F9)",
                        classes="title", markup=False)
            with Horizontal(classes="row"):
                for field_id, name, label, _ in FIELDS:
                    value, default = self.parameters.get(name), self.defaults.get(name)
                    shown_default = NO_DEFAULT[name] if default is None else str(default)
                    yield Vertical(Label(label), Input("" if value is None else str(value), id=field_id,
                                                       placeholder=shown_default), classes="field")
            yield Static(HINT, classes="hint")
            yield Label("System prompt (changing it recomputes the chat's KV)")
            yield TextArea(self.shown_prompt, id="chat-system-prompt", soft_wrap=True)
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def action_save(self) -> None:
        try:
            parameters = self._read()
        except KvchatError as exc:
            self.notify(str(exc), title="Parameters not saved", severity="error")
            return
        prompt = self.query_one("#chat-system-prompt", TextArea).text.strip()
        self.dismiss(ChatParametersChoice(parameters, prompt if prompt != self.shown_prompt.strip() else None))

    def _read(self) -> dict:
        from kvchat.app.session.service import check_parameters

        parameters = {}
        for field_id, name, label, kind in FIELDS:
            raw = self.query_one(f"#{field_id}", Input).value.strip()
            try:
                parameters[name] = kind(raw) if raw else None
            except ValueError:
                raise KvchatError(f"{label} must be a {'whole ' if kind is int else ''}number, not {raw!r}") from None
        check_parameters(parameters)
        return parameters

    def action_cancel(self) -> None:
        self.dismiss(None)
