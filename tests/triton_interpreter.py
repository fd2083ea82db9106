"""Running a test file's `interpreted` tests in a child pytest with TRITON_INTERPRET=1: triton decides between
compiling and interpreting when it is imported, so the variable must be set before the process starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def passed_in_interpreter(test_file: str, timeout: int = 400) -> int:
    """Run `test_file`'s tests named *interpreted* under the interpreter; fail on any failure or skip, else return
    how many passed."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "interpreted", str(Path(test_file))],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(test_file).parent, capture_output=True, text=True,
        timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary, summary  # a TRITON_INTERPRET that did not reach triton skips them all
    passed = re.search(r"(\d+) passed", summary)
    assert passed, summary
    return int(passed.group(1))
