"""Search every chat's messages and replies (the store's full-text index, as `kvchat search`): hits are listed as
they are typed for, and choosing one opens its chat with the matching message selected and scrolled into view.
(The box above the chat list, ctrl+f, filters the chats by title.)"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from kvchat.app.terminal_text import terminal_line
from kvchat.app.tui.worker_messages import describe
from kvchat.storage.search import SearchError, SearchHit

if TYPE_CHECKING:
    from kvchat.app.tui.chat_screen import ChatScreen
    from kvchat.storage.db import Store

LIMIT = 50  # hits listed at most: the best ones come first
SNIPPET_TOKENS = 16


def hit_label(hit: SearchHit) -> Text:
    """Two lines: the chat, round and side; the snippet with its matches in reverse video. Stored text is shown
    with its control characters escaped, and never read as markup."""
    label = Text(terminal_line(hit.title) or "(untitled)", style="bold", overflow="ellipsis", no_wrap=True)
    label.append(f" · round {hit.round_idx + 1} · {hit.side}", style="dim")
    label.append("\n")
    for text, matched in hit.pieces:
        label.append(terminal_line(text), style="bold reverse" if matched else "")
    return label


class SearchDialog(ModalScreen[SearchHit | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("down", "to_hits", "Hits", show=False)]

    def __init__(self, store: Store, query: str = "") -> None:
        super().__init__(classes="dialog")
        self.store, self.query_text = store, query
        self.hits: list[SearchHit] = []
        self.hits_for: str | None = None  # the query the listed hits answer
        self._asked = itertools.count(1)  # sequence numbers: an older answer never replaces a newer one
        self._latest = 0
        self._open_when_answered = False  # Enter came before the hits: open the first once they are in

    def compose(self) -> ComposeResult:
        with Vertical(classes="box wide tall"):
            yield Label("Search the messages and replies of every chat", classes="title")
            yield Input(self.query_text, placeholder="words to find (each begins a word: “lowf” finds Lowford)",
                        id="search-query")
            yield OptionList(id="search-hits")
            yield Label("", id="search-status", classes="hint", markup=False)
            yield Label("Enter: open the chat at the hit · Down: the hits · Escape: close", classes="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()
        if self.query_text.strip():
            self._ask(self.query_text)

    @property
    def hit_list(self) -> OptionList:
        return self.query_one("#search-hits", OptionList)

    def _say(self, text: str) -> None:
        self.query_one("#search-status", Label).update(text)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._open_when_answered = False
        self._ask(event.value)

    def _ask(self, query: str) -> None:
        if not query.strip():
            self._latest = next(self._asked)
            self._show(self._latest, query, [], "")
            return
        self._latest = seq = next(self._asked)
        self._search(seq, query)

    @work(thread=True, exit_on_error=False, group="search")
    def _search(self, seq: int, query: str) -> None:
        try:
            hits, said = self.store.search(query, LIMIT, SNIPPET_TOKENS), ""
        except SearchError as exc:  # no word to look for (only quotes, stars, dashes): said, nothing listed
            hits, said = [], str(exc)
        except Exception as exc:  # noqa: BLE001 - a store problem is said in the dialog, never a crash
            hits, said = [], f"Cannot search: {describe(exc)}"
        self.app.call_from_thread(self._show, seq, query, hits, said)

    def _show(self, seq: int, query: str, hits: list[SearchHit], said: str) -> None:
        if seq != self._latest or not self.is_attached:
            return
        self.hits, self.hits_for = hits, query
        options = self.hit_list
        options.clear_options()
        options.add_options([Option(hit_label(h), id=str(i)) for i, h in enumerate(hits)])
        if hits:
            options.highlighted = 0
        if not said and query.strip():
            count = (f"The best {LIMIT} matching rounds" if len(hits) == LIMIT
                     else f"{len(hits)} {'round matches' if len(hits) == 1 else 'rounds match'}")
            said = count if hits else f"No message or reply matches “{terminal_line(query.strip())}”."
        self._say(said)
        if self._open_when_answered and hits:
            self._open(0)
        self._open_when_answered = False

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self.hits_for == event.value and self.hits:
            highlighted = self.hit_list.highlighted
            self._open(highlighted if highlighted is not None else 0)
        elif self.hits_for != event.value:  # its hits are on their way: the first one is opened
            self._open_when_answered = True

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self._open(int(event.option.id))

    def _open(self, index: int) -> None:
        if 0 <= index < len(self.hits):
            self.dismiss(self.hits[index])

    def action_to_hits(self) -> None:
        if self.hits:
            self.hit_list.focus()

    def action_cancel(self) -> None:
        self.dismiss(None)


def open_hit(chat_screen: ChatScreen, hit: SearchHit | None) -> None:
    """Open the hit's chat (as the chat list does), then select the matching message and scroll to it once the
    transcript is shown (the transcript is read by a worker; switching to another chat first gives up)."""
    if hit is None:
        return
    chat_screen.open_chat(hit.session_id)

    def reveal() -> None:
        if chat_screen.open_sid != hit.session_id:  # the user moved on, or the chat could not be opened
            timer.stop()
            return
        shown = chat_screen.shown
        if shown is None or shown.sid != hit.session_id:
            return
        timer.stop()
        reveal_round(chat_screen, hit.round_idx, hit.side)

    timer = chat_screen.set_interval(0.05, reveal)


def reveal_round(chat_screen: ChatScreen, round_idx: int, side: str) -> None:
    """Select the open chat's message (or reply) of round `round_idx` and scroll it into view."""
    from kvchat.app.tui.chat_view import MessageView

    view = chat_screen.chat_view
    messages = list(view.query(MessageView))  # two a round, the message then its reply (ChatView.show_rounds)
    position = 2 * round_idx + (side == "reply")
    if position >= len(messages):
        return
    target = messages[position]
    view.select(target)
    view.anchor(False)  # the view follows its end as replies stream in; here it stays at the hit
    view.call_after_refresh(view.scroll_to_widget, target, animate=False, top=True)
