"""The chat screen's steps that take seconds outside a reply (app/session/progress.py): a progress bar above the
composer while one runs, with its estimate of the time left.

A model's first chat here answers on a quick estimate of this machine's speeds (app/session/profile.py); the
measurement that replaces it runs here in the background once the app is idle (no reply being written, no chat
being opened). A message sent meanwhile stops it at its next step (the reply gets the cores; it starts again when
idle), and Escape stops it for this session; stopped, it leaves the estimate as it was.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import work
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from kvchat.app.session.progress import Cancelled

IDLE_CHECK_S = 2.0  # how often the screen looks for a quick profile to refine (and for a reply that needs the cores)


class ChatSteps:
    _refining: threading.Event | None = None  # set: the background measurement is asked to stop
    _refine_stopped_by_user = False
    _refine_settled: set[str]  # model files whose profile needs no refining in this session (done, or declined)

    def _start_steps(self) -> None:
        """From on_mount: progress of the backend's steps shown here, and the idle check started."""
        self._refine_settled = set()
        self.backend.on_progress = lambda step, done, total, eta_s: self._later(self._step_progress, step, done,
                                                                                 total, eta_s)
        self.set_interval(IDLE_CHECK_S, self._refine_when_idle)

    def _step_bar(self) -> Horizontal:
        found = self.query("#step-progress")
        if found:
            return found.first()
        row = Horizontal(Label("", id="step-label"), ProgressBar(id="step-bar", show_eta=False), id="step-progress")
        row.styles.height = 1
        row.styles.padding = (0, 1)
        self.query_one("#composer").parent.mount(row, before="#composer")
        label = row.query_one("#step-label", Label)
        label.styles.width = "auto"
        label.styles.margin = (0, 2, 0, 0)
        return row

    def _step_progress(self, step: str, done: float, total: float, eta_s: float | None) -> None:
        row = self._step_bar()
        if done >= total:
            row.display = False
            return
        left = "" if eta_s is None else f", about {max(1, round(eta_s))} s left"
        stop = " (Escape stops it)" if self._refining is not None else ""
        row.query_one("#step-label", Label).update(f"{step}{left}{stop}")
        row.query_one("#step-bar", ProgressBar).update(total=max(total, 1), progress=done)
        row.display = True

    def _busy(self) -> bool:
        opening = getattr(self, "opening", None)
        return self.generation is not None or (opening is not None and not opening.done)

    def _refine_when_idle(self) -> None:
        if self._refining is not None:
            if self._busy():  # a reply or a restore wants the cores: stop at the next step, start again when idle
                self._refining.set()
            return
        path = (self.open_info or {}).get("model_path") if self.open_sid else None
        path = str(path or self._model_for_new_chats())
        if self._busy() or path in self._refine_settled:
            return
        self._refining = threading.Event()
        self._refine_stopped_by_user = False
        self._refine_worker(path, self._refining)

    def stop_refining(self) -> bool:
        """Escape with no reply being written: the background measurement stops (for this session)."""
        if self._refining is None:
            return False
        self._refine_stopped_by_user = True
        self._refining.set()
        return True

    @work(thread=True, exit_on_error=False, group="refine")
    def _refine_worker(self, path: str, cancel: threading.Event) -> None:
        from kvchat.app.session.profile import needs_refining, refine_profile
        from kvchat.storage.fingerprint import model_fingerprint

        settled = False
        try:
            engine = self.backend.engine(path)
            fingerprint = model_fingerprint(Path(engine.path), self.backend.store)
        except Exception:  # noqa: BLE001 - a model that cannot be loaded is said where it is loaded, not here
            self._later(self._refine_ended, path, True)
            return
        try:
            if needs_refining(fingerprint, engine.device):
                refine_profile(engine, fingerprint, on_progress=self.backend.on_progress, cancel=cancel)
                self._later(self.notify, "Measured this machine's speeds for this model (it answered on a quick "
                            "estimate until now).", timeout=6)
            settled = True
        except Cancelled:
            settled = self._refine_stopped_by_user
            self._later(self._step_progress, "", 1, 1, None)
        except Exception as exc:  # noqa: BLE001 - the estimate stays in use; said once, not retried this session
            settled = True
            self._later(self._step_progress, "", 1, 1, None)
            self._report(exc, "Cannot measure this machine's speeds")
        finally:
            self._later(self._refine_ended, path, settled)

    def _refine_ended(self, path: str, settled: bool) -> None:
        self._refining = None
        if settled:
            self._refine_settled.add(path)
