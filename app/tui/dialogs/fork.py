"""Fork a chat at a chosen round: the new chat keeps the rounds up to it (their K/V files are shared)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from kvchat.app.terminal_text import terminal_line
from kvchat.storage.db import RoundRow


@dataclass
class ForkChoice:
    rounds: int  # how many rounds the new chat keeps
    title: str


class ForkDialog(ModalScreen[ForkChoice | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, rounds: list[RoundRow]) -> None:
        super().__init__(classes="dialog")
        self.chat_title, self.rounds = terminal_line(title), rounds  # the title as the list shows it

    def compose(self) -> ComposeResult:
        with Vertical(classes="box"):
            yield Label(f"Fork “{self.chat_title}” after which round?", classes="title", markup=False)
            yield OptionList(*[Option(Text(f"{r.idx + 1}. {terminal_line(' '.join(r.user_text.split()))[:70]}"),
                                      id=str(r.idx + 1)) for r in self.rounds], id="fork-rounds")
            yield Label("Title of the new chat", classes="hint")
            yield Input(f"{self.chat_title} (fork)", id="fork-title")
            yield Label("Enter on a round: fork there · Escape: cancel", classes="hint")

    def on_mount(self) -> None:
        rounds = self.query_one(OptionList)
        rounds.highlighted = len(self.rounds) - 1
        rounds.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self._fork(int(event.option.id))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        rounds = self.query_one(OptionList)
        if rounds.highlighted is not None:
            self._fork(rounds.highlighted + 1)

    def _fork(self, rounds: int) -> None:
        title = self.query_one("#fork-title", Input).value.strip() or f"{self.chat_title} (fork)"
        self.dismiss(ForkChoice(rounds, title))

    def action_cancel(self) -> None:
        self.dismiss(None)
