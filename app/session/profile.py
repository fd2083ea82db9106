"""This machine's speeds for restoring a model's chats: measured once per model and device, kept in
`$KVCHAT_HOME/profiles/` (the file: app/session/artifacts.py), and given to the restore planner (engine.restore.plan).

Measured with the model itself and real K/V in the store's own folder:
- prefill time against tokens (a few timed prefills from position 0, fitted to a n + b n^2);
- segment files (the model's K/V from the largest prefill, stored as a chat stores it) read with the page cache
  dropped and again from the page cache, verified and decompressed on one thread, copied to the device;
- the two streams at once: how much of the shorter hides under the longer (on a GPU nearly all of it; on a CPU
  the two share the cores).

A model's first chat on a device does not wait for all that: it gets a quick estimate (one small prefill, a few
files, the two streams' slowdowns assumed rather than measured: about a second on a 2-core CPU for the embedded
model), stored marked `provisional` and used at once; the whole measurement replaces it later (`kvchat profile`,
or the app in the background once it is idle: `refine_profile`). Both report their steps to an `on_progress`
(app/session/progress.py), and a report may raise to cancel: the profile is written only once it is whole.

A profile of another model, another device or an older format, or one that cannot be read, is measured again.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from kvchat.app.session.artifacts import load_profile, probe_folder, profile_path, save_profile
from kvchat.app.session.layout import storage_groups
from kvchat.app.session.progress import OnProgress, Reporter
from kvchat.engine.restore.plan import HardwareProfile, RestorePlan, observe, plan_restore
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep
from kvchat.engine.timing import sync
from kvchat.errors import KvchatError
from kvchat.paths import can_write, data_dir, place_words
from kvchat.storage.pagecache import evict
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.segments import decode_segment, merge_planes, read_segment_file, tensor_on, write_segment
from kvchat.storage.staging import HostToDevice, Staged

Notice = Callable[[str], None]
log = logging.getLogger("kvchat.profile")

PREFILL_SIZES = (128, 512, 2048, 8192, 16384, 24576)
PREFILL_BUDGET_S = 0.5  # no larger prefill once one takes this long (a CPU measures a few small ones)
PROBE_RAW_BYTES = 384 << 20  # at most this much K/V is written and read back
PROBE_ROUND_TOKENS = 512  # the probe's "rounds"
TINY_SEGMENTS = 32  # tiny files timed for the per-file cost
# The quick estimate: one prefill size (timed twice: the first run pays for allocations), fewer tiny files, one load,
# and the side-by-side slowdowns assumed: a GPU runs the two streams nearly apart, a CPU's cores are shared by both
# (as if they took turns; the restores seen since refine it, as they refine a measured one).
QUICK_PREFILL_SIZES = (128,)
QUICK_TINY_SEGMENTS = 8
ASSUMED_SLOWDOWNS = {"cuda": (1.1, 1.1), "cpu": (2.0, 2.0)}

_measured: dict[tuple[str, str], HardwareProfile] = {}  # this process's profiles (a test session measures once)
_lock = threading.Lock()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda {props.name} {props.total_memory >> 30} GiB"
    return f"cpu {platform.machine()} {_cpu_model()} {os.cpu_count()} cores"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ensure_profile(engine, fingerprint: str, notice: Notice | None = None, redo: bool = False, quick: bool = False,
                   on_progress: OnProgress | None = None) -> HardwareProfile:
    """This machine's profile for the engine's model: from this process, from the store, or measured now (said
    through `notice`, its steps reported to `on_progress`). With `quick` (a chat about to answer), a missing one is
    estimated quickly (about a second) and stored as provisional; without it (`kvchat profile`), a missing or
    provisional one is measured whole (seconds to minutes)."""
    device = device_name(engine.device)
    key = (fingerprint, device)
    with _lock:
        if not redo and key in _measured and (quick or not _measured[key].provisional):
            profile = _measured[key]
            if not profile_path(fingerprint, device).exists():
                save_profile(profile)  # another KVCHAT_HOME in the same process (tests)
            return profile
        profile, why = (None, None) if redo else load_profile(fingerprint, device, engine.config.n_layers)
        if profile is not None and profile.provisional and not quick:
            profile, why = None, "the profile is a quick estimate"
        if profile is None:
            home = data_dir()
            if home.is_dir() and not can_write(home):  # said before the notice that it is being measured
                raise KvchatError(f"{home} is read-only: cannot measure how fast this machine restores chats")
            if notice is not None:
                if quick:
                    notice((f"{why}; estimating it again" if why else "estimating how fast this machine recomputes "
                            "and loads this model's chats (quickly; `kvchat profile` measures it whole)") + "…")
                else:
                    notice((f"{why}; measuring it again" if why else
                            "measuring how fast this machine recomputes and loads this model's chats (once per "
                            "model and device)") + "…")
            profile = measure_profile(engine, fingerprint, quick=quick, on_progress=on_progress)
            save_profile(profile)
        _measured[key] = profile
        return profile


def refine_profile(engine, fingerprint: str, on_progress: OnProgress | None = None,
                   cancel: threading.Event | None = None) -> HardwareProfile | None:
    """Measure whole the profile that is stored as a quick estimate, and store it in its place (the app runs this in
    the background when idle). None when there is nothing to refine; raises progress.Cancelled when `cancel` is
    set (checked between steps), leaving the estimate as it was."""
    device = device_name(engine.device)
    stored, _ = load_profile(fingerprint, device, engine.config.n_layers)
    if stored is not None and not stored.provisional:
        return None
    profile = measure_profile(engine, fingerprint, on_progress=on_progress, cancel=cancel)
    with _lock:
        save_profile(profile)
        _measured[(fingerprint, device)] = profile
    return profile


def needs_refining(fingerprint: str, device) -> bool:
    """Whether the stored profile of this model on `device` (a torch device) is a quick estimate."""
    stored, _ = load_profile(fingerprint, device_name(torch.device(device)))
    return stored is not None and stored.provisional


class ProfilePlanner:
    """ChatSession's planner for this machine: plans from the profile, and learns from each restore that ran both
    streams how much they slow each other (kept in the profile, so the next process plans with it too)."""

    def __init__(self, profile: HardwareProfile):
        self.profile = profile

    def current(self) -> HardwareProfile:
        """The profile, or the whole measurement that replaced its quick estimate in this process since (the app
        refines it in the background): learning on the estimate would write it back over the measurement."""
        if self.profile.provisional:
            with _lock:
                current = _measured.get((self.profile.fingerprint, self.profile.device))
            if current is not None and not current.provisional:
                self.profile = current
        return self.profile

    def __call__(self, rounds, groups, background) -> RestorePlan:
        return plan_restore(rounds, groups, self.current(), background)

    def observe(self, plan: RestorePlan, compute_s: float, load_s: float) -> None:
        updated = observe(self.current(), plan, compute_s, load_s)
        if updated is None:
            return
        with _lock:  # this process's later chats plan with it too (a profile from elsewhere stays apart)
            key = (updated.fingerprint, updated.device)
            if _measured.get(key) is self.profile:
                _measured[key] = updated
        self.profile = updated
        if updated.provisional:
            stored, _ = load_profile(updated.fingerprint, updated.device)
            if stored is not None and not stored.provisional:
                return  # measured whole by another process meanwhile (`kvchat profile`): its file is kept
        try:
            save_profile(updated)
        except KvchatError as exc:  # the plans of this process still learn; the next one starts from the file
            log.warning("%s", exc)


def profile_planner(profile: HardwareProfile) -> ProfilePlanner:
    """The restore planner of ChatSession for this profile."""
    return ProfilePlanner(profile)


def default_device(device: torch.device | str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def profile_for_chat(store, sid: str, device, notice: Notice | None = None) -> HardwareProfile:
    """The profile a chat's restores plan with on `device`: stored, or measured with its model (loaded only then);
    a stored quick estimate is measured whole (`kvchat compact` drops K/V by it)."""
    from kvchat.engine.engine import Engine

    info = store.session(sid)
    device = default_device(device)
    profile, _ = load_profile(info["model_fingerprint"], device_name(device))
    if profile is not None and not profile.provisional:
        return profile
    if not Path(info["model_path"]).exists():
        raise KvchatError(f"the chat's model {info['model_path']} is missing, and this machine has no profile of it")
    return ensure_profile(Engine(info["model_path"], device=device), info["model_fingerprint"], notice)


# ---------------------------------------------------------------- measuring


def measure_profile(engine, fingerprint: str, quick: bool = False, on_progress: OnProgress | None = None,
                    cancel: threading.Event | None = None) -> HardwareProfile:
    """The profile, measured whole or (`quick`) estimated; its steps reported to `on_progress`, `cancel` checked
    between them (progress.Cancelled). Nothing is stored here: the probe's files are removed either way."""
    device = engine.device
    sizes = QUICK_PREFILL_SIZES if quick else PREFILL_SIZES
    # Steps: two runs per prefill size, the probe's files (write, read twice, decode, tiny files, loads) and, when
    # measured, the side-by-side runs.
    total = 2 * len(sizes) + 5 + (0 if quick else 2 + 2 * SIDE_BY_SIDE_RUNS)
    report = Reporter("estimating this machine's speeds" if quick else "measuring this machine's speeds", on_progress,
                      cancel=cancel)
    steps = [0]

    def step(n: int = 1) -> None:
        steps[0] = min(total, steps[0] + n)
        report(steps[0], total)

    probe = probe_folder(f".probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:  # first: a home that cannot hold the probe's files (read-only, full) fails before seconds of prefills
        probe.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvchatError(place_words(data_dir(), exc, "measure how fast this machine restores chats")) from None
    try:
        report(0, total)
        points, cache = _prefill_points(engine, sizes, step)
        steps[0] = 2 * len(sizes)  # the sizes past the prefill budget were not run
        a, b = fit_prefill(points)
        files = _write_probe(engine, cache, fingerprint, probe)
        del cache
        disk_bytes = sum(f.stat().st_size for f in files)
        evict(files)
        cold_s = _read_all(files)
        warm_s = _read_all(files)
        step()
        decode_s, raw_bytes, decoded = _decode_one_thread(files, fingerprint)
        step()
        overhead_s = _tiny_segment_seconds(engine, fingerprint, probe, QUICK_TINY_SEGMENTS if quick else TINY_SEGMENTS)
        step()
        h2d = _staging_gb_s(device, decoded)
        step()
        biggest = max(len(d) for d in decoded)
        del decoded
        cfg = engine.config
        profile = HardwareProfile(
            fingerprint=fingerprint, device=device_name(device), n_layers=cfg.n_layers,
            dtype=str(engine.dtype).removeprefix("torch."), prefill_a=a, prefill_b=b,
            disk_read_mb_s=disk_bytes / cold_s / 1e6, cache_read_mb_s=disk_bytes / warm_s / 1e6,
            decode_mb_s=raw_bytes / max(decode_s - overhead_s * len(files), decode_s / 2) / 1e6,
            decode_threads=SegmentPrefetcher.decode_threads(), h2d_gb_s=h2d, compute_slowdown=1.0,
            load_slowdown=1.0,
            segment_overhead_ms=1000 * overhead_s,
            kv_bytes_per_token=cfg.kv_bytes_per_token(engine.model.dtype.itemsize),
            stored_over_raw=disk_bytes / raw_bytes,
            date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), prefill_points=[list(p) for p in points])
        load_s = statistics.median(_load(engine, files, fingerprint) for _ in range(1 if quick else 2))
        step()
        profile = _as_measured_load(profile, load_s, len(files), raw_bytes, biggest, disk_bytes)
        if quick:
            compute_slowdown, load_slowdown = ASSUMED_SLOWDOWNS.get(device.type, ASSUMED_SLOWDOWNS["cpu"])
        else:
            compute_slowdown, load_slowdown = _slowdowns(engine, profile, files, fingerprint, load_s, step)
        report.finish()
        return replace(profile, compute_slowdown=compute_slowdown, load_slowdown=load_slowdown, provisional=quick)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


@torch.inference_mode()
def _prefill_points(engine, sizes=PREFILL_SIZES, step: Callable[[], None] = lambda: None
                    ) -> tuple[list[tuple[int, float]], object]:
    """(tokens, seconds) of prefills from position 0 through every layer, run as a restore's recompute stream runs
    them (its thread and stream); and the last cache. `step()` after each run."""
    cfg, model = engine.config, engine.model
    sizes = sorted({min(n, cfg.context_length - 8) for n in sizes})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sizes[-1],), generator=gen).tolist()
    points, cache = [], None
    for n in sizes:
        runs = []
        for _ in range(2):  # the first run of a size pays for new allocations and kernels: the second is the rate
            cache = engine.new_cache(n + 8)
            sync(engine.device)
            run = PrefixRecompute(model, ids, [PyramidStep(range(cfg.n_layers), n, cache)]).run()
            runs.append(run.busy_s)
            step()
        points.append((n, min(runs)))
        if min(runs) > PREFILL_BUDGET_S:
            break
    sync(engine.device)
    cache.length = points[-1][0]
    return points, cache


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float]:
    """a, b >= 0 of T(n) = a n + b n^2, least squares on relative error (small and large prefills alike)."""
    rows = [(n / t, n * n / t) for n, t in points]  # each equation divided by its t: a n/t + b n^2/t = 1
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1 = sum(x for x, _ in rows)
    r2 = sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) > 1e-12 * s11 * s22:
        a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= 0:
            return a, b
    # A negative coefficient: the best fit of one term alone.
    only_a = r1 / s11
    only_b = r2 / s22
    err_a = sum((only_a * x - 1) ** 2 for x, _ in rows)
    err_b = sum((only_b * y - 1) ** 2 for _, y in rows)
    return (only_a, 0.0) if err_a <= err_b else (0.0, only_b)


def _write_probe(engine, cache, fingerprint: str, folder: Path) -> list[Path]:
    """The cache's K/V stored as a chat stores it: rounds of PROBE_ROUND_TOKENS in the model's layer groups."""
    cfg = engine.config
    per_token = cfg.kv_bytes_per_token(engine.model.dtype.itemsize)
    tokens = max(1, min(cache.length, PROBE_RAW_BYTES // per_token))
    groups = storage_groups(cfg.n_layers, per_token)
    jobs = [(layers, range(s, min(s + PROBE_ROUND_TOKENS, tokens)))
            for s in range(0, tokens, PROBE_ROUND_TOKENS) for layers in groups]

    def write(job) -> Path:
        layers, span = job
        ref = write_segment(folder, cache.read(layers, span.start, span.stop), fingerprint=fingerprint,
                            layers=layers, tokens=span)
        return folder / ref.file

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(write, jobs))


def _read_all(files: list[Path]) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(SegmentPrefetcher.READERS) as pool:
        list(pool.map(read_segment_file, files))
    return time.perf_counter() - t0


def _decode_one_thread(files: list[Path], fingerprint: str) -> tuple[float, int, list[bytes]]:
    blobs = [read_segment_file(f) for f in files]
    t0 = time.perf_counter()
    decoded = [decode_segment(blob, f, fingerprint=fingerprint)[1] for f, blob in zip(files, blobs)]
    return time.perf_counter() - t0, sum(len(d) for d in decoded), decoded


def _tiny_segment_seconds(engine, fingerprint: str, folder: Path, count: int = TINY_SEGMENTS) -> float:
    """What one more file costs a restore beyond its bytes: open, read, hash, decompress a one-token segment."""
    cfg = engine.config
    kv = torch.zeros(1, 2, cfg.n_kv_heads, 1, cfg.head_dim, dtype=engine.model.dtype)
    files = []
    for i in range(count):
        kv.fill_(float(i))
        files.append(folder / write_segment(folder, kv, fingerprint=fingerprint, layers=range(1),
                                            tokens=range(i, i + 1)).file)
    t0 = time.perf_counter()
    for f in files:
        decode_segment(read_segment_file(f), f, fingerprint=fingerprint)
    return (time.perf_counter() - t0) / count


def _staging_gb_s(device: torch.device, decoded: list[bytes]) -> float | None:
    """Decoded K/V to the device through the staging buffers, from as many threads as a restore decodes on."""
    if device.type != "cuda":
        return None
    staging = HostToDevice.shared(device)
    staging.copy(decoded[0]).wait()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(SegmentPrefetcher.decode_threads()) as pool:
        staged = list(pool.map(staging.copy, decoded))
    for s in staged:
        s.wait()
    sync(device)
    return sum(len(r) for r in decoded) / (time.perf_counter() - t0) / 1e9


def _load(engine, files: list[Path], fingerprint: str, decode_threads: int | None = None) -> float:
    """Seconds to bring `files` to the device as a restore does (read ahead, verify, decompress, stage, merge)."""
    device = engine.device
    if device.type == "cuda":
        staging = HostToDevice.shared(device)
        finish = lambda header, raw: staging.copy(raw)  # noqa: E731
    else:
        finish = lambda header, raw: tensor_on(header, raw, "cpu")  # noqa: E731
    fetcher = SegmentPrefetcher(files[0].parent, fingerprint, [[f.name] for f in files],
                                [f.stat().st_size for f in files], finish=finish, decode_threads=decode_threads)
    t0 = time.perf_counter()
    try:
        for i in range(len(files)):
            header, data = fetcher.get(i)[0]
            kv = merge_planes(header, data.wait()) if isinstance(data, Staged) else data
            kv.clone()  # placed in a cache, as a restore does
        sync(device)
    finally:
        fetcher.close()
    return time.perf_counter() - t0


def _as_measured_load(profile: HardwareProfile, load_s: float, files: int, raw: int, biggest: int,
                      disk: int) -> HardwareProfile:
    """The pipeline's own costs (threads, staging, placing) slow a real load below what its parts allow: where the
    warm load took longer than the page-cache read and the copies predict, the per-thread decode rate is lowered
    until the model predicts what was measured."""
    floor = max(disk / (profile.cache_read_mb_s * 1e6), raw / (profile.h2d_gb_s * 1e9) if profile.h2d_gb_s else 0)
    if load_s <= floor:
        return profile
    overhead = profile.segment_overhead_ms / 1000
    spare = profile.decode_threads * load_s - files * overhead
    rate = raw / spare if spare > 0 else profile.decode_mb_s * 1e6
    rate = max(rate, biggest / max(load_s - overhead, 1e-9))  # or the largest file, one thread's alone, decides
    return replace(profile, decode_mb_s=min(profile.decode_mb_s, rate / 1e6))


# One side-by-side run measured the recompute's slowdown at x1.16 in one H200 run and x1.30 in the next, and the
# plans (and compaction) of those runs differed by a round at 8k: the median of three.
SIDE_BY_SIDE_RUNS = 3


def _slowdowns(engine, profile: HardwareProfile, files: list[Path], fingerprint: str,
               load_s: float, step: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """How much slower the recompute and the load run side by side than alone (a recompute about as long as the
    load, run as a restore runs them: the recompute queued by this thread, the loads placed by a helper)."""
    largest = max(n for n, _ in profile.prefill_points)
    n = next((m for m in range(64, largest + 1, 64) if profile.prefill_seconds(m) >= load_s), largest)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.config.vocab_size, (n,), generator=gen).tolist()

    def recompute() -> PrefixRecompute:
        cache = engine.new_cache(n + 8)
        return PrefixRecompute(engine.model, ids, [PyramidStep(range(engine.config.n_layers), n, cache)])

    recompute().run()  # warm-up of the recompute stream's shapes
    step()
    compute_s = statistics.median(recompute().run().busy_s for _ in range(SIDE_BY_SIDE_RUNS))
    step()
    # Beside a recompute a restore decodes on fewer threads: the load's slowdown includes that.
    threads = SegmentPrefetcher.decode_threads_beside_compute()
    compute, load = [], []
    for _ in range(SIDE_BY_SIDE_RUNS):
        both, took = recompute(), []
        loader = threading.Thread(target=lambda: took.append(_load(engine, files, fingerprint, threads)))
        sync(engine.device)
        loader.start()
        both.launch()
        loader.join()
        both.finish()
        sync(engine.device)
        compute.append(both.busy_s / compute_s)
        load.append(took[0] / load_s)
        step(2)
    return max(1.0, statistics.median(compute)), max(1.0, statistics.median(load))


def plan_table(profile: HardwareProfile, chat_tokens: list[int], round_tokens: int = 640) -> list[dict]:
    """What the planner does with chats of these lengths stored as this profile's model stores them, with the
    files in the page cache (warm) and not (cold): the split, and the predicted restore against loading or
    recomputing everything."""
    from kvchat.engine.restore.plan import fixed_plan, synthetic_rounds

    rows = []
    groups = storage_groups(profile.n_layers, profile.kv_bytes_per_token) if profile.kv_bytes_per_token else None
    for tokens in chat_tokens:
        for cache, resident in (("warm", 1.0), ("cold", 0.0)):
            rounds = synthetic_rounds(profile, tokens, round_tokens, groups, resident)
            plan = plan_restore(rounds, tuple(groups or (range(profile.n_layers),)), profile)
            ends = [sum(r.tokens for r in rounds[: i + 1]) for i in range(len(rounds))]
            every = fixed_plan(rounds, plan.groups, (0,) * len(plan.groups), profile).predicted
            none = fixed_plan(rounds, plan.groups, (len(rounds),) * len(plan.groups), profile).predicted
            share = sum(len(g) * (ends[k - 1] if k else 0) for g, k in zip(plan.groups, plan.prefix))
            rows.append({"tokens": tokens, "rounds": len(rounds), "cache": cache, "prefix": list(plan.prefix),
                         "plan": plan.summary(ends), "recomputed_share": share / (profile.n_layers * tokens),
                         "compute_s": plan.predicted.compute_s, "load_s": plan.predicted.load_s,
                         "restore_s": plan.predicted.total_s, "load_everything_s": every.total_s,
                         "recompute_everything_s": none.total_s})
    return rows
