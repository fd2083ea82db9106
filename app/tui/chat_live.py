"""Following the store, as a part of the main screen: other kvchat processes (a `kvchat send`, another app) write to
the same chats, so the screen polls SQLite's data_version, which changes whenever another connection commits, and
then redraws the chat list and, when the open chat changed, its transcript; a chat deleted elsewhere is closed.

What the chat view shows is remembered (`Shown`), so that a change elsewhere that does not touch the open chat does
not redraw it, and a reply of this app that follows rounds another process wrote is followed by a reload."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from textual import work

from kvchat.app.session.service import ChatStats, Transcript
from kvchat.storage.chat_lock import is_locked, lock_path, read_holder
from kvchat.storage.db import REPLY_PENDING, RoundRow


def round_key(r: RoundRow) -> tuple:
    # Token spans left out: a restore may tokenize a chat anew without changing anything shown.
    return r.idx, r.user_text, r.assistant_text, r.reply_state, r.created


@dataclass(frozen=True)
class Shown:
    """The stored rounds the chat view shows for chat `sid`, and whether its pending last reply was said to be
    written by another process."""

    sid: str
    system_prompt: str | None
    rounds: tuple[RoundRow, ...]
    answered_elsewhere: bool = False

    @property
    def pending_last(self) -> bool:
        return bool(self.rounds) and self.rounds[-1].reply_state == REPLY_PENDING

    def same_as(self, transcript: Transcript, answered_elsewhere: bool) -> bool:
        return (self.system_prompt == transcript.info["system_prompt"]
                and [round_key(r) for r in self.rounds] == [round_key(r) for r in transcript.rounds]
                and (answered_elsewhere == self.answered_elsewhere or not self.pending_last))


def answered_elsewhere(home: Path, sid: str, rounds: list[RoundRow] | tuple[RoundRow, ...]) -> bool:
    """Whether the chat's last reply is pending because another process is writing it now (it holds the chat's
    writer lock). This process's own lock is not that: its reply ended here (or failed) and is being put away."""
    if not rounds or rounds[-1].reply_state != REPLY_PENDING or not is_locked(home, sid):
        return False
    return (read_holder(lock_path(home, sid)) or {}).get("pid") != os.getpid()


class ChatLive:
    """The store-following flow of `ChatScreen` (a mixin: it uses the screen's parts, state, `_later`, `_error`,
    `_show_chats`, `_reloaded` and `action_new_chat`)."""

    POLL_S = 1.0  # how often the store is asked whether another process changed it (one PRAGMA)

    def _follow_store(self) -> None:
        """From on_mount: start polling (the first version is taken by the start worker, before the chat list)."""
        self._store_version: int | None = None
        self._polling = False
        self._poll_failed = False
        self.set_interval(self.POLL_S, self._poll_store)

    def _take_store_version(self) -> None:
        """From a worker, before reading what is shown: a commit elsewhere after this is noticed."""
        self._store_version = self.backend.store.data_version()

    def _poll_store(self) -> None:
        if self._polling or self._store_version is None:
            return  # the last poll is still out, or the start has not read the store yet
        self._polling = True
        sid = self.open_sid
        shown = self.shown if self.shown is not None and self.shown.sid == sid else None
        self._poll_worker(sid, shown)

    @work(thread=True, exit_on_error=False, group="poll")
    def _poll_worker(self, sid: str | None, shown: Shown | None) -> None:
        try:
            version = self.backend.store.data_version()
            home = self.backend.store.home
            # A pending reply's writer may die without a commit: its lock going away is a change too.
            lock_turned = shown is not None and shown.pending_last and \
                answered_elsewhere(home, sid, shown.rounds) != shown.answered_elsewhere
            if version == self._store_version and not lock_turned:
                return
            seq = next(self._chats_asked)
            chats = self.backend.chat_list()
            if sid is not None and not any(c.id == sid for c in chats):
                self.backend.forget(sid)  # its cache is of a chat that no longer exists
                self._later(self._open_chat_deleted, seq, chats, sid)
            elif sid is not None and shown is not None:
                transcript = self.backend.transcript(sid)
                elsewhere = answered_elsewhere(home, sid, transcript.rounds)
                stats = None if shown.same_as(transcript, elsewhere) else self.backend.chat_stats(sid)
                self._later(self._store_changed, seq, chats, sid, transcript, stats, elsewhere)
            else:
                self._later(self._show_chats, seq, chats)
            # Taken only once all of it was read: a poll that failed half-way is made again at the next tick.
            self._store_version = version
            self._poll_failed = False
        except Exception as exc:  # noqa: BLE001
            if not self._poll_failed:  # said once, not every second
                self._poll_failed = True
                self._report(exc, "Cannot read the chat store")
        finally:
            self._later(setattr, self, "_polling", False)

    async def _store_changed(self, seq: int, chats, sid: str, transcript: Transcript, stats: ChatStats | None,
                             elsewhere: bool) -> None:
        self._show_chats(seq, chats)
        gen = self.generation
        if stats is not None and gen is not None and gen.sid == sid and not gen.abandoned and sid == self.open_sid:
            # A reply is being written here: the reply flow shows the chat as stored after it (this change, such as
            # another process's reply finishing, would otherwise be missed: its store version is taken already).
            gen.store_changed = True
            return
        if stats is None or sid != self.open_sid:
            return  # unchanged; or moved on
        await self._reloaded(sid, transcript, stats, elsewhere)

    async def _open_chat_deleted(self, seq: int, chats, sid: str) -> None:
        title = self.sidebar.title_of(sid)  # from the list before it goes
        self._show_chats(seq, chats)
        if sid != self.open_sid:
            return
        gen = self.generation
        if gen is not None and gen.sid == sid and not gen.abandoned:
            gen.abandoned = True  # its reply has no chat to go to: stopped without claiming it was saved
            gen.cancel.set()
        await self.action_new_chat()
        self.notify(f"“{title}” was deleted by another kvchat process.", severity="warning", timeout=8)
