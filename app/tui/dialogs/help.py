"""Every key of the app, in one table built from the bindings themselves (the README's table is the same)."""

from __future__ import annotations

from rich import box
from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

# What is not a binding of its own, but a user needs to know.
BEHAVIOUR = [
    ("enter (in the chat list)", "Open the chat: its KV cache is restored at once, with progress when it is slow"),
    ("enter (in the search)", "Open the chat at the highlighted hit, its message selected (down: to the hits)"),
    ("click a message", "Select it for copying"),
    ("tab / shift+tab", "Move between the filter box, the chat list, the transcript and the message box (shift+tab "
                        "from the message box: the transcript; twice: the chat list)"),
    ("escape (in a dialog)", "Close it without changing anything"),
]
NOTE = ("Switching to another chat while a reply is being generated stops that reply; the part already written is "
        "saved as the round, exactly as Escape does; so does ctrl+c while a reply is being generated (otherwise it "
        "copies the selected text). Actions on a chat (rename, fork, delete, export) apply to the "
        "chat highlighted in the list.")


def key_rows() -> list[tuple[str, str]]:
    """(keys, what they do) for every key the app answers to."""
    from kvchat.app.tui.app import KvchatApp
    from kvchat.app.tui.chat_screen import ChatScreen
    from kvchat.app.tui.chat_view import ChatView
    from kvchat.app.tui.composer import Composer

    rows = []
    for binding, where in [*((b, "") for b in [*Composer.BINDINGS, *ChatScreen.BINDINGS, *KvchatApp.BINDINGS]),
                           *((b, " (in the transcript)") for b in ChatView.BINDINGS)]:
        assert isinstance(binding, Binding)
        if binding.system:  # a second key for an action listed already (ctrl+c as Escape): told in NOTE
            continue
        keys = binding.key_display or binding.key.replace(",", " / ")
        rows.append((keys + where, binding.tooltip or binding.description))
    return rows + BEHAVIOUR


def key_table() -> str:
    """The keys as a Markdown table."""
    lines = ["| key | what it does |", "| --- | --- |"]
    lines += [f"| {keys} | {what} |" for keys, what in key_rows()]
    return "\n".join(lines)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self) -> None:
        super().__init__(classes="dialog")

    def compose(self) -> ComposeResult:
        table = Table(box=box.SIMPLE_HEAD, expand=True, show_edge=False, pad_edge=False)
        table.add_column("key", no_wrap=True, style="bold")
        table.add_column("what it does", ratio=1)
        for keys, what in key_rows():
            table.add_row(keys, what)
        with Vertical(classes="box wide tall"):
            yield Label("kvchat keys", classes="title")
            with VerticalScroll(id="help-keys"):
                yield Static(table)
                yield Static(NOTE, classes="hint", markup=False)
            yield Label("Escape: close", classes="hint")

    def action_close(self) -> None:
        self.dismiss(None)
