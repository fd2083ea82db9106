"""The CLI's side of app/session/progress.py: a step that takes seconds is shown as a `rich` progress bar on stderr,
only when stderr is a terminal (stdout carries what scripts parse: ids, replies, JSON), and only while the step runs
(the bar is erased when it ends, so a reply streamed after it is not drawn over).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


class TerminalProgress:
    """An `on_progress(step, done, total, eta_s)` drawing one bar per step on stderr."""

    def __init__(self, file=None):
        self.file = file if file is not None else sys.stderr
        self.bars = None
        self.tasks: dict[str, int] = {}

    def __call__(self, step: str, done: float, total: float, eta_s: float | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        if self.bars is None:
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[eta]}"), console=Console(file=self.file), transient=True)
            self.bars.start()
        eta = "" if eta_s is None or done >= total else f"about {_duration(eta_s)} left (ctrl+c cancels)"
        task = self.tasks.get(step)
        if task is None:
            task = self.tasks[step] = self.bars.add_task(step, total=total, completed=done, eta=eta)
        else:
            self.bars.update(task, total=total, completed=done, eta=eta)
        if done >= total:
            self.bars.remove_task(self.tasks.pop(step))
            if not self.tasks:
                self.close()

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None
            self.tasks.clear()


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 90 else f"{seconds // 60} min {seconds % 60:02d} s"


@contextmanager
def terminal_progress(file=None) -> Iterator[TerminalProgress | None]:
    """A TerminalProgress on stderr when it is a terminal, else None (nothing is drawn); erased on the way out,
    a Ctrl-C included."""
    file = file if file is not None else sys.stderr
    shown = TerminalProgress(file) if file.isatty() else None
    try:
        yield shown
    finally:
        if shown is not None:
            shown.close()


@contextmanager
def counted_progress(step: str, plain=None, file=None) -> Iterator:
    """`report(done, total)` for a step counted in its own units (chats, runs): a `rich` bar with an estimate of the
    time left on a terminal; elsewhere `plain(done, total)` if given (a line a log can keep), else nothing. Ctrl-C
    stops the step as always (KeyboardInterrupt); the bar is erased on the way out."""
    from kvchat.app.session.progress import Reporter

    with terminal_progress(file) as shown:
        counter = Reporter(step, shown) if shown is not None else None

        def report(done: float, total: float) -> None:
            if counter is not None:
                counter(done, total)
            elif plain is not None:
                plain(done, total)

        yield report
