"""Export a chat to a state file, the same file `kvchat export` writes."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Checkbox, Input, Label


@dataclass
class ExportChoice:
    path: str
    text_only: bool


class ExportDialog(ModalScreen[ExportChoice | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, path: str) -> None:
        super().__init__(classes="dialog")
        self.chat_title, self.path = title, path

    def compose(self) -> ComposeResult:
        with Vertical(classes="box"):
            yield Label(f"Export “{self.chat_title}” to a state file", classes="title", markup=False)
            yield Input(self.path, id="export-path")
            yield Checkbox("text only (leave the KV cache out; it is recomputed on import)", id="text-only")
            yield Label("Enter: export · Escape: cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(ExportChoice(event.value.strip(), self.query_one(Checkbox).value))

    def action_cancel(self) -> None:
        self.dismiss(None)
