"""A stored chat driven by the engine: restore its KV from disk, answer a new message, save the round.

The round's text is committed the moment the reply ends; its K/V (all layers) is written to a segment file by a
background thread, and its database row only once the file is durable. Restoring loads every round's stored K/V
into the cache at its original slots and recomputes from text any round whose K/V is missing, corrupt, or from
another model, saying why.

Under a tiered KV policy (Round Attention) each round is stored as two segments, its lower and its upper layers;
restoring loads the lower layers of every round onto the device and starts reading every round's upper layers
into host memory in the background, from where a message's chosen rounds are copied to the device.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvchat.app.session.merges import ChatMerges, pairs_text, parse_pairs
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.engine.kv.cross_layer import LayerPair, merge_pair, unmerge_pair
from kvchat.engine.engine import Engine
from kvchat.engine.generate import GenerationResult, TokenCallback, generate, prefill
from kvchat.engine.model.decoder import KVCache
from kvchat.engine.policies import KVPolicy
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep, RecomputeCancelled
from kvchat.engine.restore.plan import (RestorePlan, RoundLayout, StoredSegment, load_everything, plan_groups)
from kvchat.engine.kv.tiered import TieredKV, host_layout
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import ContextOverflowError, KvchatError
from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_KEY_BOUNDS, SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store, now
from kvchat.storage.failpoints import crash_point
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.pagecache import resident_fraction
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.segments import merge_planes, tensor_on, token_rows_fit, write_segment
from kvchat.storage.staging import HostToDevice, Staged

log = logging.getLogger("kvchat.session")

RestoreProgress = Callable[[int, int], None]  # (tokens restored so far, tokens in the chat)
# (rounds as stored, layer groups, groups loaded off the critical path) -> what to recompute and what to load
Planner = Callable[[list[RoundLayout], tuple[range, ...], tuple[int, ...]], RestorePlan]

# A round's K/V of all layers is stored as this many bytes per 512 tokens, at most, per file: a big model's rounds
# become several files (layer groups), which the restore reads and decompresses side by side, and which its plan
# and compaction can treat apart (lower layers recomputed, upper ones loaded).
GROUP_BYTES_PER_512_TOKENS = 16 << 20
MAX_GROUPS = 4


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


def window_live_from(cfg, start: int, end: int, chat_end: int) -> int:
    """The first token of a round [start, end) whose K/V in sliding-window layers a chat ending at `chat_end` can
    still read: a token at position t is in the window of position p iff p - window < t, and no later token comes
    before the chat's end. The round's earlier tokens need not be stored in those layers."""
    if not cfg.sliding_window:
        return start
    return min(end, max(start, chat_end - cfg.sliding_window + 1))


def zero_unread_windows(kv: torch.Tensor, layers: range, cfg, start: int, live_from: int) -> torch.Tensor:
    """Zero (in place) the K/V [len(layers), 2, Hkv, n, D] of tokens before `live_from` in sliding-window layers:
    zeros compress to almost nothing, and the segment keeps its shape (every reader takes it as it is)."""
    windowed = [j for j, layer in enumerate(layers) if cfg.window(layer)]
    if windowed and live_from > start:
        kv[windowed, :, :, : live_from - start] = 0
    return kv


class RestoreCancelled(KvchatError):
    """The restore was cancelled (the user switched to another chat); the session holds no usable cache."""


@dataclass
class RestoreStats:
    tokens_loaded: int = 0  # tokens whose K/V came from disk (at the layers the plan loads)
    tokens_recomputed: int = 0  # recomputed because their K/V could not be loaded (missing, damaged, foreign)
    restore_ms: float = 0.0
    spans_ms: float = 0.0  # rendering and tokenizing the chat, needed only when some round is recomputed
    wait_ms: float = 0.0  # waiting for reads/checks/decompression the worker threads had not finished
    notes: list[str] = field(default_factory=list)
    recomputed_rounds: list[int] = field(default_factory=list)  # the fallback's rounds
    tokens_planned: int = 0  # the chat's first tokens, recomputed by plan (a round split by layers counts in both)
    compute_ms: float = 0.0  # how long the recompute stream was busy
    compute_launch_ms: float = 0.0  # of which the host took this long to queue its kernels
    load_ms: float = 0.0  # how long the load stream was busy (first read to last round placed)
    gap_ms: float = 0.0  # between the two streams' ends: the bubble the plan tried to avoid
    plan: str = ""  # what the plan chose
    predicted_ms: float | None = None  # the planner's estimate of the restore
    # Recomputed by plan only because nothing was stored for them (compacted where loading is slower); loading
    # them is faster here, so they are stored now.
    kept_rounds: list[int] = field(default_factory=list)
    # When each step of the restore ended, ms after it began (planned, cache, tokenized, queued, loaded, computed,
    # joined, synced): where a restore's fixed costs go.
    phases_ms: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str, started: float) -> None:
        self.phases_ms[phase] = 1000 * (time.perf_counter() - started)


class KVWriter:
    """Writes finished rounds' K/V in the background, so saving never stalls decoding or input."""

    def __init__(self, store: Store, fingerprint: str):
        self.store, self.fingerprint = store, fingerprint
        self.errors: list[str] = []
        self._stream = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self._thread.start()

    def submit(self, sid: str, round_idx: int, kv: torch.Tensor, layers: range, tokens: range,
               kind: str = SEGMENT_KV, live_from: int = 0, merged: str = "") -> None:
        """`kv` (or, by `kind`, the round's key bounds or a merged pair) must not change afterwards (a copy, as
        KVCache.read returns). `live_from`: its sliding-window layers hold zeros before this position
        (ChatSession.live_from); `merged`: the layer pairs it holds as zeros, stored merged ("4+5,6+7")."""
        ready = None
        if kv.is_cuda:  # the writer's stream must not read the copy before the main stream has made it
            ready = torch.cuda.Event()
            ready.record()
        self._jobs.put((sid, round_idx, kv, layers, tokens, kind, (live_from, merged), ready))

    def submit_job(self, job: Callable[[], object], what: str) -> None:
        """Run `job` on the writer's thread once every save submitted before it is done (compaction)."""
        self._jobs.put(("job", job, what))

    @property
    def busy(self) -> bool:
        """Whether submitted rounds are still on their way to disk."""
        return self._jobs.unfinished_tasks > 0

    def drain(self) -> None:
        """Wait until every submitted round is on disk (or has failed, with the reason in `errors`)."""
        self._jobs.join()

    def _run(self) -> None:
        try:  # Linux: a thread can lower its own priority, so compressing K/V yields the CPU to decoding
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._jobs.get()
            if item[0] == "job":
                self._run_job(*item[1:])
                continue
            sid, round_idx, kv, layers, tokens, kind, extra, ready = item
            try:
                if ready is None:
                    self._save(sid, round_idx, kv, layers, tokens, kind, *extra)
                else:
                    # Its own CUDA stream: copying K/V to the host overlaps decoding instead of queueing behind it.
                    stream = self._stream or torch.cuda.Stream(kv.device)
                    self._stream = stream
                    stream.wait_event(ready)
                    with torch.cuda.stream(stream):
                        self._save(sid, round_idx, kv, layers, tokens, kind, *extra)
            except Exception as exc:  # noqa: BLE001 - the writer must outlive any one failed save
                # The text is already committed; this round's K/V will be recomputed when the chat is reopened.
                reason = str(exc) if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
                self.errors.append(f"round {round_idx}: {reason}")
                log.warning("KV of round %d not saved: %s", round_idx, reason)
            finally:
                self._jobs.task_done()

    def _run_job(self, job: Callable[[], object], what: str) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a failed compaction costs disk space, never a chat
            reason = str(exc) if isinstance(exc, KvchatError) else f"{type(exc).__name__}: {exc}"
            self.errors.append(f"{what}: {reason}")
            log.warning("%s failed: %s", what, reason)
        finally:
            self._jobs.task_done()

    def _save(self, sid: str, round_idx: int, kv: torch.Tensor, layers: range, tokens: range, kind: str,
              live_from: int = 0, merged: str = "") -> None:
        ref = write_segment(self.store.kv_dir, kv, fingerprint=self.fingerprint, layers=layers, tokens=tokens,
                            kind=kind)
        crash_point("segment-durable")
        self.store.add_segment(sid, kind=kind, round_idx=round_idx, layer_start=layers.start, layer_end=layers.stop,
                               token_start=tokens.start, token_end=tokens.stop, codec=ref.codec,
                               dtype=str(kv.dtype).removeprefix("torch."), byte_size=ref.byte_size,
                               raw_size=ref.raw_size, checksum=ref.checksum, file=ref.file,
                               model_fingerprint=self.fingerprint, live_from=live_from, merged=merged)
        crash_point("segment-row-committed")


class ChatSession:
    def __init__(self, store: Store, engine: Engine, sid: str, writer: KVWriter | None = None,
                 policy: KVPolicy | None = None, planner: Planner | None = None,
                 compactor: Callable[[Store, str], object] | None = None, trim_windows: bool = True,
                 merges: "ChatMerges | None" = None, ignore_merges: bool = False):
        """`policy`: a tiered KV policy (engine.policies, e.g. "round"), one over the full cache ("loopserve"), or
        None for the full cache.
        `planner`: chooses what a restore recomputes and what it loads (app.hardware_profile.profile_planner);
        None loads everything stored. `compactor`: run on the writer's thread after each round is saved
        (app.compaction), or None. `trim_windows`: store sliding-window layers only where a later round can
        still read them (see `live_from`); off, every layer of every token is stored (the bench's comparison)."""
        self.store, self.engine, self.sid = store, engine, sid
        self.planner, self.compactor = planner, compactor
        self.info = store.session(sid)
        self.fingerprint = model_fingerprint(Path(engine.path), store)
        self.writer = writer or KVWriter(store, self.fingerprint)
        self.rounds: list[RoundRow] = store.rounds(sid)
        self.policy = policy if policy is not None and policy.tiered else None
        # A policy over the full cache (LoopServe): it shapes each message's prefill and its reply's decode.
        self.message_policy = policy if policy is not None and not policy.tiered else None
        self.trim_windows = trim_windows
        self.cache: KVCache | TieredKV = self._new_cache(256)
        self.restored: RestoreStats | None = None
        self._waited = 0.0
        self._upper_fetcher: SegmentPrefetcher | None = None
        self._bounds_fetcher: SegmentPrefetcher | None = None  # during a tiered restore
        self._upper_segments: dict[int, list[dict]] = {}  # tiered: each round's upper-layer segment rows
        # (round, first layer of the group) -> live_from of what is stored (or on its way to disk) there
        self._stored_live: dict[tuple[int, int], int] = {}
        # Sliding-window K/V of positions below this may be zeros in the cache (restored from trimmed segments):
        # it cannot be stored again as live.
        self._window_valid_from = 0
        self.merges = merges
        self.ignore_merges = ignore_merges
        self._round_pairs: dict[int, list[LayerPair]] = {}  # the pairs a round is stored merged in
        self._ring_fork: KVCache | None = None  # a restore's recompute tier for a cache with rings

    def _new_cache(self, capacity: int) -> KVCache | TieredKV:
        if self.policy is None:
            # Sliding-window layers (Gemma 3) keep only their window, in a ring: unless every layer of every
            # token is to be stored (trim_windows off).
            return self.engine.new_cache(capacity, ring=self.trim_windows)
        return TieredKV(self.engine.model, self.policy, capacity)

    @property
    def split(self) -> int:
        """Layers [0, split) are loaded at restore; the rest (tiered policies) only when a message picks a round."""
        return self.engine.config.n_layers if self.policy is None else self.policy.split

    @property
    def storage_groups(self) -> tuple[range, ...]:
        """The layer groups each round is stored as: the full cache's groups, or a tiered chat's lower tier."""
        if self.policy is not None:
            return (range(self.split),)
        cfg = self.engine.config
        return storage_groups(cfg.n_layers, cfg.kv_bytes_per_token(self.engine.model.dtype.itemsize))

    @property
    def system(self) -> str | None:
        return self.info["system_prompt"]

    def conversation(self, extra: Round | None = None) -> Conversation:
        rounds = [Round(r.user_text, r.assistant_text) for r in self.rounds]
        return Conversation(rounds + ([extra] if extra else []), self.system)

    # ---- restore ----

    @torch.inference_mode()
    def restore(self, progress: RestoreProgress | None = None,
                cancel: threading.Event | None = None) -> RestoreStats:
        """Bring the cache to the end of the stored chat: load what is on disk, recompute the rest.

        `progress` is called after each round; setting `cancel` stops between rounds with RestoreCancelled.
        """
        try:
            return self._restore(progress, cancel)
        except RestoreCancelled:
            self.cache, self.restored = self._new_cache(256), None
            raise

    def _restore(self, progress: RestoreProgress | None, cancel: threading.Event | None) -> RestoreStats:
        started = time.perf_counter()
        stats, self._waited = RestoreStats(), 0.0
        by_round: dict[int, list[dict]] = {}
        upper_only: dict[int, list[dict]] = {}  # tiered: segments of upper layers only, read in the background
        bounds: dict[int, list[dict]] = {}  # tiered: each round's key bounds, read with the lower layers
        ends = [r.token_end for r in self.rounds]
        total = ends[-1] if ends else 0
        trimmed: set[int] = set()
        for seg in self.store.segments(self.sid):
            if seg["kind"] == SEGMENT_KEY_BOUNDS:
                into = bounds if self.policy is not None and seg["layer_start"] == self.split else {}
            elif seg["kind"] == SEGMENT_MERGED and self.ignore_merges:
                continue  # the K/V rows naming it make their round recomputed (_unusable)
            elif not self._window_readable(seg, total):
                trimmed.add(seg["round_idx"])  # recomputed, like a missing segment
                continue
            else:
                into = upper_only if seg["layer_start"] >= self.split else by_round
            into.setdefault(seg["round_idx"], []).append(seg)
        self._route_merged(by_round, upper_only)
        if trimmed:
            stats.notes.append(f"round {min(trimmed)}{'' if len(trimmed) == 1 else f'-{max(trimmed)}'}: stored "
                               f"without sliding-window K/V the chat's end now reads (the chat ends earlier than "
                               f"when they were stored: a fork or a retraction); recomputed")
        self._stored_live = {(i, seg["layer_start"]): seg["live_from"] for i, segs in by_round.items()
                             for seg in segs}
        self._window_valid_from = max((seg["live_from"] for segs in by_round.values() for seg in segs
                                       if self._windowed(seg) and seg["live_from"] > seg["token_start"]), default=0)
        if total > self.engine.config.context_length:
            raise ContextOverflowError(f"the chat holds {total} tokens; the model's context is "
                                       f"{self.engine.config.context_length}")
        self._upper_parts: dict[int, list[tuple[range, torch.Tensor]]] = {}
        self._upper_segments = upper_only  # emptied if the restore finds the stored spans stale
        if self._upper_fetcher is not None:
            self._upper_fetcher.close()
            self._upper_fetcher = None
        plan = self._plan(by_round, upper_only)
        stats.mark("planned", started)
        stats.plan = plan.summary(ends)
        if plan.predicted is not None:
            stats.predicted_ms = 1000 * plan.predicted.total_s
        self.cache, self._ring_fork = self._new_cache(total + 512), None
        stats.mark("cache", started)
        # What the plan loads: per round, the segments holding any layer it does not recompute (the upper tier of
        # a tiered chat comes later, in the background, unless it came in one segment with the lower layers).
        loads = {i: self._to_load(by_round.get(i, []), plan.recomputed_layers(i).stop) for i in range(len(ends))}
        # Reads, checks and decompression run ahead in worker threads, while this thread moves each round's K/V to
        # the device in order as soon as it is ready.
        # The workers also finish each segment: merged on the CPU, or copied to the GPU through pinned buffers.
        if self.engine.device.type == "cuda":
            staging = HostToDevice.shared(self.engine.device)
            finish = lambda header, raw: staging.copy(raw)  # noqa: E731
        else:
            finish = lambda header, raw: tensor_on(header, raw, "cpu")  # noqa: E731
        # While this thread queues a recompute, the decoding leaves it cores (SegmentPrefetcher's note on why).
        threads = SegmentPrefetcher.decode_threads_beside_compute() if any(plan.prefix) else None
        fetcher = self._prefetcher(loads, finish, decode_threads=threads)
        self._bounds_fetcher = self._start_bounds_fetch(bounds, finish)
        try:
            restored = self._run_plan(plan, loads, fetcher, stats, started, progress, cancel)
        finally:
            fetcher.close()
            if self._bounds_fetcher is not None:
                self._bounds_fetcher.close()
                self._bounds_fetcher = None
        if self.policy is not None:
            # Only once the lower layers are in: started earlier, this read competed with the restore for the disk
            # and the cores (at 32k on an H200 it made the restore slower than the full cache's).
            self._start_upper_fetch()
        return restored

    def _route_merged(self, by_round: dict[int, list[dict]], upper_only: dict[int, list[dict]]) -> None:
        """Each merged pair goes with the K/V rows that name it (tiered: read with the lower layers, or in the
        background with the upper ones); one that no K/V row names is left over, never read."""
        for i in set(by_round) | set(upper_only):
            merged = [s for s in by_round.get(i, []) + upper_only.get(i, []) if s["kind"] == SEGMENT_MERGED]
            for into in (by_round, upper_only):
                if i not in into:
                    continue
                listed = {(p.low, p.high + 1) for p in self._listed_pairs(
                    [s for s in into[i] if s["kind"] == SEGMENT_KV])}
                into[i] = [s for s in into[i] if s["kind"] != SEGMENT_MERGED] + [
                    s for s in merged if (s["layer_start"], s["layer_end"]) in listed]

    def _plan(self, by_round: dict[int, list[dict]], upper_only: dict[int, list[dict]]) -> RestorePlan:
        """What to recompute and what to load: the planner's choice from this chat's stored segments (those of
        this model and the round's token span), or, without a planner, load everything stored."""
        rows = {i: by_round.get(i, []) + upper_only.get(i, []) for i in range(len(self.rounds))}
        resident = (lambda s: resident_fraction(self.store.kv_dir / s["file"])) if self.planner else (lambda s: 0.0)
        layouts = round_layouts(self.rounds, rows, self.fingerprint, resident)
        groups = plan_groups(self.engine.config.n_layers, layouts, (self.split,) if self.policy is not None else ())
        background = tuple(g for g, grp in enumerate(groups) if grp.start >= self.split)
        if self.planner is None:
            return load_everything(layouts, groups, background)
        return self.planner(layouts, groups, background)

    def _to_load(self, segments: list[dict], keep_from: int) -> list[dict]:
        """A round's segments holding K/V of layers at or above `keep_from` (the layers its plan loads)."""
        return [s for s in segments if s["layer_end"] > keep_from]

    def _run_plan(self, plan: RestorePlan, loads: dict[int, list[dict]], fetcher: SegmentPrefetcher,
                  stats: RestoreStats, started: float, progress: RestoreProgress | None,
                  cancel: threading.Event | None) -> RestoreStats:
        """This thread queues the planned prefix on the recompute stream while a helper thread places every loaded
        round as its segments arrive; rounds that could not be loaded are recomputed once both are done."""
        ends = [r.token_end for r in self.rounds]
        total = ends[-1] if ends else 0
        # The prefix is rendered and tokenized before any reader thread runs: beside a dozen decoding threads it
        # took longer, and the recompute, which needs it, started later (its first kernel came 40-170 ms after the
        # restore's first device work on the H100, 8B shape).
        tokens = self._prefix_tokens(plan.prefix[0] if ends else 0, stats)
        if tokens is None:  # the stored spans no longer match the text's tokens: nothing stored can be trusted
            return self._recompute_all(self.engine.chat.round_spans(self.conversation()), stats, started)
        stats.tokens_planned = len(tokens)
        stop = threading.Event()
        recompute = PrefixRecompute(self.engine.model, tokens, self._pyramid_steps(plan, ends), stop)
        stats.mark("tokenized", started)
        loading = _Loading(time.perf_counter())
        fetcher.start()
        reported, reporting = [None], threading.Lock()

        def report() -> None:  # after each loaded round (helper thread) and while waiting (this one)
            with reporting:
                done = recompute.done_tokens / recompute.work if recompute.work else 1.0
                value = min(total, loading.tokens + int(done * stats.tokens_planned))
                if progress is not None and value != reported[0]:
                    reported[0] = value
                    progress(value, total)

        placer = threading.Thread(target=self._place_loaded,
                                  args=(plan, loads, fetcher, loading, cancel, stop, report), name="kv-place",
                                  daemon=True)

        placer.start()
        try:
            recompute.launch()
            stats.mark("queued", started)
            plan.store_from  # noqa: B018 - worked out (several plans, a 32k chat) while this thread would only wait
            while placer.is_alive():  # the recompute is queued (on the CPU: done); the loads may still come in
                if cancel is not None and cancel.is_set():
                    raise RestoreCancelled("restore cancelled")
                placer.join(0.05)
                report()
            if cancel is not None and cancel.is_set():  # the helper stopped early for it
                raise RestoreCancelled("restore cancelled")
            recompute.finish()
            stats.mark("computed", started)
        except RecomputeCancelled:
            raise RestoreCancelled("restore cancelled") from None
        finally:
            stop.set()  # on any error the helper stops at its next round
            placer.join()
        if loading.error is not None:
            raise loading.error
        stats.tokens_loaded, fallback = loading.tokens, loading.fallback
        stats.notes += [f"round {i}: {reason}; recomputed" for i, reason in loading.reasons]
        stats.compute_ms = 1000 * recompute.busy_s
        stats.compute_launch_ms = 1000 * recompute.launched_s
        stats.load_ms = 1000 * (loading.ended - loading.started) if loading.ended is not None else 0.0
        if loading.ended is not None:
            stats.phases_ms["loaded"] = 1000 * (loading.ended - started)
        if recompute.busy_s and loading.ended is not None:
            stats.gap_ms = 1000 * abs(recompute.ended_at - loading.ended)
            observe = getattr(self.planner, "observe", None)
            if observe is not None and not loading.fallback:  # a planner that learns how the two streams went
                observe(plan, recompute.busy_s, loading.ended - loading.started)
        # Rounds recomputed only because nothing is stored for them, which this machine would rather load:
        # recomputed because they could not be loaded, and stored now.
        stats.kept_rounds = [i for i in range(plan.prefix[0]) if all(
            i >= first for first, k in zip(plan.store_from, plan.prefix) if i < k)] if ends else []
        if stats.kept_rounds:
            kept = ends[stats.kept_rounds[-1]] - self.rounds[stats.kept_rounds[0]].token_start
            stats.tokens_planned -= kept
            stats.tokens_recomputed += kept
            stats.notes.append(f"{_rounds_words(stats.kept_rounds)}: no K/V stored; recomputed, and stored since "
                               f"loading is faster here")
        spans = self._recompute_fallback(fallback, stats, self._window_prefix(plan))
        if spans is False:
            return self._recompute_all(self.engine.chat.round_spans(self.conversation()), stats, started)
        self._join_recomputed()
        if self.policy is None:
            self.cache.length = total
        else:
            self._register_tiered_rounds(plan, tokens, spans, stats.kept_rounds)
        stats.wait_ms = 1000 * self._waited
        report()
        stats.mark("joined", started)
        return self._restored(stats, started)

    def _place_loaded(self, plan: RestorePlan, loads: dict[int, list[dict]], fetcher: SegmentPrefetcher,
                      loading: "_Loading", cancel: threading.Event | None, stop: threading.Event,
                      report: Callable[[], None]) -> None:
        """On a helper thread: every round the plan loads, in order, into the cache as its segments arrive."""
        try:
            with torch.inference_mode():  # thread-local: the cache is an inference tensor
                self._place_rounds(plan, loads, fetcher, loading, cancel, stop, report)
        except BaseException as exc:  # noqa: BLE001 - raised again on the restoring thread
            loading.error = exc

    def _place_rounds(self, plan: RestorePlan, loads: dict[int, list[dict]], fetcher: SegmentPrefetcher,
                      loading: "_Loading", cancel: threading.Event | None, stop: threading.Event,
                      report: Callable[[], None]) -> None:
        start = 0
        for i, row in enumerate(self.rounds):
            if stop.is_set() or (cancel is not None and cancel.is_set()):
                return
            end, keep_from = row.token_end, plan.recomputed_layers(i).stop
            if keep_from < self.split:
                reason = self._load_round(i, start, end, loads[i], fetcher, keep_from)
                if reason is None:
                    loading.tokens += end - start
                    loading.ended = time.perf_counter()
                else:
                    log.info("round %d of %s recomputed: %s", i, self.sid, reason)
                    loading.reasons.append((i, reason))
                    loading.fallback.append(i)
            start = end
            report()

    def _prefix_tokens(self, rounds: int, stats: RestoreStats) -> list[int] | None:
        """The tokens of the chat's first `rounds` rounds (rendered and tokenized), or None when they no longer
        match the stored spans."""
        if rounds == 0:
            return []
        t0 = time.perf_counter()
        head = Conversation([Round(r.user_text, r.assistant_text) for r in self.rounds[:rounds]], self.system)
        spans = self.engine.chat.round_spans(head)
        stats.spans_ms += 1000 * (time.perf_counter() - t0)
        if list(itertools.accumulate(len(s) for s in spans)) != [r.token_end for r in self.rounds[:rounds]]:
            return None
        return [t for s in spans for t in s]

    def _pyramid_steps(self, plan: RestorePlan, ends: list[int]) -> list[PyramidStep]:
        """One recompute step per layer group the plan recomputes anything at; a tiered chat's upper layers go to a
        scratch cache, from which each round's upper K/V moves to host memory once the restore is done."""
        steps, device_tier = [], self._recompute_tier()
        self._recomputed_upper = None
        for grp, k in zip(plan.groups, plan.prefix):
            if k == 0:
                break
            cache = device_tier
            if grp.start >= self.split:
                if self._recomputed_upper is None:
                    self._recomputed_upper = self.engine.model.new_cache(
                        ends[k - 1], range(self.split, self.engine.config.n_layers))
                cache = self._recomputed_upper
            steps.append(PyramidStep(grp, ends[k - 1], cache))
        return steps

    def _window_prefix(self, plan: RestorePlan) -> int:
        """The rounds [0, k) whose sliding-window K/V the plan recomputes in every window layer of the device tier
        (the shortest prefix among their layer groups); len(rounds) without sliding windows."""
        cfg = self.engine.config
        windowed = [k for grp, k in zip(plan.groups, plan.prefix)
                    if grp.start < self.split and any(cfg.window(i) for i in grp)]
        return min(windowed) if windowed else len(self.rounds)

    def _recompute_tier(self, loads_running: bool = True) -> KVCache:
        """Where a restore's recomputes write the device tier's K/V. While loads may run, a cache with
        sliding-window rings gets a fork of them: the recompute's windows run over its own ring while the loads
        fill the cache's, and the restore joins the two once both are done (`_join_recomputed`)."""
        if self.policy is not None:
            return self.cache.lower
        if self.cache.ring_size and loads_running:
            if self._ring_fork is None:
                self._ring_fork = self.cache.fork_ring()
            return self._ring_fork
        return self.cache

    def _join_recomputed(self) -> None:
        if self._ring_fork is not None:
            self.cache.join_ring(self._ring_fork)
            self._ring_fork = None

    def _recompute_fallback(self, rounds: list[int], stats: RestoreStats,
                            window_prefix: int) -> list[list[int]] | None | bool:
        """Recompute the rounds that could not be loaded, in order, each attending to everything before it.
        Returns the chat's spans (None when no round needed them), or False when they no longer match.

        A sliding-window layer's K/V is stored only for the chat's last window (and the plan's recomputed prefix
        has it in the cache): a missing round whose window reaches further back is recomputed together with every
        round from the end of what the cache holds, since the hidden states entering each layer depend on the
        window below it."""
        if not rounds:
            return None
        t0 = time.perf_counter()
        spans = self.engine.chat.round_spans(self.conversation())
        stats.spans_ms += 1000 * (time.perf_counter() - t0)
        if list(itertools.accumulate(len(s) for s in spans)) != [r.token_end for r in self.rounds]:
            return False
        runs: list[list[int]] = []
        for i in rounds:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        valid_rounds = window_prefix  # rounds [0, valid_rounds) have every window K/V in the cache
        recomputed: list[int] = []
        # In a ring cache the recompute's windows are in a ring of its own, which holds only what it computed.
        ringed = self._ring_fork is not None
        for run in runs:
            if run[0] > valid_rounds and (ringed or not self._window_held(run[0], valid_rounds, set(recomputed))):
                stats.notes.append(f"{_rounds_words(list(range(valid_rounds, run[0])))}: recomputed again, since "
                                   f"round {run[0]}'s sliding windows read them and they are stored trimmed")
                run = list(range(valid_rounds, run[-1] + 1))
            if run[0] <= valid_rounds:
                valid_rounds = max(valid_rounds, run[-1] + 1)
            self._recompute([(self.rounds[i].token_start, spans[i]) for i in run], stats)
            recomputed += run
        stats.recomputed_rounds = list(rounds)
        return spans

    def _window_held(self, i: int, valid_rounds: int, recomputed: set[int]) -> bool:
        """Whether the cache holds every sliding-window K/V that round i's first token reads: recomputed (rounds
        below `valid_rounds`, or in `recomputed`) or loaded from segments stored with it."""
        window = self.engine.config.sliding_window
        if not window:
            return True
        need = self.rounds[i].token_start - window + 1
        for j in range(i - 1, -1, -1):
            row = self.rounds[j]
            if row.token_end <= need:
                return True
            if j < valid_rounds or j in recomputed:
                continue
            held = [live for (r, _), live in self._stored_live.items() if r == j]
            if not held or max(held) > max(row.token_start, need):
                return False
        return True

    def _register_tiered_rounds(self, plan: RestorePlan, prefix_tokens: list[int], spans, kept: list[int]) -> None:
        """Tiered: hand every round to the cache in order, with its upper K/V when the restore has it (recomputed
        by plan, or stored with its lower layers), and its tokens when it was recomputed. `kept` rounds' upper
        layers recomputed by plan are stored (their lower layers are, by _restored)."""
        upper_groups = [g for g, grp in enumerate(plan.groups) if grp.start >= self.split]
        upper_prefix = plan.prefix[upper_groups[0]] if upper_groups else 0
        n_layers = self.engine.config.n_layers
        start = 0
        for i, row in enumerate(self.rounds):
            end = row.token_end
            tokens = spans[i] if spans is not None else (prefix_tokens[start:end] if end <= len(prefix_tokens)
                                                         else None)
            upper = None
            if i < upper_prefix:
                upper = self._recomputed_upper.read(range(self.split, n_layers), start, end)
            self._add_tiered_round(i, start, end, tokens, upper)
            if upper is not None and i in kept:
                self.writer.submit(self.sid, i, upper, range(self.split, n_layers), range(start, end))
                self._save_bounds(i, range(start, end))
            start = end
        self._recomputed_upper = None

    def _restored(self, stats: RestoreStats, started: float) -> RestoreStats:
        """Close a restore: time it (once the device is done), keep its stats, store again what was recomputed."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        stats.mark("synced", started)
        stats.restore_ms = stats.phases_ms["synced"]
        self.restored = stats
        if self.policy is not None:
            self.cache.upper_source, self.cache.token_source = self._fetch_upper, self._round_tokens
            self.cache.upper_hint = self._hurry_upper
        self._save_recomputed(stats.recomputed_rounds)
        self._save_recomputed(stats.kept_rounds, only_absent=True)
        return stats

    def _save_recomputed(self, rounds: list[int], only_absent: bool = False) -> None:
        """Store again the K/V of rounds recomputed because they could not be loaded, so the next open loads them
        (tiered: their lower layers; their upper layers are recomputed only if a message picks them, and not
        stored). What the plan recomputes is never stored: recomputing it is faster than loading it here.
        `only_absent`: only the layer groups nothing is stored for."""
        if not rounds:
            return
        device_tier = self.cache if self.policy is None else self.cache.lower
        stored: dict[int, list[dict]] = {}
        if only_absent:
            for seg in self.store.segments(self.sid):
                if seg["kind"] == SEGMENT_KV:
                    stored.setdefault(seg["round_idx"], []).append(seg)
        for i in rounds:
            row = self.rounds[i]
            for layers in self.storage_groups:
                if any(s["layer_start"] < layers.stop and layers.start < s["layer_end"] for s in stored.get(i, [])):
                    continue
                if self.policy is None:
                    self._submit_kv(i, layers)
                    continue
                kv = device_tier.read(layers, row.token_start, row.token_end)
                self.writer.submit(self.sid, i, kv, layers, range(row.token_start, row.token_end))

    def store_all(self) -> None:
        """Store every round's K/V from the restored cache, the way rounds are saved as a chat goes on (a chat
        imported or created as text; the bench's stored chats). Full cache only."""
        if self.policy is not None:
            raise KvchatError("store_all stores the full cache's rounds; a tiered chat stores its tiers")
        for i in range(len(self.rounds)):
            for layers in self.storage_groups:
                self._submit_kv(i, layers)

    def store_merged(self) -> int:
        """Store every round again merged in the pairs the chat's statistics pick, after a probe at each round's
        end (a chat stored before it merged: `kvchat merge`); returns how many rounds hold merged pairs."""
        if self.merges is None or self.restored is None:
            raise RuntimeError("store_merged needs a restored chat with merging on")
        spans = self.engine.chat.round_spans(self.conversation())
        tokens = [t for span in spans for t in span]
        with torch.inference_mode():
            self.merges.observe(self.cache, [(r.token_end, tokens[r.token_start:r.token_end]) for r in self.rounds])
        self._round_pairs.clear()
        self.store_all()
        return sum(bool(self._pairs_for(i)) for i in range(len(self.rounds)))

    # ---- sliding-window layers (Gemma 3) ----

    def live_from(self, i: int) -> int:
        """Where round i's stored sliding-window K/V begins (window_live_from at the chat's end; never below
        what the cache itself holds, after a restore from trimmed segments)."""
        row = self.rounds[i]
        if not self.engine.config.sliding_window or not self.trim_windows:
            return row.token_start
        live = window_live_from(self.engine.config, row.token_start, row.token_end, self.rounds[-1].token_end)
        return max(live, min(row.token_end, self._window_valid_from))

    def _windowed(self, seg: dict) -> bool:
        """Whether a segment holds sliding-window layers (a merged pair: its two layers)."""
        held = (seg["layer_start"], seg["layer_end"] - 1) if seg["kind"] == SEGMENT_MERGED else \
            range(seg["layer_start"], seg["layer_end"])
        return any(self.engine.config.window(j) for j in held)

    def _window_readable(self, seg: dict, end: int) -> bool:
        """Whether a stored K/V segment holds every sliding-window K/V a chat ending at `end` reads."""
        if not self._windowed(seg):
            return True
        return seg["live_from"] <= max(seg["token_start"], end - self.engine.config.sliding_window + 1)

    def _submit_kv(self, i: int, layers: range) -> None:
        """Store round i's K/V of `layers` (full cache), zeros before `live_from` in its sliding-window layers;
        layers the round is merged in as zeros, each pair with a layer here as a merged segment first (a crash
        between the two leaves the old K/V row, which names no such pair). A pair across two groups is written with
        each (the same bytes name the same file): a group stored again alone (a sliding window's new `live_from`)
        must not leave its pair as it was."""
        row = self.rounds[i]
        tokens = range(row.token_start, row.token_end)
        live = self._group_live(i, layers)
        kv = self._trimmed(i, layers, live)
        pairs = [p for p in self._pairs_for(i) if p.low in layers or p.high in layers]
        for p in pairs:
            both = torch.cat([self._trimmed(i, range(p.low, p.low + 1)), self._trimmed(i, range(p.high, p.high + 1))])
            merged = merge_pair(both[0], both[1], self.merges.retain)
            self.writer.submit(self.sid, i, merged, range(p.low, p.high + 1), tokens, kind=SEGMENT_MERGED,
                               live_from=self._group_live(i, range(p.low, p.low + 1)))
            for layer in (p.low, p.high):
                if layer in layers:
                    kv[layer - layers.start] = 0
        self.writer.submit(self.sid, i, kv, layers, tokens, live_from=live, merged=pairs_text(pairs))
        self._stored_live[(i, layers.start)] = live

    def _group_live(self, i: int, layers: range) -> int:
        cfg = self.engine.config
        return self.live_from(i) if any(cfg.window(layer) for layer in layers) else self.rounds[i].token_start

    def _trimmed(self, i: int, layers: range, live: int | None = None) -> torch.Tensor:
        """Round i's K/V of `layers` as stored: zeros before `live_from` in sliding-window layers."""
        row = self.rounds[i]
        kv = self.cache.read(layers, row.token_start, row.token_end)
        live = self._group_live(i, layers) if live is None else live
        return zero_unread_windows(kv, layers, self.engine.config, row.token_start, live)

    def _pairs_for(self, i: int) -> list[LayerPair]:
        """The layer pairs round i is stored merged in: those it was first stored with, else the chat's choice now."""
        if self.merges is None:
            return []
        if i not in self._round_pairs:
            # a tiered chat merges within its upper tier: the lower one is read in full at every message
            within = range(self.split if self.policy is not None else 0, self.engine.config.n_layers)
            self._round_pairs[i] = self.merges.pairs(within)
        return self._round_pairs[i]

    def _retrim(self) -> None:
        """Store again the rounds whose sliding-window tail the chat's new end has moved past (or, after a
        retraction, back into reach): only the last rounds before the end can change."""
        cfg = self.engine.config
        if not cfg.sliding_window or self.policy is not None:
            return
        for i in range(len(self.rounds)):
            for layers in self.storage_groups:
                stored = self._stored_live.get((i, layers.start))
                if stored is not None and any(cfg.window(j) for j in layers) and stored != self.live_from(i):
                    self._submit_kv(i, layers)

    def _add_tiered_round(self, i: int, start: int, end: int, tokens: list[int] | None,
                          upper: torch.Tensor | None = None) -> None:
        """Tiered: register round i with its upper layers when the restore has them (recomputed by plan, or in a
        segment of every layer, as the full cache stores), else none yet: the background reads bring them; and its
        key bounds."""
        if self.policy is None:
            return
        parts = self._upper_parts.pop(i, [])
        if upper is None and parts:
            upper = _assemble_upper(parts, self.split, self.engine.config.n_layers)
        bounds = self._stored_bounds(i, start, end) if upper is None else None
        self.cache.add_closed_round(start, end, upper, tokens, bounds=bounds)

    def _start_bounds_fetch(self, bounds: dict[int, list[dict]], finish) -> SegmentPrefetcher | None:
        """Tiered: read every round's key bounds (1/32 of its upper keys) beside the lower layers."""
        if self.policy is None:
            return None
        fetcher = self._prefetcher(bounds, finish)
        fetcher.start()
        return fetcher

    def _prefetcher(self, by_round: dict[int, list[dict]], finish, **options) -> SegmentPrefetcher:
        """A reader of the segment files `by_round` names for each round, in round order."""
        n = len(self.rounds)
        groups = [[seg["file"] for seg in by_round.get(i, [])] for i in range(n)]
        sizes = [sum(seg["raw_size"] for seg in by_round.get(i, [])) for i in range(n)]
        return SegmentPrefetcher(self.store.kv_dir, self.fingerprint, groups, sizes, finish=finish, **options)

    def _stored_bounds(self, i: int, start: int, end: int) -> torch.Tensor | None:
        """Round i's stored key bounds, or None (they are computed from its upper layers at the first recheck
        that needs them; a chat stored before they were kept has none)."""
        fetcher = self._bounds_fetcher
        if fetcher is None or not fetcher.groups[i]:
            return None
        loaded = fetcher.get(i)
        if isinstance(loaded, str):
            reason = loaded
        else:
            header, data = loaded[0]
            bounds = merge_planes(header, data.wait()) if isinstance(data, Staged) else data
            if (header.token_start, header.token_end) == (start, end) and self.cache.key_bounds.fits(end - start,
                                                                                                     bounds):
                return bounds
            reason = "key bounds of another shape or token span"
        log.info("round %d of %s: stored key bounds unusable (%s); computed when needed", i, self.sid, reason)
        return None

    def _start_upper_fetch(self) -> None:
        """Read every round's upper-layer segments into host memory in the background, starting now."""
        total = sum(seg["raw_size"] for segs in self._upper_segments.values() for seg in segs)
        self._upper_fetcher = self._prefetcher(self._upper_segments, self._upper_to_host, window_bytes=total + 1)
        self._upper_fetcher.start()

    def _upper_to_host(self, header, raw) -> torch.Tensor:
        """In a reader thread: one upper segment, token-major in host memory, as TieredKV keeps it."""
        kv = tensor_on(header, raw, "cpu")
        return host_layout(kv, self.engine.model.dtype)

    def _hurry_upper(self, rounds: list[int]) -> None:
        """A message picked these rounds and their upper layers are not in host memory yet: read them now, in
        parallel, ahead of the background read."""
        upper = range(self.split, self.engine.config.n_layers)
        usable = [i for i in rounds if self._unusable(self._upper_segments.get(i, []), upper) is None]
        if self._upper_fetcher is not None and usable:
            self._upper_fetcher.hurry(usable)

    @contextlib.contextmanager
    def answering(self):
        """While the model answers, the background read of upper layers starts nothing new: its threads would take
        the cores and the GIL from the decode loop (at 32k on an H200 decoding fell below the full cache's speed).
        Rounds a message picks are still read at once; the rest resumes when the answer is done."""
        fetcher = self._upper_fetcher
        if fetcher is not None:
            fetcher.pause()
        try:
            yield
        finally:
            if fetcher is not None:
                fetcher.resume()

    def wait_for_upper(self) -> None:
        """Until the background read of every round's upper layers is done (benchmarks: a user who types for a
        while after opening the chat)."""
        if self._upper_fetcher is not None:
            self._upper_fetcher.wait()

    def _fetch_upper(self, i: int) -> torch.Tensor | None:
        """Round i's upper layers, token-major [n, L - split, 2, Hkv, D], from the store, or None (saying why) to
        recompute."""
        row, segments = self.rounds[i], self._upper_segments.get(i, [])
        reason = self._unusable(segments, range(self.split, self.engine.config.n_layers))
        if reason is None:
            loaded = self._upper_fetcher.take(i)
            if isinstance(loaded, str):
                reason = loaded
            elif not _hold_span(segments, loaded, row.token_start, row.token_end):
                reason = "upper-layer segment holds another token span"
            else:
                return self._host_upper(segments, loaded, row.token_end - row.token_start)
        note = f"round {i}: {reason}; its upper layers recomputed"
        log.info("%s (chat %s)", note, self.sid)
        if self.restored is not None:
            self.restored.notes.append(note)
        return None

    def _host_upper(self, segments: list[dict], loaded: list[tuple], n: int) -> torch.Tensor:
        """Token-major upper K/V [n, L - split, 2, Hkv, D] from a round's upper segments, merged pairs unmerged."""
        kv = sorted(((s, t) for s, (_, t) in zip(segments, loaded) if s["kind"] == SEGMENT_KV),
                    key=lambda st: st[0]["layer_start"])
        host = kv[0][1] if len(kv) == 1 else torch.cat([t for _, t in kv], dim=1)
        for seg, (_, tensor) in zip(segments, loaded):
            if seg["kind"] == SEGMENT_MERGED:
                both = unmerge_pair(tensor.permute(1, 2, 3, 0, 4), n)  # back to [2, 2, Hkv, n + m, D] first
                for layer, layer_kv in zip((seg["layer_start"], seg["layer_end"] - 1), both):
                    host[:, layer - self.split] = layer_kv.permute(2, 0, 1, 3)
        return host

    def store_tiers(self) -> int:
        """Tiered: store again, as a lower and an upper segment, every round whose K/V came as one segment of all
        layers (a chat saved under the full cache), so the next open reads only the lower layers up front.
        Returns how many rounds were re-stored."""
        if self.policy is None or self.restored is None:
            raise RuntimeError("store_tiers needs a tiered chat, restored")
        n_layers, done = self.engine.config.n_layers, 0
        by_round: dict[int, list[dict]] = {}
        for seg in self.store.segments(self.sid):
            by_round.setdefault(seg["round_idx"], []).append(seg)
        for i, row in enumerate(self.rounds):
            segs = by_round.get(i, [])
            if not any(s["layer_start"] < self.split < s["layer_end"] for s in segs):
                continue
            # The restore reads layers above the split in the background: wait for this round's, and its key bounds.
            self.cache.ensure_upper(i)
            upper = self.cache.round_upper(i)
            old = [s["file"] for s in segs]
            self.store.drop_segments(self.sid, i)  # a crash from here on costs a recompute, never text
            tokens = range(row.token_start, row.token_end)
            lower = self.cache.lower.read(range(self.split), row.token_start, row.token_end)
            self.writer.submit(self.sid, i, lower, range(self.split), tokens)
            self.writer.submit(self.sid, i, upper, range(self.split, n_layers), tokens)
            self._save_bounds(i, tokens)
            self.writer.drain()
            self.store.unlink_files(self.store.unreferenced(old))
            done += 1
        return done

    def _round_tokens(self, i: int) -> list[int]:
        return self.engine.chat.round_spans(self.conversation())[i]

    def _recompute_all(self, spans: list[list[int]], stats: RestoreStats, started: float) -> RestoreStats:
        stats.tokens_loaded = 0
        stats.notes = ["the chat's tokens no longer match the stored spans (a new system prompt or chat template); "
                       "recomputed from text"]
        ends = list(itertools.accumulate(len(s) for s in spans))
        total = ends[-1]
        self.cache, self._ring_fork = self._new_cache(total + 512), None
        self._recompute([(0, [t for s in spans for t in s])], stats, loads_running=False)  # nothing is loaded
        if self.policy is None:
            self.cache.length = total
        else:
            self._upper_segments = {}  # stored for the old spans: not to be trusted
            for e, span in zip(ends, spans):
                self.cache.add_closed_round(e - len(span), e, None, span)
        stats.recomputed_rounds = list(range(len(spans)))
        # The text's tokens are the truth: store the new spans (and forget K/V stored for the old ones).
        self.store.unlink_files(self.store.set_round_spans(self.sid, [e - len(s) for e, s in zip(ends, spans)], ends))
        self.rounds = self.store.rounds(self.sid)
        return self._restored(stats, started)

    def _load_round(self, i: int, start: int, end: int, segments: list[dict], fetcher: SegmentPrefetcher,
                    keep_from: int = 0) -> str | None:
        """None when round i's K/V of layers [keep_from, split) came from disk, else why it could not."""
        row = self.rounds[i]
        if (row.token_start, row.token_end) != (start, end) or end <= start:
            return "its stored token span is inconsistent"
        reason = self._unusable(segments, range(keep_from, self.split))
        if reason is not None:
            return reason
        t0 = time.perf_counter()
        loaded = fetcher.get(i)
        self._waited += time.perf_counter() - t0
        if isinstance(loaded, str):
            return loaded
        if not _hold_span(segments, loaded, start, end):
            return "segment holds another token span"
        listed = set(self._listed_pairs([s for s in segments if s["kind"] == SEGMENT_KV]))
        for seg, (header, data) in zip(segments, loaded):  # K/V rows first: their merged layers are zeros
            kv = merge_planes(header, data.wait()) if isinstance(data, Staged) else data
            if seg["kind"] != SEGMENT_MERGED:
                self._place(i, range(seg["layer_start"], seg["layer_end"]), start, kv, keep_from)
                continue
            pair = LayerPair(seg["layer_start"], seg["layer_end"] - 1)
            if pair in listed:  # else left over from before its round was stored again without it
                try:
                    both = unmerge_pair(kv, end - start)
                except ValueError as exc:
                    return f"merged K/V of layers {pair} damaged ({exc})"
                self._place(i, range(pair.low, pair.low + 1), start, both[0:1], keep_from)
                self._place(i, range(pair.high, pair.high + 1), start, both[1:2], keep_from)
        return None

    def _unusable(self, segments: list[dict], layers: range) -> str | None:
        """Why `segments` (one round's rows) cannot supply K/V of every layer in `layers`, or None."""
        kv = [s for s in segments if s["kind"] == SEGMENT_KV]
        covered = sorted((s["layer_start"], s["layer_end"]) for s in kv
                         if s["layer_start"] < layers.stop and layers.start < s["layer_end"])
        if not covered:
            return "no K/V stored"
        expect = layers.start
        for lo, hi in covered:
            if lo > expect:
                return f"K/V of layers {expect}..{lo - 1} missing"
            expect = max(expect, hi)
        if expect < layers.stop:
            return f"K/V of layers {expect}..{layers.stop - 1} missing"
        if any(seg["model_fingerprint"] != self.fingerprint for seg in segments):
            return "K/V belongs to another model"
        return self._merges_unusable(kv, segments, layers)

    def _merges_unusable(self, kv: list[dict], segments: list[dict], layers: range) -> str | None:
        """Why the layer pairs the K/V rows hold merged cannot be restored in `layers`, or None."""
        # every pair with a layer from `layers` up: a tiered restore takes the upper layers of a segment that holds
        # them too, so a pair above the split must be there as well
        wanted = [p for p in self._listed_pairs(kv) if p.high >= layers.start]
        if not wanted:
            return None
        if self.ignore_merges:
            return f"stored with layers {', '.join(map(str, wanted))} merged (undoing merges)"
        held = {(s["layer_start"], s["layer_end"]) for s in segments if s["kind"] == SEGMENT_MERGED}
        missing = [p for p in wanted if (p.low, p.high + 1) not in held]
        if missing:
            return f"merged K/V of layers {', '.join(map(str, missing))} missing"
        return None

    @staticmethod
    def _listed_pairs(kv: list[dict]) -> list[LayerPair]:
        return sorted({p for s in kv for p in parse_pairs(s.get("merged") or "")})

    def _place(self, i: int, layers: range, start: int, kv: torch.Tensor, keep_from: int = 0) -> None:
        """Write loaded K/V of `layers` from `keep_from` up into the cache (the layers below are the recompute
        stream's); tiered, the part above the split waits for its round."""
        if keep_from > layers.start:
            if keep_from >= layers.stop:
                return
            kv, layers = kv[keep_from - layers.start:], range(keep_from, layers.stop)
        if self.policy is None:
            self.cache.write(layers, start, kv)
            return
        below = max(0, min(layers.stop, self.split) - layers.start)
        if below:
            self.cache.lower.write(range(layers.start, layers.start + below), start, kv[:below])
        if below < len(layers):
            self._upper_parts.setdefault(i, []).append((range(layers.start + below, layers.stop), kv[below:]))

    def _recompute(self, pending: list[tuple[int, list[int]]], stats: RestoreStats,
                   loads_running: bool = True) -> None:
        """Prefill runs of consecutive missing rounds at their own slots and positions, attending to all before."""
        if not pending:
            return
        m = self.engine.model
        first = pending[0][0]
        tokens = [t for _, span in pending for t in span]
        end = first + len(tokens)
        device_tier = self._recompute_tier(loads_running)
        device_tier.reserve(end)
        # In prefill's chunks: a whole 30k-token chat in one pass would build [T, T]-sized attention masks.
        for at in range(first, end, PrefixRecompute.CHUNK):
            piece = tokens[at - first : at - first + PrefixRecompute.CHUNK]
            m.run_layers(m.embed(torch.tensor(piece)), torch.arange(at, at + len(piece)), device_tier, at,
                         layers=range(self.split))
        stats.tokens_recomputed += len(tokens)

    # ---- a new round ----

    def send(self, text: str, *, max_tokens: int = 512, sampling: SamplingParams = SamplingParams(),
             on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
             guard: ReplyGuard = ReplyGuard()) -> GenerationResult:
        """Answer `text` as the chat's next round and save it. An empty message, or one the context cannot hold, is
        refused before anything is saved."""
        if not text.strip():
            raise KvchatError("the message is empty")
        if self.restored is None:
            self.restore()
        idx, start = len(self.rounds), self.cache.length
        prompt = self.engine.chat.open_round_tokens(self.conversation(), text)
        mp = self.message_policy
        starts = [r.token_start for r in self.rounds]
        view = mp.for_message(self.engine.model, self.cache, starts, [], prompt) if mp is not None else \
            contextlib.nullcontext()
        with view as attend, self.answering():
            result = generate(self.engine.model, self.cache, prompt, decoder=self.engine.tokenizer.stream_decoder(),
                              max_tokens=max_tokens, sampling=sampling, stop_tokens=self.engine.tokenizer.eog_ids,
                              stop_strings=self.engine.chat.stop_strings, on_token=on_token, cancel=cancel,
                              attend=attend, policy=mp, **self.engine.guarding(guard))
        closed = self.engine.chat.round_spans(self.conversation(Round(text, result.text)))[-1]
        row = RoundRow(idx, text, result.text, start, start + len(closed), now())
        crash_point("round-text")
        self.store.add_round(self.sid, row)  # the text is safe from here on
        crash_point("round-committed")
        self.rounds.append(row)
        if not self._settle_cache(start, prompt + result.tokens[:-1], closed):
            return result  # its K/V are computed again (and stored) when the chat is next restored
        if self.merges is not None and self.policy is None:  # the chat's statistics: late rows of message, reply
            with torch.inference_mode():
                self.merges.observe(self.cache, [(start + len(prompt), closed[:len(prompt)]), (row.token_end, closed)])
        self._save_round(idx, row)
        if self.compactor is not None:
            compactor = self.compactor
            self.writer.submit_job(lambda: compactor(self.store, self.sid), f"compacting after round {idx}")
        if self.restored is not None:
            r = self.restored
            self.store.record_restore(self.sid, tokens_loaded=r.tokens_loaded, tokens_recomputed=r.tokens_recomputed,
                                      restore_ms=r.restore_ms, ttft_ms=1000 * result.first_token_seconds,
                                      notes=r.notes, tokens_planned=r.tokens_planned, compute_ms=r.compute_ms,
                                      load_ms=r.load_ms, gap_ms=r.gap_ms, plan=r.plan)
            self.restored = RestoreStats(notes=[])  # recorded once per open
        return result

    def _save_round(self, idx: int, row: RoundRow) -> None:
        """Hand the new round's K/V to the writer: a segment per layer group, or (tiered) a lower and an upper."""
        tokens, n_layers = range(row.token_start, row.token_end), self.engine.config.n_layers
        if self.policy is None:
            for layers in self.storage_groups:
                self._submit_kv(idx, layers)
            self._retrim()
            return
        self.cache.close_round()
        lower, upper_layers = range(self.split), range(self.split, n_layers)
        self.writer.submit(self.sid, idx, self.cache.lower.read(lower, row.token_start, row.token_end), lower, tokens)
        upper = self.cache.round_upper(idx)  # a copy: the cache keeps the exact K/V
        pairs = [p for p in self._pairs_for(idx) if p.low >= self.split]
        for p in pairs:  # merged pair first, then the upper segment naming it (as _submit_kv)
            merged = merge_pair(upper[p.low - self.split], upper[p.high - self.split], self.merges.retain)
            self.writer.submit(self.sid, idx, merged, range(p.low, p.high + 1), tokens, kind=SEGMENT_MERGED)
        for p in pairs:
            upper[[p.low - self.split, p.high - self.split]] = 0
        self.writer.submit(self.sid, idx, upper, upper_layers, tokens, merged=pairs_text(pairs))
        self._save_bounds(idx, tokens)

    def _save_bounds(self, idx: int, tokens: range) -> None:
        bounds = self.cache.round_bounds(idx)
        if bounds is not None:
            upper = range(self.split, self.engine.config.n_layers)
            self.writer.submit(self.sid, idx, bounds, upper, tokens, kind=SEGMENT_KEY_BOUNDS)

    @torch.inference_mode()
    def _settle_cache(self, start: int, have: list[int], closed: list[int]) -> bool:
        """Make slots [start, ...) hold exactly the closed round's tokens: keep what generation already computed
        where it agrees with the template's tokens, compute the rest (usually just the end-of-turn tail). False:
        the cache was let go instead (the next message restores the chat)."""
        common = 0
        for a, b in zip(have, closed):
            if a != b:
                break
            common += 1
        if self._window_gone(start + common):
            # A reply that re-reads differently from far back in a long round: the rings no longer hold what the
            # windows read there. The next message restores the chat (recomputing this round's K/V).
            self.cache, self.restored = self._new_cache(256), None
            return False
        self.cache.truncate(start + common)
        if common < len(closed):
            if self.policy is None:
                prefill(self.engine.model, self.cache, closed[common:])
            else:
                self.cache.prefill(closed[common:])
        return True

    def retract_last_round(self) -> RoundRow | None:
        """Remove the last round (text and K/V) from the store and the cache, to answer its message again."""
        self.writer.drain()  # its K/V may still be on the way to disk
        row, orphans = self.store.delete_last_round(self.sid)
        self.store.unlink_files(orphans)
        if row is None:
            return None
        self.rounds = self.rounds[:-1]
        for layers in self.storage_groups:
            self._stored_live.pop((len(self.rounds), layers.start), None)
        if self._window_gone(row.token_start):
            # The window before the new end was restored from segments stored trimmed (zeros in the cache): the
            # next message restores the chat again, which recomputes what the windows read.
            self.cache, self.restored = self._new_cache(256), None
        elif self.restored is not None or self.cache.length:
            self.cache.truncate(row.token_start)
            self._retrim()
        return row

    def _window_gone(self, end: int) -> bool:
        """Whether a chat cut back to `end` would read sliding-window K/V the cache holds as zeros, or that its
        rings no longer hold."""
        window = self.engine.config.sliding_window
        if not window or not self.cache.length:
            return False
        if end - window + 1 < self._window_valid_from:
            return True
        return isinstance(self.cache, KVCache) and not self.cache.holds_window(end)  # a tiered cache has no rings

    def close(self) -> None:
        self.writer.drain()
        self.stop_reading()

    def stop_reading(self) -> None:
        """Stop the background read of upper layers (a chat put out of memory): no more disk or memory spent on it."""
        if self._upper_fetcher is not None:
            self._upper_fetcher.close()


@dataclass
class _Loading:
    """What the helper thread placing loaded rounds did (read by the restoring thread once it is done)."""

    started: float
    ended: float | None = None
    tokens: int = 0
    fallback: list[int] = field(default_factory=list)
    reasons: list[tuple[int, str]] = field(default_factory=list)
    error: BaseException | None = None


def _rounds_words(rounds: list[int]) -> str:
    """[0, 1, 2, 5] -> "rounds 0-2, 5"."""
    runs, start = [], rounds[0]
    for a, b in zip(rounds, rounds[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ("round " if len(rounds) == 1 else "rounds ") + ", ".join(runs)


def _assemble_upper(parts: list[tuple[range, torch.Tensor]], split: int, n_layers: int) -> torch.Tensor | None:
    """A tiered round's upper K/V [L - split, 2, Hkv, n, D] from the parts a restore placed, in order (a merged
    pair's layers over the zeros its segment held), or None unless they cover every upper layer."""
    covered: set[int] = set()
    for layers, _ in parts:
        covered |= set(layers)
    if not covered >= set(range(split, n_layers)):
        return None
    upper = parts[0][1].new_empty(n_layers - split, *parts[0][1].shape[1:])
    for layers, kv in parts:
        upper[layers.start - split : layers.stop - split] = kv
    return upper


def _hold_span(segments: list[dict], loaded: list[tuple], start: int, end: int) -> bool:
    """Whether every loaded segment (header, data) holds tokens [start, end): one row per token (K/V), or as many
    and the retained ones after them (a merged pair)."""
    return all((header.token_start, header.token_end) == (start, end) and token_rows_fit(
        seg["kind"], header.shape[3], end - start) for seg, (header, _) in zip(segments, loaded))
