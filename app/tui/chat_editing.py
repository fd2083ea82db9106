"""Editing a past message, as a part of the main screen: ctrl+t on the selected message (click it; else the last one)
asks for its new text, and the chat is answered again from that round on through the ordinary reply flow
(chat_replying.py). The rounds before keep their K/V; the replaced ones become a fork of the chat unless the
settings say to drop them (app.session.editing)."""

from __future__ import annotations

from dataclasses import replace

from kvchat.app.session.editing import EditRequest, edit_words
from kvchat.app.tui.chat_replying import Generation


class ChatEditing:
    """The edit flow of `ChatScreen` (a mixin: it uses the screen's parts, state and the reply flow's worker)."""

    def action_edit_message(self) -> None:
        from kvchat.app.tui.dialogs.edit_message import EditMessageDialog

        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.", severity="warning")
            return
        if self.open_sid is None:
            self.notify("No chat is open.", severity="warning")
            return
        users = self.chat_view.user_messages()
        selected = self.chat_view.selected
        if selected is not None and selected not in users and selected.is_attached:  # a reply: its round's message
            children = list(self.chat_view.children)
            before = [m for m in users if children.index(m) < children.index(selected)] if selected in children else []
            selected = before[-1] if before else None
        message = selected if selected in users else (users[-1] if users else None)
        if message is None:
            self.notify("The chat has no message to edit.", severity="warning")
            return
        round_idx, sid = users.index(message), self.open_sid

        async def edited(text: str | None) -> None:
            if text is not None and text != message.text and sid == self.open_sid:
                await self.edit_message(round_idx, text)

        keep = "kept as a fork" if self.app.preferences.keep_edited_branch else "dropped (see the settings)"
        self.app.push_screen(EditMessageDialog(f"Edit message {round_idx}: the chat is answered again from it; the "
                                               f"rounds before keep their KV, the replaced ones are {keep}",
                                               message.text), edited)

    async def edit_message(self, round_idx: int, text: str) -> None:
        """Replace round `round_idx`'s message with `text` and answer it (the key's dialog; the tests)."""
        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.", severity="warning")
            return
        gen = self.generation = Generation(self.open_sid)
        await self.chat_view.drop_from_round(round_idx)
        if self.shown is not None and self.shown.sid == gen.sid:
            self.shown = replace(self.shown, rounds=self.shown.rounds[:round_idx])
        gen.view = await self.chat_view.add_exchange(text)
        self.status_bar.set_activity("generating…")
        edit = EditRequest(round_idx, keep_old=self.app.preferences.keep_edited_branch)
        self._send_worker(gen, text, False, None, edit)

    def _edited(self, edit: EditRequest, reply) -> None:
        """Said once the edited round is answered: what was kept and computed, where the old branch went (in full
        as a notification; what was reused stays in the status bar until the next reply)."""
        words = edit_words(edit, reply.restore)
        self.notify(words[:1].upper() + words[1:] + ".", timeout=10)
        self.status_bar.set_note(words.split("; the replaced")[0])
