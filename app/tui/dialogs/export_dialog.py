"""Export a chat to a state file, or as a transcript (Markdown, plain text, JSON messages): what `kvchat export
--format` writes."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Checkbox, Input, Label, Select

from kvchat.app.session.transcripts import SUFFIXES
from kvchat.app.tui.wrapping_checkbox import WrappingCheckbox

FORMAT_CHOICES = {"state": "state file (the chat whole, to import again)", "md": "Markdown transcript",
                  "txt": "plain text transcript", "json": "JSON: the role/content message list"}


@dataclass
class ExportChoice:
    path: str
    text_only: bool
    fmt: str = "state"  # app.session.transcripts.EXPORT_FORMATS


class ExportDialog(ModalScreen[ExportChoice | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, path: str) -> None:
        super().__init__(classes="dialog")
        self.chat_title, self.path = title, path

    def compose(self) -> ComposeResult:
        with Vertical(classes="box"):
            yield Label(f"Export “{self.chat_title}” to a state file or a transcript", classes="title", markup=False)
            yield Input(self.path, id="export-path")  # first: focused, Enter exports
            yield Select([(label, fmt) for fmt, label in FORMAT_CHOICES.items()], value="state", allow_blank=False,
                         id="export-format")
            yield WrappingCheckbox("text only (leave the KV cache out; it is recomputed on import)", id="text-only")
            yield Label("Enter: export · Escape: cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            fmt = self.query_one("#export-format", Select).value
            self.dismiss(ExportChoice(event.value.strip(), fmt == "state" and self.query_one(Checkbox).value, fmt))

    def on_select_changed(self, event: Select.Changed) -> None:
        """The file's suffix follows the format (a path the user typed keeps its name); text only is for state
        files alone."""
        path = self.query_one("#export-path", Input)
        stem, dot, suffix = path.value.rpartition(".")
        if dot and "." + suffix in SUFFIXES.values() and "/" not in suffix:
            path.value = stem + SUFFIXES[event.value]
        self.query_one(Checkbox).disabled = event.value != "state"

    def action_cancel(self) -> None:
        self.dismiss(None)
