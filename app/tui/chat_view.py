"""The open chat: user messages as text, assistant messages as Markdown, the reply streamed token by token."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown, Static

from kvchat.app.terminal_text import terminal_line, terminal_text
from kvchat.app.tui.code_blocks import code_blocks
from kvchat.engine.reply_guard import STOP_NOTES
from kvchat.storage.db import REPLY_PARTIAL, REPLY_PENDING, RoundRow

WELCOME = ("**No chat open.** Type a message below to start a new chat, or pick one on the left.\n\n"
           "Press **F1** for every key.")
# Shown while the embedded demo model is the one new chats use: a new user's first reply comes from it.
DEMO_LINE = ("*The built-in demo model only remembers what you tell it (names, places, dates, what things are called) "
             "and answers questions about it; for a real assistant choose a GGUF model in the settings (F9) or run "
             "`kvchat --model FILE.gguf`.*")
# Under a stored reply that is not whole (storage.db's reply states), as under a reply stopped in this run.
PARTIAL_NOTE = STOP_NOTES["cancelled"]
ANSWERED_ELSEWHERE_NOTE = "being answered by another kvchat process"
NO_REPLY_NOTE = "no reply saved: kvchat stopped before the reply ended"


def reply_note(row: RoundRow, answered_elsewhere: bool) -> str:
    """The note under a stored reply: none when whole; `answered_elsewhere`: another process holds the chat's
    writer lock now (storage.chat_lock), so its pending reply is still coming."""
    if row.reply_state == REPLY_PARTIAL:
        return PARTIAL_NOTE
    if row.reply_state == REPLY_PENDING:
        return ANSWERED_ELSEWHERE_NOTE if answered_elsewhere else NO_REPLY_NOTE
    return ""


class MessageView(Vertical):
    """One message. A click selects it (for copying)."""

    def __init__(self, role: str, text: str, note: str = "") -> None:
        super().__init__(classes=f"message {role}")
        self.role, self.text, self.note = role, text, note

    def compose(self) -> ComposeResult:
        yield Label("you" if self.role == "user" else "assistant", classes="role")
        if self.role == "user":
            yield Static(terminal_text(self.text), markup=False, classes="body")
        else:  # shown with control characters escaped (an ESC sequence is seen, not obeyed); copied as stored
            yield Markdown(terminal_text(self.text), classes="body")
        if self.note:
            yield Label(self.note, classes="note", markup=False)

    def on_click(self, event: events.Click) -> None:
        chat = self.query_ancestor(ChatView)
        chat.select(self)


class ReplyView(MessageView):
    """An assistant message still being written: pieces arrive as the model produces them."""

    def __init__(self) -> None:
        super().__init__("assistant", "")
        self._stream = None
        self.pieces = 0  # how many updates it received (the tests check that it streamed)

    async def append(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        self.pieces += 1
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(terminal_text(piece))

    async def finish(self, text: str, note: str = "") -> None:
        """The reply as stored (the streamed pieces minus any stop string), with a note such as "stopped"."""
        if self._stream is not None:
            await self._stream.stop()
        self.text = text
        await self.query_one(Markdown).update(terminal_text(text))
        if note:
            self.note = note
            await self.mount(Label(note, classes="note", markup=False))


class ChatView(VerticalScroll):
    """The transcript. Focused (tab from the chat list, shift+tab from the message box), up and down select the
    messages one by one and c copies the selected message's code blocks, one per press."""

    BINDINGS = [
        Binding("up", "select_message(-1)", "Previous", show=False,
                tooltip="Select the message above (ctrl+o copies the selected message)"),
        Binding("down", "select_message(1)", "Next", show=False, tooltip="Select the message below"),
        Binding("c", "copy_code", "Copy code",
                tooltip="Copy the selected message's code block (else the last reply's); again: its next block"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.selected: MessageView | None = None
        self._code_copied: tuple[MessageView, int] | None = None  # the message and block `c` copied last
        self.demo = False  # new chats (or the open chat) run on the embedded demo model: say what it can do

    def compose(self) -> ComposeResult:
        yield Markdown(WELCOME, id="welcome", classes="no-chat")

    @staticmethod
    def _with_demo_line(text: str, demo: bool) -> str:
        return f"{text}\n\n{DEMO_LINE}" if demo else text

    async def show_welcome(self, text: str = WELCOME) -> None:
        self.selected = None
        await self.remove_children()
        await self.mount(Markdown(self._with_demo_line(text, self.demo), id="welcome", classes="no-chat"))

    async def set_demo(self, demo: bool) -> None:
        """Whether new chats use the demo model; the no-chat screen shown now says so at once."""
        self.demo = demo
        for welcome in self.query(".no-chat").results(Markdown):
            await welcome.update(self._with_demo_line(WELCOME, demo))

    async def show_rounds(self, rounds: list[RoundRow], system_prompt: str | None, demo: bool = False,
                          answered_elsewhere: bool = False) -> None:
        """The chat's rounds, a reply not whole with its note (`answered_elsewhere`: the last round's pending reply
        is being written by another process); an empty chat on the demo model (`demo`) says what that model can do."""
        self.selected = None
        await self.remove_children()
        views = []
        if system_prompt:
            views.append(Static(f"system: {terminal_text(system_prompt)}", markup=False, classes="system"))
        for i, r in enumerate(rounds):
            note = reply_note(r, answered_elsewhere and i == len(rounds) - 1)
            views += [MessageView("user", r.user_text), MessageView("assistant", r.assistant_text, note)]
        if not views:
            views.append(Markdown(self._with_demo_line("*An empty chat: type a message below.*", demo), id="welcome"))
        await self.mount_all(views)
        self.scroll_end(animate=False)
        self.anchor()

    async def add_exchange(self, user_text: str) -> ReplyView:
        """The user's message and the (empty) reply that will stream under it."""
        for welcome in self.query("#welcome"):
            await welcome.remove()
        reply = ReplyView()
        await self.mount_all([MessageView("user", user_text), reply])
        self.scroll_end(animate=False)
        self.anchor()
        return reply

    async def add_reply(self) -> ReplyView:
        """An empty reply under the last message (regenerating)."""
        reply = ReplyView()
        await self.mount(reply)
        self.scroll_end(animate=False)
        return reply

    async def drop_last_reply(self) -> None:
        replies = [m for m in self.query(MessageView) if m.role == "assistant"]
        if replies:
            if self.selected is replies[-1]:
                self.selected = None
            await replies[-1].remove()

    def user_messages(self) -> list[MessageView]:
        """The user's messages in order: the i-th is round i's (the view shows every stored round)."""
        return [m for m in self.query(MessageView) if m.role == "user"]

    async def drop_from_round(self, round_idx: int) -> None:
        """Remove round `round_idx`'s message and everything under it (an edited message is answered again)."""
        users = self.user_messages()
        if round_idx >= len(users):
            return
        children = list(self.children)
        gone = children[children.index(users[round_idx]):]
        if self.selected in gone:
            self.selected = None
        await self.remove_children(gone)

    def select(self, message: MessageView) -> None:
        if self.selected is not None:
            self.selected.remove_class("selected")
        self.selected = message
        message.add_class("selected")

    def message_to_copy(self) -> MessageView | None:
        """The selected message, else the last reply."""
        if self.selected is not None and self.selected.is_attached:
            return self.selected
        replies = [m for m in self.query(MessageView) if m.role == "assistant"]
        return replies[-1] if replies else None

    def action_select_message(self, step: int) -> None:
        """Select the message `step` away from the selected one (none selected: up takes the last, down the first),
        scrolled into view; with no message, up and down scroll as in any view."""
        messages = list(self.query(MessageView))
        if not messages:
            self.scroll_relative(y=step, animate=False)
            return
        if self.selected in messages:
            at = max(0, min(len(messages) - 1, messages.index(self.selected) + step))
        else:
            at = len(messages) - 1 if step < 0 else 0
        self.select(messages[at])
        self.scroll_to_widget(messages[at], animate=False)

    def action_copy_code(self) -> None:
        """Copy a code block of the selected message (else of the last reply): the first, then on each press the
        next one, round again after the last."""
        message = self.message_to_copy()
        blocks = code_blocks(message.text) if message is not None else []
        if not blocks:
            which = "selected message" if message is self.selected and message is not None else "last reply"
            self.notify(f"The {which} has no code block.", severity="warning")
            return
        last = self._code_copied
        at = (last[1] + 1) % len(blocks) if last is not None and last[0] is message else 0
        self._code_copied = (message, at)
        self.app.copy_to_clipboard(blocks[at].code)
        self.notify(terminal_line(f"Copied code block {at + 1} of {len(blocks)} ({blocks[at].describe()})."),
                    markup=False)
