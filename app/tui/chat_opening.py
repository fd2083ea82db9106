"""Opening a chat, as a part of the main screen: the transcript is shown at once and the chat's KV cache is restored
in a thread worker, with a progress bar when the restore is slow; switching away cancels it. Also the reload of the
stored rounds of the open chat, which the reply flow uses when its view was replaced."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from textual import work
from textual.widgets import ProgressBar

from kvchat.app.session.restore import RestoreCancelled
from kvchat.app.session.service import ChatStats, Transcript, is_demo_model
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
        self.open_info = None
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
            self._later(self._show_transcript, opening, self.backend.transcript(opening.sid))
            stats = self.backend.restore(opening.sid, progress=lambda done, total: self._later(
                self._restore_progress, opening, done, total), cancel=opening.cancel,
                kv_policy=self.app.preferences.kv_policy, calibrating=self._calibrating("restoring…"))
        except RestoreCancelled:
            self._later(self._restore_ended, opening)  # the user moved on: nothing to say
            return
        except Exception as exc:  # noqa: BLE001
            self._later(self._restore_ended, opening)
            self._report(exc, "Cannot open the chat")
            return
        self._later(self._restored, opening, stats)
        if stats.restore is not None and (stats.restore.tokens_recomputed or stats.restore.kept_rounds):
            try:  # the recomputed rounds are being stored again: show their size once they are on disk
                self.backend.drain()
                self._later(self._restored, opening, self.backend.chat_stats(opening.sid))
            except Exception as exc:  # noqa: BLE001
                self._report(exc, "Cannot save the chat's KV")

    async def _show_transcript(self, opening: Opening, transcript: Transcript) -> None:
        if self.opening is not opening:
            return
        self.open_info = transcript.info
        await self.chat_view.show_rounds(transcript.rounds, transcript.info["system_prompt"],
                                         demo=is_demo_model(transcript.info["model_path"]))
        self.composer.set_history([r.user_text for r in transcript.rounds])
        self.status_bar.set_model(transcript.info["model_path"], self.status_bar.device)

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

    def _restore_ended(self, opening: Opening) -> None:
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")

    def _restored(self, opening: Opening, stats: ChatStats) -> None:
        opening.done = True
        if self.opening is opening:
            self._hide_progress()
            self.status_bar.set_activity("")
            self.status_bar.set_chat(stats, self.last_replies.get(opening.sid))
        self._refresh_chats()  # its KV is in memory now

    @work(thread=True, exit_on_error=False, group="open")
    def _reload_transcript(self, sid: str) -> None:
        try:
            transcript = self.backend.transcript(sid)
            stats = self.backend.chat_stats(sid)
        except Exception as exc:  # noqa: BLE001
            self._report(exc, "Cannot read the chat")
            return
        self._later(self._reloaded, sid, transcript, stats)

    async def _reloaded(self, sid: str, transcript: Transcript, stats: ChatStats) -> None:
        if sid != self.open_sid or self.generation is not None:
            return
        self.open_info = transcript.info
        await self.chat_view.show_rounds(transcript.rounds, transcript.info["system_prompt"],
                                         demo=is_demo_model(transcript.info["model_path"]))
        self.composer.set_history([r.user_text for r in transcript.rounds])
        self.status_bar.set_chat(stats, self.last_replies.get(sid))
