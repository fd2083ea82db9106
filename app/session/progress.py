"""How a step that can take seconds says how far it is: one callback protocol for every such step (assembling a
known model, measuring the hardware profile, calibrating, the merge check, eval, bench), shown by the CLI as a
`rich` progress bar on stderr (app/cli_progress.py) and by the app as a progress bar (app/tui).

The steps themselves report `(done, total)` in their own units (engine/ cannot import this module: its calibrations
take a plain `progress(done, total)` callable); `Reporter` turns those into `on_progress(step, done, total, eta_s)`
calls with an estimate of the time left, from the rate so far.

Cancelling: a progress callback may raise (the CLI's Ctrl-C is a KeyboardInterrupt, the app's Escape raises
`Cancelled` at the next report): every step writes its result only once it is whole (atomic writes), so an
interrupted step leaves nothing half-written. `Budget` raises `BudgetSpent` once a bounded step has run its time.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol


class OnProgress(Protocol):
    def __call__(self, step: str, done: float, total: float, eta_s: float | None) -> None:
        """`step`: what is being done, in words; `done` of `total` (same units, done <= total, and done == total
        once when it ends); `eta_s`: seconds left, estimated (None until there is a rate to go by)."""


class Cancelled(Exception):
    """Raised from a progress report once the user cancelled the step (the app's Escape)."""


class BudgetSpent(Exception):
    """Raised from a progress report once a step bounded in time has run past its bound."""

    def __init__(self, step: str, elapsed_s: float, done: float, total: float):
        super().__init__(f"{step}: stopped at its {elapsed_s:.0f} s bound, {done:g} of {total:g} done")
        self.step, self.elapsed_s, self.done, self.total = step, elapsed_s, done, total

    @property
    def estimate_s(self) -> float | None:
        """What the whole step would take at the rate it ran (None: nothing done yet)."""
        return self.elapsed_s * self.total / self.done if self.done > 0 else None


class Reporter:
    """`progress(done, total)` (a step's own callback) -> `on_progress(step, done, total, eta_s)`, never going
    backwards, with an estimate of the time left; `cancel` (an Event) set -> Cancelled at the next report;
    `max_seconds` passed -> BudgetSpent at the next report."""

    def __init__(self, step: str, on_progress: OnProgress | None = None, *, cancel: threading.Event | None = None,
                 max_seconds: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.step, self.on_progress, self.cancel, self.max_seconds, self.clock = (step, on_progress, cancel,
                                                                                   max_seconds, clock)
        self.started = clock()
        self.done = 0.0
        self.total = 0.0

    def eta(self, done: float, total: float) -> float | None:
        elapsed = self.clock() - self.started
        if done <= 0 or elapsed <= 0:
            return None
        return max(0.0, elapsed * (total - done) / done)

    def __call__(self, done: float, total: float) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(self.step)
        total = max(float(total), 0.0)
        done = min(max(float(done), self.done), total) if total else float(done)
        self.done, self.total = done, total
        if self.on_progress is not None:
            self.on_progress(self.step, done, total, self.eta(done, total))
        elapsed = self.clock() - self.started
        if self.max_seconds is not None and elapsed > self.max_seconds and done < total:
            raise BudgetSpent(self.step, elapsed, done, total)

    def finish(self) -> None:
        """The step ended: done == total, said once."""
        total = self.total or 1.0
        if self.on_progress is not None and self.done < total:
            self.on_progress(self.step, total, total, 0.0)
        self.done = self.total = total


def reporter(step: str, on_progress: OnProgress | None, **kwargs) -> Reporter | None:
    """A Reporter, or None when nobody listens and nothing bounds or cancels the step (the step runs as before)."""
    if on_progress is None and not kwargs.get("cancel") and kwargs.get("max_seconds") is None:
        return None
    return Reporter(step, on_progress, **kwargs)
