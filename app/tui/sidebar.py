"""The list of chats: title, last activity, size on disk and where its KV cache is; a filter box above it."""

from __future__ import annotations

from datetime import datetime

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, OptionList
from textual.widgets.option_list import Option

from kvchat.app.session.service import ChatSummary
from kvchat.app.terminal_text import terminal_line
from kvchat.app.tui.formatting import UNMEASURED, ago, size


class ChatList(OptionList):
    """Up/Down move the highlight; Enter or a click opens the chat."""

    def on_focus(self) -> None:
        if self.highlighted is None and self.option_count:
            self.highlighted = 0  # so that Enter right away opens the most recent chat


class Sidebar(Vertical):
    class Opened(Message):
        def __init__(self, sid: str) -> None:
            super().__init__()
            self.sid = sid

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.chats: list[ChatSummary] = []

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter chats", id="chat-filter")
        yield ChatList(id="chat-list")

    @property
    def chat_list(self) -> ChatList:
        return self.query_one(ChatList)

    def show(self, chats: list[ChatSummary], now: datetime, measured: bool, current: str | None) -> None:
        """Redraw the list, keeping the highlight on `current` (or on the chat highlighted before)."""
        self.chats, self._now, self._measured = chats, now, measured
        self._redraw(current or self.highlighted_sid)

    def _redraw(self, keep: str | None) -> None:
        needle = self.query_one("#chat-filter", Input).value.strip().lower()
        shown = [c for c in self.chats if needle in (c.title or "untitled").lower()]
        options = self.chat_list
        options.clear_options()
        options.add_options([Option(self._label(c), id=c.id) for c in shown])
        ids = [c.id for c in shown]
        if keep in ids:
            options.highlighted = ids.index(keep)

    def _label(self, c: ChatSummary) -> Text:
        # Wrapped at word boundaries, never cut: a long title (an untitled chat's first message) takes two lines.
        text = Text(terminal_line(c.title or "") or "(untitled)", style="bold", overflow="fold")
        bytes_on_disk = size(c.kv_bytes) if self._measured else UNMEASURED
        text.append(f"\n{ago(c.updated, self._now)} · {bytes_on_disk} · {c.kv_status}", style="dim")
        return text

    def on_input_changed(self, event: Input.Changed) -> None:
        if self.chats:
            self._redraw(self.highlighted_sid)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.chat_list.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.post_message(self.Opened(event.option.id))

    @property
    def highlighted_sid(self) -> str | None:
        options = self.chat_list
        if options.highlighted is None or not options.option_count:
            return None
        return options.get_option_at_index(options.highlighted).id

    def highlight(self, sid: str | None) -> None:
        options = self.chat_list
        for i in range(options.option_count):
            if options.get_option_at_index(i).id == sid:
                options.highlighted = i
                return

    def title_of(self, sid: str | None) -> str:
        return terminal_line(next((c.title for c in self.chats if c.id == sid), "") or "") or "(untitled)"
