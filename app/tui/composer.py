"""The message box: multi-line; Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it) starts a new
line; Up on the first line and Down on the last walk through the messages sent in this chat."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from kvchat.app.terminal_text import terminal_text


class Composer(TextArea):
    # Priority: TextArea would otherwise take Enter as a newline before any ordinary binding sees it.
    BINDINGS = [
        Binding("enter", "submit", "Send", priority=True, tooltip="Send the message"),
        Binding("ctrl+j,shift+enter", "newline", "New line", priority=True, key_display="ctrl+j",
                tooltip="Insert a new line in the message (shift+enter too, where the terminal reports it)"),
        Binding("up", "cursor_up", "History", show=False,
                tooltip="On the message's first line: the previous message sent in this chat"),
        Binding("down", "cursor_down", "History", show=False,
                tooltip="On the message's last line: the next message sent in this chat"),
    ]

    class Submitted(Message):
        def __init__(self, composer: "Composer", text: str) -> None:
            super().__init__()
            self.composer, self.text = composer, text

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.sent: list[str] = []
        self._recalled: int | None = None  # index into history while walking it
        self._draft = ""  # what was typed before walking the history

    def load_text(self, text: str) -> None:
        """A message put back in the box (recalled from the chat, or given back after a failed send) may be stored
        text, an imported chat's: its control characters are shown escaped, and sent as shown, never written raw to
        the terminal."""
        super().load_text(terminal_text(text))

    def set_history(self, messages: list[str]) -> None:
        self.sent = list(messages)
        self._recalled = None

    def action_submit(self) -> None:
        text = self.text
        if not text.strip():
            self.app.notify("The message is empty: type something to send.", severity="warning", timeout=4)
            return
        self.post_message(self.Submitted(self, text))

    def accept(self, text: str) -> None:
        """The message was sent: clear the box and remember it."""
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._recalled = None
        self.load_text("")

    def action_newline(self) -> None:
        self.insert("\n")

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self.sent:
            if self._recalled is None:
                self._draft, self._recalled = self.text, len(self.sent) - 1
            elif self._recalled > 0:
                self._recalled -= 1
            self._show(self.sent[self._recalled])
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self._recalled is not None and self.cursor_location[0] == self.document.line_count - 1:
            if self._recalled < len(self.sent) - 1:
                self._recalled += 1
                self._show(self.sent[self._recalled])
            else:
                self._recalled = None
                self._show(self._draft)
            return
        super().action_cursor_down(select)

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
