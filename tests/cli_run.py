"""Running the real `kvchat` command in a child process, as a user or a script would."""

from __future__ import annotations

import os
import subprocess
import sys


def kvchat(*args: str, env: dict | None = None, check: bool = True, timeout: float = 300,
           stdin: str | None = None) -> subprocess.CompletedProcess:
    # KVCHAT_DEBUG off: what a user sees, never the traceback the debug switch adds.
    proc = subprocess.run([sys.executable, "-m", "kvchat.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, input=stdin, env={**os.environ, "KVCHAT_DEBUG": "", **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc
