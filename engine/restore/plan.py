"""Planning a chat's restore (Krul §6): recompute the front of the history while loading its back.

A prefix of the chat attends only to itself, so recomputing it is exact and needs nothing from disk; the rest is
read, verified, decompressed and copied to the device. Both run at once, so a restore takes about the longer of
the two, and the split is chosen where they finish together (Krul's |T_C - T_L|), from this machine's measured
speeds (`HardwareProfile`).

The plan is per layer group (`RestorePlan.prefix[g]`: rounds [0, prefix[g]) are recomputed at group g's layers,
the rest loaded). The recomputed span may shrink with depth but never grow (Krul Eq. 4/5): group g + 1 runs on the
hidden states group g produced, so it can only recompute tokens group g recomputed. A pyramid splits rounds by
layers, the "within a round" refinement: their lower groups recomputed, their upper groups loaded.

Pure arithmetic on sizes and rates: no I/O, no torch. The app measures the profile and gathers the chat's layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from itertools import accumulate

PROFILE_VERSION = 2


@dataclass(frozen=True)
class HardwareProfile:
    """How fast this machine recomputes and loads a model's K/V, measured once per model and device."""

    fingerprint: str  # the model's (sha256 of its file and our KV format)
    device: str  # e.g. "cuda NVIDIA H100 80GB HBM3" or "cpu x86_64 2 cores": a different device is re-measured
    n_layers: int
    dtype: str
    prefill_a: float  # seconds per token of a prefill from position 0 through every layer ...
    prefill_b: float  # ... plus seconds per token squared (attention): T(n) = a n + b n^2
    disk_read_mb_s: float  # segment files read with the page cache dropped (many readers at once)
    cache_read_mb_s: float  # the same files read again from the page cache
    decode_mb_s: float  # verify (sha256) and decompress one segment on one thread, MB/s of K/V produced
    decode_threads: int  # threads the restore decodes segments on
    h2d_gb_s: float | None  # decoded K/V to the device through the staging buffers (None: the CPU)
    # How much slower each stream runs while the other runs too (1: not at all; 2: as if they took turns, as on a
    # CPU whose cores both need), measured with the probe's files and refined by the restores seen since.
    compute_slowdown: float
    load_slowdown: float
    segment_overhead_ms: float = 0.0  # what one more file costs beyond its bytes (open, read, hash, decompress)
    kv_bytes_per_token: int = 0  # raw K/V of one token, all layers (for plans of chats not stored yet)
    stored_over_raw: float = 1.0  # bytes on disk per raw byte (byte planes + zstd)
    date: str = ""
    prefill_points: list[list[float]] = field(default_factory=list)  # [tokens, seconds] measured
    # Restores that ran both streams: [recompute stream, load stream] time over what the rates alone predict
    # (the latest few; their medians stand in for the measured slowdowns).
    observed: list[list[float]] = field(default_factory=list)
    version: int = PROFILE_VERSION
    # A quick estimate (one small prefill, a few files, the side-by-side slowdowns assumed), used at once on a
    # model's first chat and replaced by a whole measurement later (`kvchat profile`, the app when idle).
    provisional: bool = False

    @property
    def slowdowns(self) -> tuple[float, float]:
        """(compute, load) factors the planner uses: the restores' own once there are a few."""
        if len(self.observed) < OBSERVED_NEEDED:
            return self.compute_slowdown, self.load_slowdown
        cs = sorted(o[0] for o in self.observed)
        ls = sorted(o[1] for o in self.observed)
        return cs[len(cs) // 2], ls[len(ls) // 2]

    def both_seconds(self, compute: float, load: float) -> float:
        """Both streams at once: each slowed while the other runs, the longer one alone at full speed after."""
        if compute <= 0 or load <= 0:
            return compute + load
        sc, sl = self.slowdowns
        if compute * sc <= load * sl:
            together = compute * sc
            return together + load - together / sl
        together = load * sl
        return together + compute - together / sc

    def prefill_seconds(self, tokens: int, layer_share: float = 1.0) -> float:
        """Recomputing `tokens` from position 0 through `layer_share` of the layers."""
        return layer_share * (self.prefill_a * tokens + self.prefill_b * tokens * tokens)

    def appended_seconds(self, start: int, tokens: int, layer_share: float = 1.0) -> float:
        """Recomputing `tokens` that follow `start` cached ones (a fallback round: it attends to all before it)."""
        end = start + tokens
        return layer_share * (self.prefill_a * tokens + self.prefill_b * (end * end - start * start))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        """Raises ValueError (or TypeError) on anything that is not a profile this version wrote."""
        if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version') if isinstance(d, dict) else None!r} is not "
                             f"{PROFILE_VERSION}")
        p = cls(**d)
        rates = (p.prefill_a, p.prefill_b, p.disk_read_mb_s, p.cache_read_mb_s, p.decode_mb_s, p.compute_slowdown,
                 p.load_slowdown, p.segment_overhead_ms)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in rates):
            raise ValueError("a rate is negative or not a number")
        if p.prefill_a + p.prefill_b <= 0 or min(p.disk_read_mb_s, p.cache_read_mb_s, p.decode_mb_s) <= 0:
            raise ValueError("a rate is zero")
        if p.h2d_gb_s is not None and not (isinstance(p.h2d_gb_s, (int, float)) and p.h2d_gb_s > 0):
            raise ValueError("the host-to-device rate is not positive")
        if not (isinstance(p.decode_threads, int) and p.decode_threads >= 1 and p.compute_slowdown > 0
                and p.load_slowdown > 0 and isinstance(p.n_layers, int) and p.n_layers >= 1):
            raise ValueError("threads, slowdowns or layers out of range")
        if not isinstance(p.provisional, bool):
            raise ValueError("provisional is not true or false")
        if not all(isinstance(o, list) and len(o) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in o)
                   for o in p.observed):
            raise ValueError("an observed restore is malformed")
        return p


@dataclass(frozen=True)
class StoredSegment:
    """One stored K/V segment of a round, as the planner sees it."""

    layers: range
    disk_bytes: int
    raw_bytes: int
    resident: float = 0.0  # the share of its bytes in the OS page cache (a warm read)


@dataclass(frozen=True)
class RoundLayout:
    """A closed round: its tokens and the usable segments stored for it (any layers may be absent)."""

    tokens: int
    segments: tuple[StoredSegment, ...] = ()


@dataclass(frozen=True)
class Prediction:
    compute_s: float  # the recompute stream alone: the planned prefix
    load_s: float  # the load stream alone: read, verify, decompress, copy to the device
    fallback_s: float  # rounds that must be recomputed after loading (absent beyond the prefix)
    total_s: float


@dataclass(frozen=True)
class RestorePlan:
    groups: tuple[range, ...]  # layer groups, bottom to top, covering [0, n_layers)
    prefix: tuple[int, ...]  # per group: rounds [0, prefix[g]) are recomputed at its layers
    predicted: Prediction | None = None
    background: tuple[int, ...] = ()  # groups loaded off the restore's critical path (Round Attention's upper tier)
    # Per group: rounds from here up to prefix[g] are recomputed only because nothing is stored for them (compacted
    # on a machine that recomputes more); loading them would be faster here, so the restore stores them. Worked out
    # by `store_back` (None: none such) once asked for, after the restore has queued its work: on its critical path
    # those plans would cost a 32k chat tens of ms.
    store_back: Callable[[], tuple[int, ...]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        check_pyramid(self.groups, self.prefix)

    @cached_property
    def store_from(self) -> tuple[int, ...]:
        return self.prefix if self.store_back is None else self.store_back()

    def recomputed_layers(self, round_idx: int) -> range:
        """The layers at which round `round_idx` is recomputed by plan: a bottom range (possibly empty)."""
        top = 0
        for g, layers in enumerate(self.groups):
            if round_idx < self.prefix[g]:
                top = layers.stop
        return range(0, top)

    def summary(self, ends: list[int]) -> str:
        """e.g. "recompute rounds 0-24 (16,384 tokens)", or per run of layer groups when their prefixes differ."""
        def rounds(k: int) -> str:
            if k == 0:
                return "nothing"
            return f"{'round 0' if k == 1 else f'rounds 0-{k - 1}'} ({ends[k - 1]:,} tokens)"

        if len(set(self.prefix)) == 1:
            return f"recompute {rounds(self.prefix[0])}"
        runs: list[tuple[int, int, int]] = []  # (first layer, last layer, rounds): neighbouring groups merged
        for g, k in zip(self.groups, self.prefix):
            if runs and runs[-1][2] == k:
                runs[-1] = (runs[-1][0], g.stop - 1, k)
            else:
                runs.append((g.start, g.stop - 1, k))
        return "recompute " + ", ".join(f"layers {a}-{b}: {rounds(k)}" for a, b, k in runs)


def check_pyramid(groups: tuple[range, ...], prefix: tuple[int, ...]) -> None:
    """Refuse a plan whose recomputed span grows with depth: a layer can only run on hidden states the layer
    below it produced (Krul Eq. 4)."""
    if len(groups) != len(prefix) or not groups:
        raise ValueError(f"a plan needs one prefix per layer group ({len(groups)} groups, {len(prefix)} prefixes)")
    if groups[0].start != 0 or any(a.stop != b.start for a, b in zip(groups, groups[1:])):
        raise ValueError(f"layer groups {[(g.start, g.stop) for g in groups]} do not tile the layers from 0")
    if any(k < 0 for k in prefix):
        raise ValueError(f"a recomputed prefix cannot be negative: {prefix}")
    for g in range(1, len(prefix)):
        if prefix[g] > prefix[g - 1]:
            raise ValueError(f"invalid pyramid: layers {groups[g].start}-{groups[g].stop - 1} would recompute "
                             f"{prefix[g]} rounds on hidden states of only {prefix[g - 1]} (the recomputed span "
                             f"may shrink with depth, never grow)")


def plan_groups(n_layers: int, rounds: list[RoundLayout], cuts: tuple[int, ...] = ()) -> tuple[range, ...]:
    """The finest layer groups the stored segments (and extra `cuts`, e.g. the round policy's split) allow."""
    bounds = {0, n_layers, *cuts}
    for r in rounds:
        for s in r.segments:
            bounds.update((s.layers.start, s.layers.stop))
    edges = sorted(b for b in bounds if 0 <= b <= n_layers)
    return tuple(range(a, b) for a, b in zip(edges, edges[1:]))


class _Costs:
    """Per layer group, suffix sums over rounds of what loading costs, so each candidate plan costs O(groups)."""

    def __init__(self, rounds: list[RoundLayout], groups: tuple[range, ...], profile: HardwareProfile,
                 background: frozenset[int]):
        n, G = len(rounds), len(groups)
        self.n, self.G, self.profile = n, G, profile
        self.starts = [0, *accumulate(r.tokens for r in rounds)]
        L = groups[-1].stop
        self.share = [len(g) / L for g in groups]
        self.critical_share = sum(s for g, s in enumerate(self.share) if g not in background)
        def deepest(layers: range) -> int:
            """The group that decides whether a segment is read: the deepest it holds (it loads the most rounds),
            of those on the critical path when it holds any (a segment with lower and upper layers is read at
            restore for its lower ones)."""
            held = [g for g, grp in enumerate(groups) if grp.start < layers.stop and layers.start < grp.stop]
            return max([g for g in held if g not in background] or held)

        disk = [[0.0] * (n + 1) for _ in range(G)]
        cache = [[0.0] * (n + 1) for _ in range(G)]
        raw = [[0.0] * (n + 1) for _ in range(G)]
        biggest = [[0.0] * (n + 1) for _ in range(G)]
        files = [[0.0] * (n + 1) for _ in range(G)]
        fallback = [[0.0] * (n + 1) for _ in range(G)]
        self.leading_absent = [0] * G  # per group: how many rounds from the first have nothing stored there
        leading = [True] * G
        for j, r in enumerate(rounds):
            covered = [False] * G
            for s in r.segments:
                # A segment spanning several groups is read whole if any of them loads it; with a pyramid the
                # deepest of them loads the most rounds, so it decides.
                g = deepest(s.layers)
                for h, grp in enumerate(groups):
                    if grp.start < s.layers.stop and s.layers.start < grp.stop:
                        covered[h] = True
                if g in background:
                    continue
                disk[g][j] += s.disk_bytes * (1 - s.resident)
                cache[g][j] += s.disk_bytes * s.resident
                raw[g][j] += s.raw_bytes
                files[g][j] += 1
                biggest[g][j] = max(biggest[g][j], s.raw_bytes)
            absent = [h for h in range(G) if not covered[h]]
            for h in range(G):
                leading[h] = leading[h] and not covered[h]
                if leading[h]:
                    self.leading_absent[h] = j + 1
            critical_absent = [h for h in absent if h not in background]
            if critical_absent:
                # Missing beyond the prefix: recomputed after everything before it is in (all critical layers).
                fallback[max(critical_absent)][j] += profile.appended_seconds(self.starts[j], r.tokens,
                                                                              self.critical_share)
        for table, combine in ((disk, float.__add__), (cache, float.__add__), (raw, float.__add__),
                               (files, float.__add__), (fallback, float.__add__), (biggest, max)):
            for row in table:
                for j in range(n - 1, -1, -1):
                    row[j] = combine(row[j], row[j + 1])
        self.disk, self.cache, self.raw, self.biggest, self.fallback = disk, cache, raw, biggest, fallback
        self.files = files
        # Forced: a group's leading absent rounds must be recomputed there, and so at every group below it.
        forced, most = [0] * G, 0
        for g in range(G - 1, -1, -1):
            most = max(most, self.leading_absent[g])
            forced[g] = most
        self.forced = forced

    def predict(self, prefix: tuple[int, ...]) -> Prediction:
        p = self.profile
        compute = sum(p.prefill_seconds(self.starts[k], share) for k, share in zip(prefix, self.share))
        disk = sum(self.disk[g][k] for g, k in enumerate(prefix)) / (p.disk_read_mb_s * 1e6)
        disk += sum(self.cache[g][k] for g, k in enumerate(prefix)) / (p.cache_read_mb_s * 1e6)
        raw = sum(self.raw[g][k] for g, k in enumerate(prefix))
        biggest = max(self.biggest[g][k] for g, k in enumerate(prefix))
        files = sum(self.files[g][k] for g, k in enumerate(prefix))
        rate, overhead = p.decode_mb_s * 1e6, p.segment_overhead_ms / 1000
        # Files decode side by side on the decode threads; the largest file is one thread's alone.
        decode = max((raw / rate + files * overhead) / p.decode_threads, (biggest / rate + overhead) if files else 0)
        h2d = raw / (p.h2d_gb_s * 1e9) if p.h2d_gb_s else 0.0
        load = max(disk, decode, h2d)
        fallback = sum(self.fallback[g][k] for g, k in enumerate(prefix))
        return Prediction(compute, load, fallback, p.both_seconds(compute, load) + fallback)


STORE_BACK_GAIN = 0.2  # the predicted restore must be this much shorter with them stored for absent rounds to be


def plan_restore(rounds: list[RoundLayout], groups: tuple[range, ...], profile: HardwareProfile,
                 background: tuple[int, ...] = (), worth: float = 0.03) -> RestorePlan:
    """The plan with the shortest predicted restore: a split at every round boundary, and each pyramid of two
    levels (the boundary round recomputed below a layer group and loaded above it; or the groups above it
    recomputing nothing), kept only when it beats the best flat split by more than `worth` (a pyramid reads rounds
    for part of their layers). Groups in `background`
    load off the critical path (they cost nothing here; recomputing them still does). A group's leading rounds
    with nothing stored must be recomputed (compacted chats); other absent rounds are recomputed after loading."""
    costs = _Costs(rounds, groups, profile, frozenset(background))
    n, G = costs.n, costs.G

    def shaped(prefix: list[int]) -> tuple[int, ...]:
        return tuple(max(k, f) for k, f in zip(prefix, costs.forced))

    best_flat, best_step = None, None
    for k in range(n + 1):
        flat = shaped([k] * G)
        cand = (costs.predict(flat).total_s, sum(flat), flat)
        best_flat = min(best_flat, cand) if best_flat else cand
        for j in range(1, G):
            # The groups below j recompute k rounds and those above: one round fewer (the boundary round split by
            # layers), or none (e.g. Round Attention's upper tier, loaded later anyway).
            for step in ([k + 1] * j + [k] * (G - j), [k] * j + [0] * (G - j)):
                if max(step) > n:
                    continue
                step = shaped(step)
                cand = (costs.predict(step).total_s, sum(step), step)
                best_step = min(best_step, cand) if best_step else cand
    chosen = best_flat
    if best_step is not None and best_step[0] < best_flat[0] * (1 - worth):
        chosen = best_step
    store_back = None
    if any(costs.forced) and profile.kv_bytes_per_token:
        store_back = lambda: _store_back(rounds, groups, profile, background, worth, costs, chosen[2])  # noqa: E731
    return RestorePlan(groups, chosen[2], costs.predict(chosen[2]), tuple(background), store_back)


def _store_back(rounds: list[RoundLayout], groups: tuple[range, ...], profile: HardwareProfile,
                background: tuple[int, ...], worth: float, costs: _Costs, prefix: tuple[int, ...]) -> tuple[int, ...]:
    """Rounds recomputed only because nothing is stored for them: were they stored, would this machine keep them?
    By compaction's own rule (what its warm and its cold plans both recompute need not be kept), and only for a
    large gain now: a chat compacted on this machine must never be stored back here (estimates of a chat's sizes
    differ by some percent from its real ones; once, on the H100, that was enough), while one compacted where
    loading is much slower gains far more."""
    def filled(resident: float | None) -> list[RoundLayout]:
        return [_filled(r, groups, profile, resident) for r in rounds]

    now = plan_restore(filled(None), groups, profile, background, worth)
    if now.predicted.total_s >= (1 - STORE_BACK_GAIN) * costs.predict(prefix).total_s:
        return prefix
    wanted = compactable([plan_restore(filled(res), groups, profile, background, worth) for res in (0.0, 1.0)])
    return tuple(min(k, w) for k, w in zip(prefix, wanted))


def _filled(r: RoundLayout, groups: tuple[range, ...], profile: HardwareProfile,
            resident: float | None) -> RoundLayout:
    """The round with every layer group stored (sized from the profile where nothing is), all of it `resident`
    in the page cache, or (None) the stored parts as they are and the others cold."""
    segs = [s if resident is None else replace(s, resident=resident) for s in r.segments]
    for g in groups:
        if not any(s.layers.start < g.stop and g.start < s.layers.stop for s in segs):
            raw = r.tokens * profile.kv_bytes_per_token * len(g) // profile.n_layers
            segs.append(StoredSegment(g, int(raw * profile.stored_over_raw), raw, resident or 0.0))
    return RoundLayout(r.tokens, tuple(segs))


def fixed_plan(rounds: list[RoundLayout], groups: tuple[range, ...], prefix: tuple[int, ...],
               profile: HardwareProfile | None = None, background: tuple[int, ...] = ()) -> RestorePlan:
    """A plan with the given prefixes (tests, benchmarks, `load everything`), predicted when a profile is given."""
    predicted = None
    if profile is not None:
        predicted = _Costs(rounds, groups, profile, frozenset(background)).predict(prefix)
    return RestorePlan(groups, tuple(prefix), predicted, tuple(background))


def load_everything(rounds: list[RoundLayout], groups: tuple[range, ...], background: tuple[int, ...] = ()
                    ) -> RestorePlan:
    """What a restore without a profile does: load every stored part; recompute only what is not stored (a
    compacted chat's leading rounds by plan, anything else missing after loading)."""
    leading = [0] * len(groups)
    for g, grp in enumerate(groups):
        for r in rounds:
            if any(s.layers.start < grp.stop and grp.start < s.layers.stop for s in r.segments):
                break
            leading[g] += 1
    prefix = list(accumulate(reversed(leading), max))[::-1]
    return RestorePlan(groups, tuple(prefix), None, tuple(background))


def compactable(plans: list[RestorePlan]) -> tuple[int, ...]:
    """Per layer group, the rounds every one of `plans` recomputes (the pointwise minimum: still a pyramid)."""
    return tuple(min(k) for k in zip(*(p.prefix for p in plans)))


def best_overlap_seconds(recompute_all_s: float, load_all_s: float, linear_share: float) -> float:
    """The shortest restore any split of a chat can take, whatever the planner: the two streams overlapping
    perfectly and neither slowing the other, nothing else costing time. Recomputing the first x of the chat costs
    recompute_all_s (linear_share x + (1 - linear_share) x^2) (attention is quadratic, so a prefix costs less than
    its share), loading the rest load_all_s (1 - x); the best split makes them equal."""
    r, load, a = recompute_all_s, load_all_s, min(1.0, max(0.0, linear_share))
    if r <= 0 or load <= 0:
        return 0.0
    quad, lin = r * (1 - a), r * a + load
    x = load / lin if quad < 1e-12 else (-lin + math.sqrt(lin * lin + 4 * quad * load)) / (2 * quad)
    return load * (1 - x)


def synthetic_rounds(profile: HardwareProfile, tokens: int, round_tokens: int = 640,
                     groups: tuple[range, ...] | None = None, resident: float = 0.0) -> list[RoundLayout]:
    """A chat of `tokens` stored as rounds of `round_tokens` in `groups` (default: one), as its profile's model
    would store it: what the planner would do with a chat not stored yet (`kvchat profile --plan-tokens`)."""
    groups = groups or (range(profile.n_layers),)
    rounds, left = [], tokens
    while left > 0:
        n = min(round_tokens, left)
        segs = []
        for g in groups:
            raw = n * profile.kv_bytes_per_token * len(g) // profile.n_layers
            segs.append(StoredSegment(g, int(raw * profile.stored_over_raw), raw, resident))
        rounds.append(RoundLayout(n, tuple(segs)))
        left -= n
    return rounds


OBSERVED_KEPT = 8
OBSERVED_NEEDED = 3  # restores seen before their median replaces the probe's slowdowns
OBSERVED_MIN_S = 0.25  # only restores whose streams both run this long: shorter ones measure fixed costs, not rates


def observe(profile: HardwareProfile, plan: RestorePlan, compute_s: float, load_s: float) -> HardwareProfile | None:
    """The profile with one more restore's streams observed (each against what the rates alone predict for its
    plan), or None when the restore did not run both long enough to tell."""
    if plan.predicted is None or min(plan.predicted.compute_s, plan.predicted.load_s) < OBSERVED_MIN_S \
            or min(compute_s, load_s) <= 0:
        return None
    seen = [min(4.0, max(0.25, compute_s / plan.predicted.compute_s)),
            min(4.0, max(0.25, load_s / plan.predicted.load_s))]
    return replace(profile, observed=[*profile.observed, seen][-OBSERVED_KEPT:])
