"""One writer per chat across processes: an advisory lock file per chat (`locks/<chat id>.lock` in the data folder).

A send holds its chat's lock from before it reads what the chat holds until the round's K/V is on disk, so two
processes (two `kvchat send`, or the app and a send) never claim the same round index, and no K/V is written for a
round another process has since replaced. SQLite alone cannot give this: its write transactions last one commit,
while a send spans a reply that takes seconds to minutes.

`fcntl.flock` rather than the `filelock` package: the holder writes who it is (pid, command, since when) into the
lock file itself, so a waiting process can name it, and filelock truncates the file each time it is opened. The
kernel drops a flock when its process dies, SIGKILL included: a lock is never left stale. Two opens in one process
are two holders too, so a process's next send on a chat waits for its own writer thread to release the last one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kvchat.errors import KvchatError

try:
    import fcntl
except ImportError:  # not POSIX: one writer per chat is not enforced across processes there
    fcntl = None

POLL_S = 0.05


class ChatBusyError(KvchatError):
    """Another process held the chat's lock for longer than this one would wait."""


def lock_path(home: Path, sid: str) -> Path:
    return Path(home) / "locks" / f"{sid}.lock"


def read_holder(path: Path) -> dict | None:
    """Who holds (or last held) the lock at `path`, as it wrote itself there; None if nothing readable."""
    try:
        text = path.read_text(encoding="utf-8")
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def holder_words(holder: dict | None) -> str:
    """'pid 4242, `kvchat send`, since 12:03:55' for messages."""
    if not holder:
        return "another kvchat process"
    since = str(holder.get("since", ""))[11:19]
    what = holder.get("command") or "kvchat"
    return f"pid {holder.get('pid', '?')}, `{what}`" + (f", since {since} UTC" if since else "")


class ChatLock:
    """A held lock on one chat: `release()` (from any thread) lets the next writer in."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd
        self._released = threading.Event()

    @classmethod
    def acquire(cls, home: Path, sid: str, *, wait_s: float = 600.0,
                on_wait: Callable[[dict | None], None] | None = None,
                cancel: threading.Event | None = None) -> "ChatLock":
        """Take the chat's lock, waiting up to `wait_s` seconds for its holder; `on_wait(holder)` is told once when
        waiting starts (only when the holder is another process: this process's own writer finishes in moments).
        ChatBusyError names the holder when the wait runs out (or `cancel` is set); an OSError (a read-only or
        full home) propagates for the caller to name."""
        path = lock_path(home, sid)
        if fcntl is None:
            return cls(path, None)
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, told = time.monotonic() + wait_s, False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = read_holder(path)
                    if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                        raise ChatBusyError(f"chat {sid} is being written by {holder_words(holder)}; nothing was "
                                            f"sent (try again once it is done)") from None
                    if not told and on_wait is not None and (holder or {}).get("pid") != os.getpid():
                        told = True
                        on_wait(holder)
                    time.sleep(POLL_S)
            holder = {"pid": os.getpid(), "command": _command(),
                      "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self._released.is_set():
            return
        self._released.set()
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the holder text stays, naming the last writer


def is_locked(home: Path, sid: str) -> bool:
    """Whether some process (this one included) holds the chat's lock now: a pending reply is being generated."""
    path = lock_path(home, sid)
    if fcntl is None or not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _command() -> str:
    args = [os.path.basename(sys.argv[0])] + sys.argv[1:2] if sys.argv and sys.argv[0] else []
    if args and args[0] in ("cli.py", "__main__.py", "-c", "-m"):
        args[0] = "kvchat"
    return " ".join(args)[:60] or "kvchat"
