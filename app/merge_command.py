"""`kvchat merge`'s model check, bounded in time and shown with progress (app/chats.py registers the command).

A model's first merge checks its layer pairs (engine/calibrate/merge_check.py): 256 calibration chats for the
embedded model, minutes on a 2-core CPU. The command runs it under `--check-seconds` (default 45, checked between
chat runs, so that the whole command, loading the model included, ends within a minute): past the bound it stops,
stores nothing (the chat's merge setting is not changed either) and says how far it got, so that it can be run whole
on purpose (`--check-seconds 0`). Ctrl-C stops it the same way.
"""

from __future__ import annotations

from pathlib import Path

from kvchat.app.cli_progress import terminal_progress
from kvchat.app.session.progress import BudgetSpent, Reporter
from kvchat.errors import InterruptedByUser, KvchatError

STEP = "checking the model's layer pairs for merging (once per model)"
# `kvchat merge --check-seconds`' default, and the bound of `kvchat send --merge`'s check: with loading the model,
# the command ends within a minute on the 2-core CPU.
DEFAULT_CHECK_SECONDS = 45.0


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def check_merges_bounded(service, info: dict, check_seconds: float, on_progress=None):
    """The chat's model's merge check: stored, or run now within `check_seconds` (0: no bound), its progress shown
    on stderr when that is a terminal (or given to `on_progress`). Returns the MergeCalibration."""
    from kvchat.app.session.artifacts import load_merge_calibration
    from kvchat.app.session.policies import ensure_merge_calibration
    from kvchat.storage.fingerprint import model_fingerprint

    engine = service.engine(info["model_path"])
    fingerprint = model_fingerprint(Path(engine.path), service.store)
    stored = load_merge_calibration(fingerprint, engine.config.n_layers)
    if stored is not None:
        return stored
    with terminal_progress() as shown:
        report = Reporter(STEP, on_progress or shown, max_seconds=check_seconds or None)
        try:
            return ensure_merge_calibration(engine, fingerprint, report)
        except BudgetSpent as spent:
            # The total is the most the check could need: a pair that fails is given up on early, so the pace so
            # far gives no fair estimate of the whole; how far it got is said instead.
            raise KvchatError(
                f"the model's merge check did not finish within --check-seconds {check_seconds:g} (in "
                f"{_minutes(spent.elapsed_s)} it ran {spent.done:,.0f} of at most {spent.total:,.0f} calibration "
                f"chat runs); nothing was stored or merged: `kvchat merge {info['id']} --check-seconds 0` runs it "
                f"whole"
            ) from None
        except KeyboardInterrupt:
            raise InterruptedByUser("interrupted: the model's merge check stopped; nothing was stored or "
                                    "merged") from None
