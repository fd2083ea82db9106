"""Sending a message and streaming the reply, as a part of the main screen: the reply is generated in a thread
worker that streams its pieces back to the screen; Escape (or ctrl+c while a reply is being written) stops it,
ctrl+r writes the last reply again. A first message creates its chat. Whatever fails, the status bar leaves
"generating…" and the message goes back into the message box."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from textual import work
from textual.actions import SkipAction

from kvchat.app.session.service import ChatStats
from kvchat.app.tui.chat_live import Shown
from kvchat.app.tui.chat_view import ReplyView
from kvchat.app.tui.composer import Composer
from kvchat.app.tui.status_bar import LastReply
from kvchat.app.tui.worker_messages import describe
from kvchat.engine.reply_guard import STOP_NOTES
from kvchat.errors import KvchatError
from kvchat.storage.chat_lock import holder_words
from kvchat.storage.db import chat_parameters


@dataclass(eq=False)
class Generation:
    """One reply being generated. `sid` is None until the worker has created the chat of a first message."""

    sid: str | None
    view: ReplyView | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False  # the user switched away: the reply is saved but no longer shown
    waiting: bool = False  # the status bar says it waits for another process writing to the chat
    store_changed: bool = False  # another process changed the chat while this reply was written: reload after it


class ChatReplying:
    """The reply flow of `ChatScreen` (a mixin: it uses the screen's parts, state, `_later` and `_report`)."""

    async def on_composer_submitted(self, event: Composer.Submitted) -> None:
        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.",
                        severity="warning")
            return
        gen = self.generation = Generation(self.open_sid)
        gen.view = await self.chat_view.add_exchange(event.text)
        self.composer.accept(event.text)
        self.status_bar.set_activity("generating…")
        self._send_worker(gen, event.text, False, self._model_for_new_chats_or_none())

    def _model_for_new_chats_or_none(self) -> Path | None:
        if self.open_sid is not None:
            return None
        try:
            return self._model_for_new_chats()
        except KvchatError as exc:
            self._error(str(exc))
            return None

    @work(thread=True, exit_on_error=False, group="generate")
    def _send_worker(self, gen: Generation, text: str, regenerate: bool, model: Path | None, edit=None) -> None:
        """`edit`: an app.session.editing.EditRequest (chat_editing.py): `text` replaces that round's message."""
        prefs = self.app.preferences
        try:
            if gen.sid is None:
                if model is None:
                    raise KvchatError("there is no model to start a chat with; choose one in the settings (F9)")
                gen.sid = self.backend.create_chat(model, system_prompt=self.new_chat_system_prompt)
                self._later(self._chat_created, gen)
            reply = self.backend.send(gen.sid, text, max_tokens=prefs.max_tokens, sampling=prefs.sampling,
                                      on_token=lambda _tok, piece: self._later(self._streamed, gen, piece),
                                      cancel=gen.cancel, regenerate=regenerate, kv_policy=prefs.kv_policy,
                                      calibrating=self._calibrating("generating…"), guard=prefs.guard,
                                      on_wait=lambda holder: self._later(self._waiting, gen, holder), edit=edit)
        except Exception as exc:  # noqa: BLE001
            self._later(self._reply_failed, gen, text, describe(exc))
            return
        self._later(self._reply_done, gen, reply)
        if edit is not None:
            self._later(self._edited, edit, reply)
        problems: list[str] = []
        stats = None
        try:  # the round's K/V goes to disk in the background; then the status bar shows its size
            problems = self.backend.drain()
            stats = self.backend.chat_stats(gen.sid)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot save the chat's KV")
        self._later(self._kv_saved, gen.sid, stats, problems)  # also after a failure: "saving KV…" must end

    def _chat_created(self, gen: Generation) -> None:
        self.new_chat_system_prompt = None
        if not gen.abandoned and self.open_sid is None:
            self.open_sid = gen.sid
        self._refresh_chats()

    def _waiting(self, gen: Generation, holder: dict | None) -> None:
        """The send waits for another kvchat process writing to the chat (its lock; bounded, then an error)."""
        if self.generation is gen and not gen.abandoned and gen.sid == self.open_sid and not gen.cancel.is_set():
            gen.waiting = True
            self.status_bar.set_activity(f"waiting for another kvchat process writing to this chat "
                                         f"({holder_words(holder)})")

    async def _streamed(self, gen: Generation, piece: str) -> None:
        if gen.waiting:  # the lock came: the reply is being written
            gen.waiting = False
            if self.generation is gen and gen.sid == self.open_sid and not gen.cancel.is_set():
                self.status_bar.set_activity("generating…")
        if not gen.abandoned and gen.view is not None and gen.view.is_attached:
            await gen.view.append(piece)

    async def _reply_done(self, gen: Generation, reply) -> None:
        if self.generation is gen:
            self.generation = None
        result = reply.result
        self.last_replies[gen.sid] = LastReply(result.decode_tokens_per_second, 1000 * result.first_token_seconds)
        if gen.sid == self.open_sid:
            self.status_bar.set_activity("saving KV…")
            shown = self.shown if self.shown is not None and self.shown.sid == gen.sid else Shown(gen.sid, None, ())
            if gen.view is not None and gen.view.is_attached:
                note = STOP_NOTES.get(result.stop_reason, "")
                await gen.view.finish(reply.round.assistant_text, note)
                if reply.round.idx == len(shown.rounds) and not gen.store_changed:
                    self.shown = replace(shown, rounds=(*shown.rounds, reply.round))
                else:  # another process added or finished rounds before or while this send wrote (the core took
                    self._reload_transcript(gen.sid)  # them in, the view did not): show the chat as stored
            else:  # the view was replaced meanwhile (switched away and back): show the stored rounds
                self._reload_transcript(gen.sid)
        if reply.restore is not None:  # the open's restore (said already) or one this send made after a reload
            self._tell_restore_notes(gen.sid, reply.restore)
        self._refresh_chats()

    def _kv_saved(self, sid: str, stats: ChatStats | None, problems: list[str]) -> None:
        self._kv_problems(problems)
        if sid == self.open_sid and self.generation is None:
            self.status_bar.set_activity("")
            if stats is not None:
                self.status_bar.set_chat(stats, self.last_replies.get(sid))
        self._refresh_chats()

    def _kv_problems(self, problems: list[str]) -> None:
        """K/V saves that failed, in one line, once: ChatService.drain hands each failure over only once."""
        if problems:
            said = "; ".join(" ".join(p.split()) for p in problems)
            self.notify(f"KV not saved ({said}); the text is saved and its KV is recomputed when the chat is next "
                        f"opened", severity="warning", timeout=10)

    async def _reply_failed(self, gen: Generation, text: str, why: str) -> None:
        if self.generation is gen:
            self.generation = None
        self._error(why, "No reply")
        if gen.sid is not None and gen.sid == self.open_sid:
            self.status_bar.set_activity("")
            self._reload_transcript(gen.sid)  # show what the store holds, nothing more
        elif gen.sid is None and self.open_sid is None:  # the chat of a first message could not be made
            self.status_bar.set_activity("")
            await self.chat_view.show_welcome()
        if not gen.abandoned and text and not self.composer.text.strip():
            self.composer.load_text(text)  # the message is not lost

    def action_stop(self) -> None:
        gen = self.generation
        if gen is None and self.stop_refining():  # no reply: Escape stops the background measurement instead
            return
        if gen is not None and not gen.cancel.is_set():
            gen.cancel.set()
            gen.waiting = False
            self.status_bar.set_activity("stopping…")

    def action_stop_reply(self) -> None:
        """ctrl+c: while a reply is being written, as Escape (a terminal user's reflex to stop); otherwise the key
        goes on to what it does without a reply (copying a selection; else Textual's hint of how to quit)."""
        if self.generation is None:
            raise SkipAction()
        self.action_stop()

    async def action_regenerate(self) -> None:
        if self.generation is not None:
            self.notify("A reply is being generated: wait for it, or press Escape to stop it.",
                        severity="warning")
            return
        if self.open_sid is None:
            self.notify("No chat is open.", severity="warning")
            return
        gen = self.generation = Generation(self.open_sid)
        await self.chat_view.drop_last_reply()
        if self.shown is not None and self.shown.sid == gen.sid and self.shown.rounds:
            self.shown = replace(self.shown, rounds=self.shown.rounds[:-1])  # its reply comes back as a new round
        gen.view = await self.chat_view.add_reply()
        self.status_bar.set_activity("generating…")
        hint = same_reply_hint(self.app.preferences.temperature, self.app.preferences.seed, self.open_info)
        if hint:
            self.notify(hint, timeout=10)
        self._send_worker(gen, "", True, None)


def same_reply_hint(temperature: float, seed: int | None, info: dict | None) -> str:
    """Why regenerating writes the same reply again, and how to vary it ("" when sampling varies it): greedy
    decoding, or sampling from a fixed seed. The chat's own parameters (storage.db.CHAT_PARAMETERS) come first."""
    own = chat_parameters(info or {})

    def where(name: str) -> str:
        return "the chat's own parameters (`kvchat params`)" if own[name] is not None else "the settings (F9)"

    temperature = own["temperature"] if own["temperature"] is not None else temperature
    seed = own["seed"] if own["seed"] is not None else seed
    if temperature == 0:
        return (f"Greedy decoding (temperature 0) writes the same reply again: for another, raise the temperature "
                f"in {where('temperature')}.")
    if seed is not None:
        return (f"Sampling from a fixed seed ({seed}) writes the same reply again: for another, empty the seed in "
                f"{where('seed')}.")
    return ""
