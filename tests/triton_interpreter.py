"""Running the test files' `interpreted` tests in a child pytest with TRITON_INTERPRET=1: triton decides between
compiling and interpreting when it is imported, so the variable must be set before the process starts.

One child serves every such file this run collected (conftest records them): starting torch and triton once
instead of once per kernel file is half the time these tests take. It starts in the background as soon as the run
has measured this machine's profile (`start`, from conftest), at the lowest CPU priority: the rest of the suite
leaves most of a second core idle (on two cores it keeps ~1.2 busy), and the child's ~90 s of interpreting fill it
instead of adding to the run's time; the tests that read its outcomes wait for it."""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The files whose `test_the_kernel_in_triton_s_interpreter` this run collected (set by conftest).
collected_files: set[Path] = set()
_ROOT = Path(__file__).resolve().parents[1]  # pytest's rootdir: the names in its report are relative to it
TIMEOUT_S = 600  # all four kernel files take ~40 s on two cores
PROFILE_ENV = "KVCHAT_TEST_EMBEDDED_PROFILE"  # the child's conftest reads the parent's profile of this machine there
profile_file: Path | None = None  # that profile (set by conftest once measured)
_outcomes: dict[Path, dict[str, list[str]]] | None = None
_report = ""
_started: tuple[subprocess.Popen, list[Path], object] | None = None  # the background child, its files, its output


def passed_in_interpreter(test_file: str) -> int:
    """Run the `interpreted` tests under the interpreter (with the other collected files' in the same child, once);
    fail on any of `test_file`'s failing, erroring or being skipped, else return how many of them passed."""
    path = Path(test_file).resolve()
    outcomes = _run_children(sorted(collected_files | {path})).get(path, {})
    # A skip would mean a TRITON_INTERPRET that did not reach triton: nothing was tested.
    bad = {k: v for k, v in outcomes.items() if k != "PASSED" and v}
    assert not bad, f"{bad}\n{_report}"
    return len(outcomes.get("PASSED", []))


def start() -> None:
    """Start the child for the collected files in the background, at the lowest priority (once; not inside a child:
    it runs its tests itself; not in a pytest-xdist worker, where the worker that runs those tests runs it)."""
    global _started
    if _started is not None or _outcomes is not None or not collected_files or os.environ.get("TRITON_INTERPRET"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker would start one: the one that runs them starts it then
        return
    files = sorted(collected_files)
    output = tempfile.TemporaryFile("w+")  # a file, not a pipe: a long report never blocks the child
    proc = subprocess.Popen(_command(files), env=_environment(), cwd=_ROOT, stdout=output, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: os.nice(19))
    atexit.register(lambda: proc.poll() is None and proc.kill())  # a run stopped early leaves no child behind
    _started = (proc, files, output)


def _command(files: list[Path]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-k", "interpreted", *map(str, files)]


def _environment() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", **({PROFILE_ENV: str(profile_file)} if profile_file else {})}


def _finish_started(files: list[Path]) -> tuple[int, str] | None:
    """The background child's exit status and output, waited for, if it ran all of `files`; else None."""
    global _started
    if _started is None:
        return None
    proc, started_files, output = _started
    if not set(files) <= set(started_files):
        return None
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    output.seek(0)
    text = output.read()
    output.close()
    _started = None
    return proc.returncode, text


def _run_children(files: list[Path]) -> dict[Path, dict[str, list[str]]]:
    global _outcomes, _report
    if _outcomes is not None and all(f in _outcomes for f in files):
        return _outcomes
    finished = _finish_started(files)
    if finished is None:
        proc = subprocess.run(_command(files), env=_environment(), cwd=_ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        (returncode, stdout), stderr = finished, ""
    # `-rA` ends with one line per test: "PASSED test_x.py::test_interpreted_y[...]".
    found: dict[Path, dict[str, list[str]]] = {f: {} for f in files}
    for outcome, name, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?:\[\d+\] )?"
                                          r"([^\s:]+\.py)(?:::(\S+))?", stdout, flags=re.M):
        found.setdefault((_ROOT / name).resolve(), {}).setdefault(outcome, []).append(test)
    if returncode not in (0, 1):  # 1: some test failed, reported per file above; else the run itself broke
        raise AssertionError(stdout[-4000:] + stderr[-2000:])
    _outcomes, _report = found, stdout[-6000:] + stderr[-2000:]
    return found
