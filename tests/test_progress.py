"""No silent waits (issue 42): the steps that take seconds report progress, can be cancelled or bounded, and leave
nothing half-written; a model's first chat answers on a quick hardware profile, refined later."""

from __future__ import annotations

import io
import threading

import pytest

from cli_run import kvchat
from kvchat.app.session import profile as hardware_profile
from kvchat.app.session.artifacts import load_profile, merge_calibration_path, profile_path
from kvchat.app.session.profile import device_name, ensure_profile, profile_planner, refine_profile
from kvchat.app.session.progress import BudgetSpent, Cancelled, Reporter
from kvchat.assets import DEFAULT_MODEL
from kvchat.storage.db import Store
from kvchat.storage.fingerprint import model_fingerprint


@pytest.fixture(scope="module")
def engine():
    from kvchat.engine.engine import Engine

    return Engine(DEFAULT_MODEL, device="cpu")


class Heard:
    def __init__(self):
        self.calls = []

    def __call__(self, step, done, total, eta_s):
        self.calls.append((step, done, total, eta_s))

    def check(self):
        """Reports never go backwards, and end once at done == total."""
        assert self.calls
        done = [c[1] for c in self.calls]
        assert done == sorted(done)
        assert self.calls[-1][1] == self.calls[-1][2] > 0
        assert sum(1 for c in self.calls if c[1] == c[2]) == 1


def test_a_reporter_never_goes_backwards_estimates_and_ends_at_its_total():
    now = [0.0]
    heard = Heard()
    report = Reporter("counting", heard, clock=lambda: now[0])
    for done, t in ((1, 1.0), (3, 3.0), (2, 4.0)):  # a report that went back is held where it was
        now[0] = t
        report(done, 10)
    assert [c[1] for c in heard.calls] == [1, 3, 3]
    assert heard.calls[1][3] == pytest.approx(7.0)  # 3 done in 3 s: 7 left at that rate
    report.finish()
    heard.check()


def test_a_cancelled_or_overrun_step_raises_at_its_next_report():
    cancel = threading.Event()
    report = Reporter("x", None, cancel=cancel)
    report(1, 4)
    cancel.set()
    with pytest.raises(Cancelled):
        report(2, 4)
    now = [0.0]
    bounded = Reporter("checking", None, max_seconds=10, clock=lambda: now[0])
    now[0] = 5
    bounded(1, 8)
    now[0] = 12
    with pytest.raises(BudgetSpent) as spent:
        bounded(2, 8)
    assert spent.value.estimate_s == pytest.approx(48)  # 2 of 8 in 12 s


def test_the_terminal_bar_goes_to_stderr_only_and_only_on_a_terminal(capsys):
    from kvchat.app.cli_progress import TerminalProgress, terminal_progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    with terminal_progress(err) as shown:
        shown("measuring", 1, 4, 3.0)
        assert shown.bars is not None
        shown("measuring", 4, 4, 0.0)
        assert shown.bars is None  # erased when its step ends: a reply streamed next is not drawn over
    assert "measuring" in err.getvalue()
    assert capsys.readouterr().out == ""
    with terminal_progress(io.StringIO()) as shown:  # a pipe or a file: nothing drawn
        assert shown is None
    assert isinstance(TerminalProgress(err), TerminalProgress)


def _quick_full_measurement(monkeypatch):
    """The whole measurement, kept to seconds for the test: one prefill size, the side-by-side runs faked."""
    monkeypatch.setattr(hardware_profile, "PREFILL_SIZES", (64,))
    monkeypatch.setattr(hardware_profile, "_slowdowns", lambda *args: (1.25, 1.5))
    monkeypatch.setattr(hardware_profile, "_measured", {})


def test_a_first_chat_gets_a_quick_profile_and_a_whole_one_replaces_it(engine, kvchat_home, monkeypatch):
    _quick_full_measurement(monkeypatch)
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    path = profile_path(fp, device_name(engine.device))
    path.unlink()  # a new home: no profile yet
    said, heard = [], Heard()
    quick = ensure_profile(engine, fp, notice=said.append, quick=True, on_progress=heard)
    assert quick.provisional and quick.compute_slowdown == 2.0 and len(quick.prefill_points) == 1
    assert said[0].startswith("estimating how fast this machine") and load_profile(fp, quick.device)[0] == quick
    heard.check()
    assert heard.calls[0][0] == "estimating this machine's speeds"
    assert ensure_profile(engine, fp, quick=True) == quick  # used as it is by the next chats
    planner = profile_planner(quick)

    heard = Heard()
    whole = refine_profile(engine, fp, on_progress=heard)
    heard.check()
    assert not whole.provisional and (whole.compute_slowdown, whole.load_slowdown) == (1.25, 1.5)
    assert load_profile(fp, quick.device)[0] == whole
    assert planner.current() is whole  # a chat opened on the estimate plans, and learns, on the measurement
    assert refine_profile(engine, fp) is None  # nothing left to refine
    assert ensure_profile(engine, fp, quick=True) == whole

    # `kvchat profile` (not quick) measures a stored estimate whole
    hardware_profile.save_profile(quick)
    monkeypatch.setattr(hardware_profile, "_measured", {})
    said.clear()
    again = ensure_profile(engine, fp, notice=said.append)
    assert not again.provisional and said == ["the profile is a quick estimate; measuring it again…"]


def test_a_cancelled_refinement_leaves_the_estimate_and_no_probe_files(engine, kvchat_home, monkeypatch):
    _quick_full_measurement(monkeypatch)
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    path = profile_path(fp, device_name(engine.device))
    path.unlink()
    quick = ensure_profile(engine, fp, quick=True)
    cancel = threading.Event()

    def cancel_half_way(step, done, total, eta_s):
        if done >= 3:  # the probe's files are written by then
            cancel.set()

    with pytest.raises(Cancelled):
        refine_profile(engine, fp, on_progress=cancel_half_way, cancel=cancel)
    assert load_profile(fp, quick.device)[0] == quick
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the probe's files are gone


def test_kvchat_merge_respects_its_bound_and_stores_nothing_past_it(monkeypatch, tmp_path):
    import time

    from kvchat.app.session import artifacts, policies

    # A model without a shipped check (the embedded model's is shipped: the test below)
    monkeypatch.setattr(artifacts, "SHIPPED_MERGE_CALIBRATION", tmp_path / "none.merges.json")

    def slow_check(engine, fingerprint, chats, progress):  # the real check's first report, after a slow chat
        time.sleep(0.05)
        progress(1, chats * 9)
        raise AssertionError("the check went on past its bound")

    monkeypatch.setattr(policies, "calibrate_merges", slow_check)
    sid = kvchat("new", "--title", "bounded").stdout.strip()
    out = kvchat("merge", sid, "--check-seconds", "0.01", check=False)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("kvchat: error: the model's merge check did not finish within --check-seconds "
                                 "0.01 (in ")
    assert " of at most 2,304 calibration chat runs); nothing was stored or merged: " in out.stderr
    assert out.stderr.count("\n") == 1 and f"`kvchat merge {sid} --check-seconds 0` runs it whole" in out.stderr
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    assert not merge_calibration_path(fp).exists()
    assert Store().session(sid)["settings"].get("merge", 0) == 0  # the chat's setting is not changed either
    # `send --merge` runs the check under the same bound (made tiny here), before its message is committed
    from kvchat.app import chats

    monkeypatch.setattr(chats, "DEFAULT_CHECK_SECONDS", 0.01)
    out = kvchat("send", sid, "My name is Ada.", "--merge", "0.5", "--device", "cpu", check=False)
    assert out.returncode == 1 and "the model's merge check did not finish within --check-seconds " in out.stderr
    assert Store().rounds(sid) == [] and Store().session(sid)["settings"].get("merge", 0) == 0


def test_the_embedded_model_s_merge_check_is_shipped_with_it():
    """`kvchat merge` on the embedded model in a new home takes the check made when the model was shipped (the
    whole check: 256 chats, minutes on 2 cores), not a new one: the fingerprint in the shipped file is the model's."""
    import json
    import time

    from kvchat.app.session.artifacts import SHIPPED_MERGE_CALIBRATION, load_merge_calibration

    fp = model_fingerprint(DEFAULT_MODEL, Store())
    shipped = json.loads(SHIPPED_MERGE_CALIBRATION.read_text())
    assert shipped["fingerprint"] == fp and shipped["chats"] == 256
    assert load_merge_calibration(fp, 8) is not None and not merge_calibration_path(fp).exists()
    assert load_merge_calibration("f" * 64, 8) is None  # another model's is not taken from it
    sid = kvchat("new", "--title", "merged").stdout.strip()
    kvchat("send", sid, "My name is Ada.", "--device", "cpu")
    started = time.monotonic()
    out = kvchat("merge", sid, "--device", "cpu", check=False)
    assert time.monotonic() - started < 30, "the shipped check was not used"
    assert out.returncode == 0 and "rounds stored with layers" in out.stdout, out.stderr
    if not shipped["accepted"]:
        assert "(no layer pair of this model passed its check: its chats stay whole)" in out.stdout


async def test_the_app_refines_a_quick_profile_when_idle_with_a_progress_bar(monkeypatch):
    from dataclasses import replace

    from textual.widgets import ProgressBar

    from kvchat.app.tui import chat_steps
    from tui_support import make_app, shared_engine, wait_for

    _quick_full_measurement(monkeypatch)
    monkeypatch.setattr(chat_steps, "IDLE_CHECK_S", 0.2)
    app = make_app()  # stores the whole profile; this home then holds only a quick estimate
    engine = shared_engine()
    fp = model_fingerprint(DEFAULT_MODEL, Store())
    path = profile_path(fp, device_name(engine.device))
    estimate = replace(load_profile(fp, device_name(engine.device))[0], provisional=True)
    hardware_profile.save_profile(estimate)
    monkeypatch.setattr(hardware_profile, "_measured", {})
    bars = []
    real = chat_steps.ChatSteps._step_progress

    def seen(self, step, done, total, eta_s):
        real(self, step, done, total, eta_s)
        if done < total:
            bars.append((step, self.query_one("#step-bar", ProgressBar).progress, self.query_one("#step-progress")
                         .display))

    monkeypatch.setattr(chat_steps.ChatSteps, "_step_progress", seen)
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: not load_profile(fp, estimate.device)[0].provisional, what="the refinement")
        await wait_for(pilot, lambda: not app.screen.query_one("#step-progress").display, what="the bar hidden")
    assert bars and bars[0][0] == "measuring this machine's speeds" and all(shown for *_, shown in bars)
    assert path.exists() and load_profile(fp, estimate.device)[0].compute_slowdown == 1.25
    app.backend.close()


def test_assembling_a_known_model_reports_its_bytes_and_a_cancel_leaves_no_file(tmp_path, monkeypatch):
    from kvchat.storage import known_models
    from kvchat.storage.known_models import ensure_assembled
    from test_known_models import fake_model

    monkeypatch.setattr(known_models, "_BLOCK", 1000)
    model = fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 2996, b"b" * 5000])

    def interrupt(step, done, total, eta_s):
        if done >= 4000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_assembled(model, tmp_path / "models", on_progress=interrupt)
    assert not any((tmp_path / "models").iterdir())  # nothing half-written
    heard = Heard()
    ensure_assembled(model, tmp_path / "models", on_progress=heard)
    heard.check()
    assert heard.calls[0][0] == "assembling tiny (first use)" and heard.calls[-1][1:3] == (8000, 8000)


def test_ctrl_c_while_measuring_the_profile_exits_130_and_keeps_the_stored_one(kvchat_home, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hardware_profile, "measure_profile", interrupted)
    path = next((kvchat_home / "profiles").iterdir())
    before = path.read_text()
    out = kvchat("profile", "--redo", check=False)
    assert out.returncode == 130 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == ("kvchat: error: interrupted: the profile was not measured; the stored one "
                                           "(if any) is as it was")
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == [path.name]
