"""Where kvchat keeps user data: one folder, $KVCHAT_HOME, or the platform's user data folder."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    home = os.environ.get("KVCHAT_HOME")
    return Path(home).expanduser() if home else Path(platformdirs.user_data_dir("kvchat", appauthor=False))
