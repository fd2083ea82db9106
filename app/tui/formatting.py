"""How the app writes sizes, ages and the status line (plain functions, so tests can check the exact words)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from kvchat.app.session.service import ChatStats

UNMEASURED = "…"  # shown instead of timings and compressed sizes when the app runs with measurements hidden


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def ago(stamp: str, now: datetime) -> str:
    """An ISO time as a short age relative to `now` ("just now", "5 min ago", "3 h ago", "2 d ago", a date)."""
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp[:16]
    seconds = (now - then).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    if seconds < 30 * 86400:
        return f"{int(seconds // 86400)} d ago"
    return then.date().isoformat()


def restore_line(stats: ChatStats, measured: bool = True) -> str:
    """The words the end-to-end test reads: how the chat's KV came back (tokens recomputed by plan beside those
    loaded, and those recomputed because they could not be loaded), and time."""
    r = stats.restore
    if r is None:
        return "not restored yet"
    total = r.tokens_loaded + r.tokens_recomputed + r.tokens_planned
    if total == 0:
        how = "nothing to restore"
        return how if stats.restore_source == "this run" else f"last restore: {how}"
    if r.tokens_recomputed == 0 and r.tokens_planned == 0:
        how = "restored from disk"
    elif r.tokens_loaded == 0:
        how = "re-prefilled from text"
    else:
        how = "restored partly from disk"
    if stats.restore_source != "this run":
        how = f"last open {how}"
    ms = f"{r.restore_ms:.1f}" if measured else UNMEASURED
    planned = f"{r.tokens_planned} recomputed by plan, " if r.tokens_planned else ""
    streams = ""
    if r.tokens_planned and r.load_ms:
        streams = (f" (recompute {r.compute_ms:.0f} / load {r.load_ms:.0f} ms)" if measured
                   else f" (recompute {UNMEASURED} / load {UNMEASURED} ms)")
    return f"{how}: {planned}{r.tokens_loaded} tokens loaded, {r.tokens_recomputed} recomputed, {ms} ms{streams}"


def kv_line(stats: ChatStats, measured: bool = True) -> str:
    on_disk = size(stats.kv_bytes) if measured else UNMEASURED
    return f"KV {on_disk} on disk / {size(stats.kv_raw_bytes)} raw"


def model_name(path: str) -> str:
    return Path(path).name if path else ""
