"""Running the test files' `interpreted` tests in a child pytest with TRITON_INTERPRET=1: triton decides between
compiling and interpreting when it is imported, so the variable must be set before the process starts.

One child serves every such file this run collected (conftest records them): starting torch and triton once
instead of once per kernel file is half the time these tests take."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# The files whose `test_the_kernel_in_triton_s_interpreter` this run collected (set by conftest).
collected_files: set[Path] = set()
_ROOT = Path(__file__).resolve().parents[1]  # pytest's rootdir: the names in its report are relative to it
TIMEOUT_S = 600  # all four kernel files take ~40 s on two cores
PROFILE_ENV = "KVCHAT_TEST_EMBEDDED_PROFILE"  # the child's conftest reads the parent's profile of this machine there
profile_file: Path | None = None  # that profile (set by conftest once measured)
_outcomes: dict[Path, dict[str, list[str]]] | None = None
_report = ""


def passed_in_interpreter(test_file: str) -> int:
    """Run the `interpreted` tests under the interpreter (with the other collected files' in the same child, once);
    fail on any of `test_file`'s failing, erroring or being skipped, else return how many of them passed."""
    path = Path(test_file).resolve()
    outcomes = _run_children(sorted(collected_files | {path})).get(path, {})
    # A skip would mean a TRITON_INTERPRET that did not reach triton: nothing was tested.
    bad = {k: v for k, v in outcomes.items() if k != "PASSED" and v}
    assert not bad, f"{bad}\n{_report}"
    return len(outcomes.get("PASSED", []))


def _run_children(files: list[Path]) -> dict[Path, dict[str, list[str]]]:
    global _outcomes, _report
    if _outcomes is not None and all(f in _outcomes for f in files):
        return _outcomes
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-k", "interpreted", *map(str, files)],
        env={**os.environ, "TRITON_INTERPRET": "1", **({PROFILE_ENV: str(profile_file)} if profile_file else {})},
        cwd=_ROOT, capture_output=True, text=True,
        timeout=TIMEOUT_S)
    # `-rA` ends with one line per test: "PASSED test_x.py::test_interpreted_y[...]".
    found: dict[Path, dict[str, list[str]]] = {f: {} for f in files}
    for outcome, name, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?:\[\d+\] )?"
                                          r"([^\s:]+\.py)(?:::(\S+))?", proc.stdout, flags=re.M):
        found.setdefault((_ROOT / name).resolve(), {}).setdefault(outcome, []).append(test)
    if proc.returncode not in (0, 1):  # 1: some test failed, reported per file above; else the run itself broke
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-2000:])
    _outcomes, _report = found, proc.stdout[-6000:] + proc.stderr[-2000:]
    return found
