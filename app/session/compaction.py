"""Compaction: a chat keeps on disk only the K/V some restore on this machine would load.

The restore planner recomputes a chat's first rounds, because on this machine that is as fast as loading the rest.
What every plan recomputes — with the chat's files in the page cache (the fastest load, so the shortest prefix)
and without — need not be stored. A chat only grows, and growing moves the split later, so what compaction drops
is never needed again here and nothing is ever written back. On a machine that would rather load those rounds (a
state file imported elsewhere), they are recomputed once and stored there (the restore's fallback).

The rows go in one transaction, the files they alone named after it: a crash leaves either the old rows (and
files) or the new ones with orphans the start-up sweep removes, never a row without its file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.app.session.layout import round_layouts
from kvchat.app.session.merges import parse_pairs
from kvchat.engine.kv.cross_layer import LayerPair
from kvchat.engine.restore.plan import HardwareProfile, compactable, plan_groups, plan_restore
from kvchat.storage.db import SEGMENT_KEY_BOUNDS, SEGMENT_KV, SEGMENT_MERGED, Store
from kvchat.storage.failpoints import crash_point


@dataclass
class CompactionReport:
    session_id: str
    groups: tuple[range, ...] = ()
    prefix: tuple[int, ...] = ()  # per layer group: rounds every plan recomputes there
    dropped: int = 0  # segment rows removed
    rounds: list[int] = field(default_factory=list)  # rounds that lost K/V of some layers
    bytes_dropped: int = 0  # what those rows counted on disk (files shared with other chats stay)
    bytes_left: int = 0
    skipped: str = ""  # why nothing was considered

    def line(self) -> str:
        if self.skipped:
            return f"{self.session_id}: not compacted ({self.skipped})"
        if not self.dropped:
            return f"{self.session_id}: nothing to drop (every stored round is faster to load here)"
        return (f"{self.session_id}: dropped the K/V of {len(self.rounds)} rounds ({self.dropped} segments, "
                f"{self.bytes_dropped / 2**20:,.1f} MiB; {self.bytes_left / 2**20:,.1f} MiB left): recomputing them "
                f"is faster here than loading them")


def compact_session(store: Store, sid: str, profile: HardwareProfile) -> CompactionReport:
    """Drop the stored K/V every restore plan on `profile`'s machine recomputes (layer group by layer group)."""
    info = store.session(sid)
    report = CompactionReport(info["id"])
    if info["model_fingerprint"] != profile.fingerprint:
        report.skipped = "the profile is of another model"
        return report
    rounds, rows = store.rounds(info["id"]), {}
    for seg in store.segments(info["id"]):
        rows.setdefault(seg["round_idx"], []).append(seg)
    warm, cold = (round_layouts(rounds, rows, profile.fingerprint, lambda s, r=r: r) for r in (1.0, 0.0))
    if not warm:
        return report
    groups = plan_groups(profile.n_layers, warm)
    prefix = compactable([plan_restore(warm, groups, profile), plan_restore(cold, groups, profile)])
    report.groups, report.prefix = groups, prefix
    crash_point("compact-planned")
    drop = []
    for i in range(len(warm)):
        mine = rows.get(i, [])
        gone = [s for s in mine if s["kind"] == SEGMENT_KV and _recomputed(i, s, groups, prefix)]
        kept = [s for s in mine if s["kind"] == SEGMENT_KV and s not in gone]
        for s in mine:
            # Key bounds summarize the keys of the layers from their first up: useless once those are all gone.
            if s["kind"] == SEGMENT_KEY_BOUNDS and not any(k["layer_end"] > s["layer_start"] for k in kept) and gone:
                gone.append(s)
            # A merged pair is read only for the K/V rows that name it: useless once none of those is kept.
            if s["kind"] == SEGMENT_MERGED and gone and not any(
                    LayerPair(s["layer_start"], s["layer_end"] - 1) in parse_pairs(k["merged"]) for k in kept):
                gone.append(s)
        if gone:
            report.rounds.append(i)
            drop += gone
    report.dropped = len(drop)
    report.bytes_dropped = sum(s["byte_size"] for s in drop)
    report.bytes_left = sum(s["byte_size"] for segs in rows.values() for s in segs) - report.bytes_dropped
    if drop:
        files = store.drop_segment_rows(info["id"], [(s["round_idx"], s["kind"], s["layer_start"]) for s in drop])
        crash_point("compact-rows-dropped")
        for n, name in enumerate(files):
            store.unlink_files([name])
            if n == 0:
                crash_point("compact-file-unlinked")
    return report


def _recomputed(round_idx: int, seg: dict, groups: tuple[range, ...], prefix: tuple[int, ...]) -> bool:
    """Whether every plan recomputes round `round_idx` at every layer group the segment holds."""
    return all(round_idx < k for g, k in zip(groups, prefix)
               if g.start < seg["layer_end"] and seg["layer_start"] < g.stop)
