"""Where kvchat keeps user data: one folder, $KVCHAT_HOME, or the platform's user data folder; and how small JSON
files there are written."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import tempfile
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    home = os.environ.get("KVCHAT_HOME")
    return Path(home).expanduser() if home else Path(platformdirs.user_data_dir("kvchat", appauthor=False))


def can_write(folder: Path) -> bool:
    """Whether this process may create files in `folder`: no on a read-only mount (EROFS) and in a folder without
    write permission; yes for root whatever the permission bits (root may write there)."""
    return os.access(folder, os.W_OK, effective_ids=os.access in os.supports_effective_ids)


def can_read(path: Path) -> bool:
    """Whether this process may read the file, or list and open what is in the folder, at `path`."""
    mode = os.R_OK | (os.X_OK if path.is_dir() else 0)
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def prepare_home(home: Path, *, from_env: bool) -> None:
    """Make sure the data folder `home` exists, or raise KvchatError naming what is wrong with the place. A folder
    the user named (`from_env`: KVCHAT_HOME) is created but not its parents: a missing parent may be a drive that is
    not mounted, and creating it would hide that; the default folder gets its parents."""
    from kvchat.errors import KvchatError

    label = f"KVCHAT_HOME {home}" if from_env else f"the kvchat folder {home}"
    if home.is_dir():
        return
    if home.is_symlink() and not home.exists():
        raise KvchatError(f"{label} is a link to {os.readlink(home)}, which does not exist")
    if home.exists():
        raise KvchatError(f"{label} is a file, not a folder")
    if from_env and not home.parent.is_dir():
        state = "is not a folder" if home.parent.exists() else "does not exist"
        raise KvchatError(f"{label}: its parent folder {home.parent} {state}")
    try:
        home.mkdir(parents=not from_env, exist_ok=True)
    except OSError as exc:
        place = next((p for p in home.parents if p.exists()), home.parent)
        raise KvchatError(place_words(place, exc, f"create {home}")) from None


# errno values, and SQLite's error names and (for errors raised without a code) messages, by what they say about
# the place the data lives in rather than the file that happened to fail first.
_READ_ONLY, _FULL, _QUOTA, _PERMISSION, _IO = "read-only", "full", "quota", "permission", "io"
_BY_ERRNO = {errno.EROFS: _READ_ONLY, errno.ENOSPC: _FULL, errno.EDQUOT: _QUOTA, errno.EACCES: _PERMISSION,
             errno.EPERM: _PERMISSION, errno.EIO: _IO}
_BY_SQLITE_NAME = {"SQLITE_READONLY": _READ_ONLY, "SQLITE_FULL": _FULL, "SQLITE_PERM": _PERMISSION,
                   "SQLITE_IOERR": _IO}
_BY_SQLITE_TEXT = {"readonly database": _READ_ONLY, "database or disk is full": _FULL,
                   "access permission denied": _PERMISSION, "disk i/o error": _IO}


def place_problem(exc: BaseException) -> str | None:
    """What an OSError or SQLite error says about the place it met (read-only, full, quota, permission, io), or
    None when it is about something else."""
    if isinstance(exc, OSError):
        return _BY_ERRNO.get(exc.errno)
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None) or ""
        for prefix, problem in _BY_SQLITE_NAME.items():  # extended codes: SQLITE_IOERR_WRITE, SQLITE_READONLY_...
            if name == prefix or name.startswith(prefix + "_"):
                return problem
        text = str(exc).lower()
        return next((problem for words, problem in _BY_SQLITE_TEXT.items() if words in text), None)
    return None


def place_words(place: Path, exc: BaseException, doing: str) -> str:
    """An OSError or SQLite error met while trying to `doing` in `place` (a folder), as one line about the place."""
    problem = place_problem(exc)
    if problem == _READ_ONLY:
        return f"{place} is read-only: cannot {doing}"
    if problem == _FULL:
        return f"the disk holding {place} is full: cannot {doing}"
    if problem == _QUOTA:
        return f"the disk quota for {place} is used up: cannot {doing}"
    if problem == _PERMISSION:
        return f"no permission to write in {place}: cannot {doing}"
    if problem == _IO:
        return f"an I/O error on the disk holding {place}: cannot {doing}"
    reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    return f"cannot {doing} in {place}: {reason}"


def replace_atomically(path: Path, write, binary: bool = False) -> Path:
    """Make `path` hold what `write(f)` writes, through a temporary file beside it, fsync and rename: a reader never
    sees half a file, and a failure leaves whatever was at `path` as it was (the temporary file removed). OSError
    goes to the caller, who says it in its own words."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomically(path: Path, data, what: str) -> Path:
    """Write `data` as JSON to `path` through a temporary file, fsync and rename: a reader never sees half a file.
    A failure is one sentence naming `what` was being saved."""
    from kvchat.errors import KvchatError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise KvchatError(place_words(path.parent, exc, f"save the {what} ({path.name})")) from None
    return path
