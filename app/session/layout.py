"""How a chat's rounds lie in the store: the layer groups a round is stored as, each round as the restore planner
sees it, and what one round's stored segment rows can supply.

Separate from the session because several parts read it without a session: the restore run, the upper tier's
background reads, compaction (round_layouts) and this machine's profile (storage_groups, Planner) all agree
through these functions on what "stored as the app stores it" means.
"""

from __future__ import annotations

from typing import Callable

from kvchat.app.session.merges import parse_pairs
from kvchat.engine.kv.cross_layer import LayerPair
from kvchat.engine.restore.plan import RestorePlan, RoundLayout, StoredSegment, load_everything, plan_groups
from kvchat.storage.db import SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store
from kvchat.storage.pagecache import resident_fraction
from kvchat.storage.segments import token_rows_fit

# (rounds as stored, layer groups, groups loaded off the critical path) -> what to recompute and what to load
Planner = Callable[[list[RoundLayout], tuple[range, ...], tuple[int, ...]], RestorePlan]

# A round's K/V of all layers is stored as this many bytes per 512 tokens, at most, per file: a big model's rounds
# become several files (layer groups), which the restore reads and decompresses side by side, and which its plan
# and compaction can treat apart (lower layers recomputed, upper ones loaded).
GROUP_BYTES_PER_512_TOKENS = 16 << 20
MAX_GROUPS = 4

# Why a round with no K/V rows is recomputed: expected (a text-only or compacted round, a save that failed and said
# so then), unlike K/V that is stored but cannot be used.
NO_KV_STORED = "no K/V stored"


def round_layouts(rounds: list[RoundRow], rows: dict[int, list[dict]], fingerprint: str,
                  resident: Callable[[dict], float]) -> list[RoundLayout]:
    """Each round as the restore planner sees it: its K/V segment rows of this model and the round's token span,
    each with the share of its file in the page cache (`resident(row)`)."""
    layouts = []
    for r in rounds:
        usable = [s for s in rows.get(r.idx, []) if s["kind"] == SEGMENT_KV and s["model_fingerprint"] == fingerprint
                  and (s["token_start"], s["token_end"]) == (r.token_start, r.token_end)]
        layouts.append(RoundLayout(r.token_end - r.token_start, tuple(
            StoredSegment(range(s["layer_start"], s["layer_end"]), s["byte_size"], s["raw_size"], resident(s))
            for s in usable)))
    return layouts


def storage_groups(n_layers: int, kv_bytes_per_token: int) -> tuple[range, ...]:
    """The layer groups a round of the full cache is stored as (one group for small models)."""
    n = max(1, min(MAX_GROUPS, n_layers, round(kv_bytes_per_token * 512 / GROUP_BYTES_PER_512_TOKENS)))
    cuts = [round(i * n_layers / n) for i in range(n + 1)]
    return tuple(range(a, b) for a, b in zip(cuts, cuts[1:]))


def chat_groups(engine, split: int | None) -> tuple[range, ...]:
    """The layer groups each round of a chat is stored as: the full cache's groups (`split` None), or a tiered
    chat's lower tier, layers [0, split)."""
    if split is not None:
        return (range(split),)
    cfg = engine.config
    return storage_groups(cfg.n_layers, cfg.kv_bytes_per_token(engine.model.dtype.itemsize))


def plan_for_chat(rounds: list[RoundRow], rows: dict[int, list[dict]], store: Store, fingerprint: str,
                  planner: Planner | None, n_layers: int, split: int | None) -> RestorePlan:
    """What to recompute and what to load: the planner's choice from the chat's stored segment `rows` (those of
    this model and the round's token span count), or, without a planner, load everything stored. `split`: a tiered
    chat's first upper layer, whose groups are loaded in the background (None: the full cache)."""
    resident = (lambda s: resident_fraction(store.kv_dir / s["file"])) if planner else (lambda s: 0.0)
    layouts = round_layouts(rounds, rows, fingerprint, resident)
    groups = plan_groups(n_layers, layouts, (split,) if split is not None else ())
    background = tuple(g for g, grp in enumerate(groups) if split is not None and grp.start >= split)
    if planner is None:
        return load_everything(layouts, groups, background)
    return planner(layouts, groups, background)


def segment_files(by_round: dict[int, list[dict]], n: int) -> tuple[list[list[str]], list[int]]:
    """For a reader of rounds [0, n) in order (storage.prefetch.SegmentPrefetcher): each round's files and raw
    bytes."""
    groups = [[seg["file"] for seg in by_round.get(i, [])] for i in range(n)]
    sizes = [sum(seg["raw_size"] for seg in by_round.get(i, [])) for i in range(n)]
    return groups, sizes


def listed_pairs(kv: list[dict]) -> list[LayerPair]:
    """The layer pairs K/V rows name as stored merged (their `merged` column)."""
    return sorted({p for s in kv for p in parse_pairs(s.get("merged") or "")})


def unusable(segments: list[dict], layers: range, fingerprint: str, ignore_merges: bool) -> str | None:
    """Why `segments` (one round's rows) cannot supply K/V of every layer in `layers` for the model of
    `fingerprint`, or None. `ignore_merges`: rows holding merged layers cannot (merges are being undone)."""
    kv = [s for s in segments if s["kind"] == SEGMENT_KV]
    covered = sorted((s["layer_start"], s["layer_end"]) for s in kv
                     if s["layer_start"] < layers.stop and layers.start < s["layer_end"])
    if not covered:
        return NO_KV_STORED
    expect = layers.start
    for lo, hi in covered:
        if lo > expect:
            return f"K/V of layers {expect}..{lo - 1} missing"
        expect = max(expect, hi)
    if expect < layers.stop:
        return f"K/V of layers {expect}..{layers.stop - 1} missing"
    if any(seg["model_fingerprint"] != fingerprint for seg in segments):
        return "K/V belongs to another model"
    return _merges_unusable(kv, segments, layers, ignore_merges)


def _merges_unusable(kv: list[dict], segments: list[dict], layers: range, ignore_merges: bool) -> str | None:
    """Why the layer pairs the K/V rows hold merged cannot be restored in `layers`, or None."""
    # every pair with a layer from `layers` up: a tiered restore takes the upper layers of a segment that holds
    # them too, so a pair above the split must be there as well
    wanted = [p for p in listed_pairs(kv) if p.high >= layers.start]
    if not wanted:
        return None
    if ignore_merges:
        return f"stored with layers {', '.join(map(str, wanted))} merged (undoing merges)"
    held = {(s["layer_start"], s["layer_end"]) for s in segments if s["kind"] == SEGMENT_MERGED}
    missing = [p for p in wanted if (p.low, p.high + 1) not in held]
    if missing:
        return f"merged K/V of layers {', '.join(map(str, missing))} missing"
    return None


def hold_span(segments: list[dict], loaded: list[tuple], start: int, end: int) -> bool:
    """Whether every loaded segment (header, data) holds tokens [start, end): one row per token (K/V), or as many
    and the retained ones after them (a merged pair)."""
    return all((header.token_start, header.token_end) == (start, end) and token_rows_fit(
        seg["kind"], header.shape[3], end - start) for seg, (header, _) in zip(segments, loaded))
