"""Running the real `kvchat` command as a user or a script would: its arguments, stdin, exit status, stdout, stderr.

By default in this process, through click's runner: the same command object and error handling, without the ~2 s
of importing torch again that a child process pays (the suite runs some eighty commands). Tests about processes
themselves — a crash point that kills the process, a chat resumed in new processes, a hang a timeout must catch —
pass `process=True` (a crash point implies it)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback


def kvchat(*args: str, env: dict | None = None, check: bool = True, timeout: float = 300,
           stdin: str | None = None, process: bool = False) -> subprocess.CompletedProcess:
    # KVCHAT_DEBUG off: what a user sees, never the traceback the debug switch adds.
    env = {"KVCHAT_DEBUG": "", **(env or {})}
    if process or "KVCHAT_CRASH_AT" in env:
        proc = subprocess.run([sys.executable, "-m", "kvchat.app.cli", *args], capture_output=True, text=True,
                              timeout=timeout, input=stdin, env={**os.environ, **env})
    else:
        proc = _in_process(list(args), env, stdin)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _in_process(args: list[str], env: dict, stdin: str | None) -> subprocess.CompletedProcess:
    from click.testing import CliRunner

    from kvchat.app.session import profile as hardware_profile
    from kvchat.app.cli import main

    hardware_profile._measured.clear()  # as in a new process: the profile comes from this KVCHAT_HOME's file
    result = CliRunner().invoke(main, args, input=stdin, env=env, catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # An exception that got past the command's own handling would have been a traceback in front of the user:
        # show it where the tests look for one.
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(["kvchat", *args], result.exit_code, result.stdout, stderr)
