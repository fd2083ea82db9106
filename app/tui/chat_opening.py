"""Opening a chat, as a part of the main screen: the transcript is shown at once and the chat's KV cache is restored
in a thread worker, with a progress bar when the restore is slow; switching away cancels it. Also the reload of the
stored rounds of the open chat, which the reply flow uses when its view was replaced."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from textual import work
from textual.widgets import ProgressBar

from kvchat.app.session.restore import RestoreCancelled, RestoreStats
from kvchat.app.session.service import ChatStats, Transcript, is_demo_model
from kvchat.app.tui.chat_live import Shown, answered_elsewhere
from kvchat.app.tui.sidebar import Sidebar


@dataclass(eq=False)
class Opening:
    """One opening of a chat: its restore may be cancelled by switching away."""

    sid: str
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    progress: tuple[int, int] = (0, 0)


class ChatOpening:
    """The open-chat flow of `ChatScreen` (a mixin: it uses the screen's parts, state, `_later` and `_report`)."""

    PROGRESS_AFTER_S = 0.3  # a restore shows a progress bar once it has taken this long

    def on_sidebar_opened(self, event: Sidebar.Opened) -> None:
        self.open_chat(event.sid)

    def open_chat(self, sid: str) -> None:
        if sid == self.open_sid and self.opening is not None and not self.opening.cancel.is_set():
            self.composer.focus()
            return
        self._leave()
        self.open_sid = sid
        self.open_info = self.shown = None
        opening = self.opening = Opening(sid)
        self.sidebar.highlight(sid)
        self.status_bar.set_chat(None, None)
        self.status_bar.set_activity("restoring…")
        self.set_timer(self.PROGRESS_AFTER_S, lambda: self._show_progress(opening))
        self._open_worker(opening)
        self.composer.focus()

    def _leave(self) -> None:
        """Switching away: cancel the open chat's restore, stop (and save) a reply being generated."""
        if self.opening is not None:
            self.opening.cancel.set()
            self.opening = None
        self._hide_progress()
        gen = self.generation
        if gen is not None and not gen.abandoned:
            gen.abandoned = True
            gen.cancel.set()
            self.notify(f"Stopped the reply in “{self.sidebar.title_of(gen.sid)}”; what it had written is saved.")

    def stop_everything(self) -> None:
        """Before quitting: the same as switching away."""
        self._leave()

    @work(thread=True, exit_on_error=False, group="open")
    def _open_worker(self, opening: Opening) -> None:
        try:
            transcript = self.backend.transcript(opening.sid)
        except Exception as exc:  # noqa: BLE001 - nothing of the chat could be read: it is not opened
            self._later(self._open_failed, opening)
            self._report(exc, "Cannot open the chat")
            return
        elsewhere = answered_elsewhere(self.backend.store.home, opening.sid, transcript.rounds)
        self._later(self._show_transcript, opening, transcript, elsewhere)
        try:
            stats = self.backend.restore(opening.sid, progress=lambda done, total: self._later(
                self._restore_progress, opening, done, total), cancel=opening.cancel,
                kv_policy=self.app.preferences.kv_policy, calibrating=self._calibrating("restoring…"))
        except RestoreCancelled:
            self._later(self._restore_ended, opening)  # the user moved on: nothing to say
            return
        except Exception as exc:  # noqa: BLE001
            self._later(self._restore_ended, opening, self._stats_or_none(opening.sid))
            self._report(exc, "Cannot open the chat")
            return
        self._later(self._restored, opening, stats)
        if stats.restore is not None and (stats.restore.tokens_recomputed or stats.restore.kept_rounds):
            try:  # the recomputed rounds are being stored again: show their size once they are on disk
                self._later(self._kv_problems, self.backend.drain())
                self._later(self._restored, opening, self.backend.chat_stats(opening.sid))
            except Exception as exc:  # noqa: BLE001
                self._report(exc, "Cannot save the chat's KV")

    def _stats_or_none(self, sid: str) -> ChatStats | None:
        """From a worker, after a failed restore: what the status bar can still say of the chat (its context, its KV
        on disk), or None when the store cannot say either."""
        try:
            return self.backend.chat_stats(sid)
        except Exception:  # noqa: BLE001 - the restore's own error is the one reported
            return None

    async def _show_transcript(self, opening: Opening, transcript: Transcript, elsewhere: bool = False) -> None:
        if self.opening is not opening:
            return
        await self._show_rounds(opening.sid, transcript, elsewhere)
        self.status_bar.set_model(transcript.info["model_path"], self.status_bar.device)

    async def _show_rounds(self, sid: str, transcript: Transcript, elsewhere: bool) -> None:
        """The chat view shows the stored rounds of chat `sid` (the open one), remembered as `shown`."""
        self.open_info = transcript.info
        await self.chat_view.show_rounds(transcript.rounds, transcript.info["system_prompt"],
                                         demo=is_demo_model(transcript.info["model_path"]),
                                         answered_elsewhere=elsewhere)
        self.composer.set_history([r.user_text for r in transcript.rounds])
        self.shown = Shown(sid, transcript.info["system_prompt"], tuple(transcript.rounds), elsewhere)

    async def _open_failed(self, opening: Opening) -> None:
        """The chat could not be read at all (deleted meanwhile, a broken store): back to no chat open."""
        opening.done = True
        if self.opening is opening:
            self.opening = None
            await self.action_new_chat()
            self._refresh_chats()

    def _restore_progress(self, opening: Opening, done: int, total: int) -> None:
        opening.progress = (done, total)
        if self.opening is opening and self.query_one("#restore-progress").display:
            self.query_one(ProgressBar).update(total=max(total, 1), progress=done)

    def _show_progress(self, opening: Opening) -> None:
        if self.opening is opening and not opening.done:
            done, total = opening.progress
            self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
            self.query_one("#restore-progress").display = True

    def _hide_progress(self) -> None:
        self.query_one("#restore-progress").display = False

    def _restore_ended(self, opening: Opening, stats: ChatStats | None = None) -> None:
        """The restore stopped (cancelled, or failed: `stats` is what the store still says of the chat)."""
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")
            if stats is not None:
                self.status_bar.set_chat(stats, self.last_replies.get(opening.sid))

    def _restored(self, opening: Opening, stats: ChatStats) -> None:
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")
            self.status_bar.set_chat(stats, self.last_replies.get(opening.sid))
        if stats.restore_source == "this run":
            self._tell_restore_notes(opening.sid, stats.restore)
        self._refresh_chats()  # its KV is in memory now

    def _tell_restore_notes(self, sid: str, restore: RestoreStats | None) -> None:
        """K/V recomputed because a segment was damaged or missing, said once per restore: the open's restore is
        also the one the chat's next send reports (Reply.restore), and the status bar redraws it many times."""
        if restore is None or self.told_restores.get(sid) is restore:
            return
        # Only stored K/V that could not be used: rounds with none stored (a text-only or compacted chat) are
        # recomputed as planned, and the status bar counts them already.
        damaged = restore.damaged
        if not damaged:
            return
        self.told_restores[sid] = restore
        notes = "; ".join(" ".join(note.split()) for note in damaged)
        self.notify(f"Restoring “{self.sidebar.title_of(sid)}” recomputed stored K/V that could not be used: {notes}",
                    severity="warning", timeout=10)

    @work(thread=True, exit_on_error=False, group="open")
    def _reload_transcript(self, sid: str) -> None:
        try:
            transcript = self.backend.transcript(sid)
            stats = self.backend.chat_stats(sid)
            elsewhere = answered_elsewhere(self.backend.store.home, sid, transcript.rounds)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot read the chat")
            return
        self._later(self._reloaded, sid, transcript, stats, elsewhere)

    async def _reloaded(self, sid: str, transcript: Transcript, stats: ChatStats, elsewhere: bool = False) -> None:
        if sid != self.open_sid or self.generation is not None:
            return
        await self._show_rounds(sid, transcript, elsewhere)
        self.status_bar.set_chat(stats, self.last_replies.get(sid))
