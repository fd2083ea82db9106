"""What a worker thread hands back to the main screen: `Later`, a function to run on the UI thread (posted by
`ChatScreen._later`), and `describe`, the one sentence an exception becomes in an error notification."""

from __future__ import annotations

from typing import Any, Callable

from textual.message import Message

from kvchat.errors import KvchatError


def describe(exc: BaseException) -> str:
    """One sentence for the user: our own errors say what went wrong; anything else is named as unexpected."""
    if isinstance(exc, KvchatError):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc}"


class Later(Message):
    """A function a worker wants run on the UI thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs
