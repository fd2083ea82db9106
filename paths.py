"""Where kvchat keeps user data: one folder, $KVCHAT_HOME, or the platform's user data folder; and how small JSON
files there are written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    home = os.environ.get("KVCHAT_HOME")
    return Path(home).expanduser() if home else Path(platformdirs.user_data_dir("kvchat", appauthor=False))


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
        raise KvchatError(f"cannot save the {what} to {path}: {exc.strerror or exc}") from None
    return path
