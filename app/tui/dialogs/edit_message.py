"""Editing a past message (ctrl+t): its text in a multi-line box with the composer's keys (Enter sends the edited
message, Ctrl+J or Shift+Enter starts a new line), Escape cancels."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label

from kvchat.app.tui.composer import Composer


class EditMessageDialog(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, text: str) -> None:
        super().__init__(classes="dialog")
        self.title_text, self.text = title, text

    def compose(self) -> ComposeResult:
        with Vertical(classes="box wide"):
            yield Label(self.title_text, classes="title", markup=False)
            box = Composer(id="edited")
            box.styles.height = "auto"
            box.styles.max_height = 12
            yield box
            yield Label("Enter: send the edited message · ctrl+j: new line · Escape: cancel", classes="hint")

    def on_mount(self) -> None:
        box = self.query_one("#edited", Composer)
        box.load_text(self.text)
        box.cursor_blink = self.app.cursor_blink
        box.move_cursor(box.document.end)
        box.focus()

    def on_composer_submitted(self, event: Composer.Submitted) -> None:
        event.stop()
        self.dismiss(event.text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
