"""One restore of a stored chat: bring a new cache to the end of the chat, loading what is on disk and recomputing
the rest, saying why.

The plan (layout.plan_for_chat) recomputes the chat's first rounds on one stream while a helper thread places
every loaded round as its segments arrive; rounds that could not be loaded (missing, corrupt, from another model,
trimmed too far) are recomputed once both are done, and stored again. Under a tiered KV policy only the lower
layers come up front (and the key bounds); the upper tier's background read (tiered.UpperReads) starts at the end.

A RestoreRun is made for each restore and holds that restore's state (its plan's loads, the rounds it places,
the ring fork, the upper parts it collects, the scratch cache of recomputed upper layers): separate from the
session so that none of it outlives the restore on the long-lived session, and so a cancelled or failed restore
leaves nothing half-made behind.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvchat.app.session.layout import (NO_KV_STORED, Planner, hold_span, listed_pairs, plan_for_chat, segment_files,
                                       unusable)
from kvchat.app.session.saving import RoundSaver
from kvchat.app.session.tiered import UpperReads, assemble_upper
from kvchat.app.session.windows import WindowTrim
from kvchat.engine.engine import Engine
from kvchat.engine.kv.cross_layer import LayerPair, unmerge_pair
from kvchat.engine.kv.host_resident import HostResidentKV
from kvchat.engine.model.decoder import KVCache
from kvchat.engine.restore.plan import RestorePlan
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep, RecomputeCancelled
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.errors import ContextOverflowError, KvchatError
from kvchat.storage.db import CACHE_KINDS, SEGMENT_KEY_BOUNDS, SEGMENT_KV, SEGMENT_MERGED, RoundRow, Store
from kvchat.storage.prefetch import SegmentPrefetcher
from kvchat.storage.segments import merge_planes, tensor_on
from kvchat.storage.staging import HostToDevice, Staged

log = logging.getLogger("kvchat.session")

RestoreProgress = Callable[[int, int], None]  # (tokens restored so far, tokens in the chat)


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
    damaged: list[str] = field(default_factory=list)  # stored K/V that could not be used (and was recomputed)
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


class RestoreRun:
    """One restore of a chat (run once). Afterwards `cache` is the restored cache (None until the restore made
    it), `rounds` the chat's rounds (read again if the restore stored new token spans) and `restored` its stats
    (None until it finished)."""

    def __init__(self, store: Store, engine: Engine, sid: str, rounds: list[RoundRow], system: str | None, *,
                 fingerprint: str, split: int, tiered: bool, new_cache: Callable[[int], object],
                 planner: Planner | None, windows: WindowTrim, saver: RoundSaver, upper_reads: UpperReads,
                 upper_source: Callable[[int], torch.Tensor | None], token_source: Callable[[int], list[int]],
                 ignore_merges: bool = False, room: int = 512):
        """`split`: layers [0, split) are restored now (all of them for the full cache); `tiered`: the chat runs
        under a tiered policy, whose cache gets `upper_source`/`token_source` and the upper reads' hurry;
        `new_cache(capacity)`: an empty cache of the chat's kind; `room`: slots the new cache keeps past the chat
        (the message and reply to come, so that answering grows nothing); the rest are the session's
        collaborators."""
        self.store, self.engine, self.sid, self.rounds, self.system = store, engine, sid, rounds, system
        self.fingerprint, self.split, self.tiered, self.new_cache = fingerprint, split, tiered, new_cache
        self.planner, self.windows, self.saver, self.upper_reads = planner, windows, saver, upper_reads
        self.upper_source, self.token_source, self.ignore_merges = upper_source, token_source, ignore_merges
        self.room = room
        self.cache = None
        self.restored: RestoreStats | None = None
        self._waited = 0.0
        self._bounds_fetcher: SegmentPrefetcher | None = None  # tiered: the rounds' key bounds, read beside
        self._upper_parts: dict[int, list[tuple[range, torch.Tensor]]] = {}  # tiered: upper K/V loaded with lower
        self._recomputed_upper: KVCache | None = None  # tiered: a scratch cache of upper layers recomputed by plan
        self._ring_fork: KVCache | None = None  # the recompute tier for a cache with rings

    def conversation(self) -> Conversation:
        return Conversation([Round(r.user_text, r.assistant_text) for r in self.rounds], self.system)

    def run(self, progress: RestoreProgress | None, cancel: threading.Event | None) -> RestoreStats:
        started = time.perf_counter()
        stats, self._waited = RestoreStats(), 0.0
        by_round: dict[int, list[dict]] = {}
        upper_only: dict[int, list[dict]] = {}  # tiered: segments of upper layers only, read in the background
        bounds: dict[int, list[dict]] = {}  # tiered: each round's key bounds, read with the lower layers
        ends = [r.token_end for r in self.rounds]
        total = ends[-1] if ends else 0
        trimmed: set[int] = set()
        for seg in self.store.segments(self.sid):
            if seg["kind"] not in CACHE_KINDS:
                continue  # an index of the K/V (a round's retrieval units), read by the session that uses it
            if seg["kind"] == SEGMENT_KEY_BOUNDS:
                into = bounds if self.tiered and seg["layer_start"] == self.split else {}
            elif seg["kind"] == SEGMENT_MERGED and self.ignore_merges:
                continue  # the K/V rows naming it make their round recomputed (unusable)
            elif not self.windows.readable(seg, total):
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
        self.windows.restored_from(by_round)
        if total > self.engine.config.context_length:
            raise ContextOverflowError(f"the chat holds {total} tokens; the model's context is "
                                       f"{self.engine.config.context_length}")
        self.upper_reads.reset(upper_only)
        rows = {i: by_round.get(i, []) + upper_only.get(i, []) for i in range(len(self.rounds))}
        plan = plan_for_chat(self.rounds, rows, self.store, self.fingerprint, self.planner,
                             self.engine.config.n_layers, self.split if self.tiered else None)
        stats.mark("planned", started)
        stats.plan = plan.summary(ends)
        if plan.predicted is not None:
            stats.predicted_ms = 1000 * plan.predicted.total_s
        self.cache, self._ring_fork = self.new_cache(total + self.room), None
        stats.mark("cache", started)
        # What the plan loads: per round, the segments holding any layer it does not recompute (the upper tier of
        # a tiered chat comes later, in the background, unless it came in one segment with the lower layers).
        loads = {i: [s for s in by_round.get(i, []) if s["layer_end"] > plan.recomputed_layers(i).stop]
                 for i in range(len(ends))}
        # Reads, checks and decompression run ahead in worker threads, while this thread moves each round's K/V to
        # the device in order as soon as it is ready.
        # The workers also finish each segment: merged on the CPU, or copied to the GPU through pinned buffers.
        if HostToDevice.serves(self.engine.device) and not isinstance(self.cache, HostResidentKV):
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
        if self.tiered:
            # Only once the lower layers are in: started earlier, this read competed with the restore for the disk
            # and the cores (at 32k on an H200 it made the restore slower than the full cache's).
            self.upper_reads.start(len(self.rounds))
        return restored

    def _route_merged(self, by_round: dict[int, list[dict]], upper_only: dict[int, list[dict]]) -> None:
        """Each merged pair goes with the K/V rows that name it (tiered: read with the lower layers, or in the
        background with the upper ones); one that no K/V row names is left over, never read."""
        for i in set(by_round) | set(upper_only):
            merged = [s for s in by_round.get(i, []) + upper_only.get(i, []) if s["kind"] == SEGMENT_MERGED]
            for into in (by_round, upper_only):
                if i not in into:
                    continue
                listed = {(p.low, p.high + 1) for p in listed_pairs(
                    [s for s in into[i] if s["kind"] == SEGMENT_KV])}
                into[i] = [s for s in into[i] if s["kind"] != SEGMENT_MERGED] + [
                    s for s in merged if (s["layer_start"], s["layer_end"]) in listed]

    def _prefetcher(self, by_round: dict[int, list[dict]], finish, **options) -> SegmentPrefetcher:
        """A reader of the segment files `by_round` names for each round, in round order."""
        groups, sizes = segment_files(by_round, len(self.rounds))
        return SegmentPrefetcher(self.store.kv_dir, self.fingerprint, groups, sizes, finish=finish, **options)

    def _start_bounds_fetch(self, bounds: dict[int, list[dict]], finish) -> SegmentPrefetcher | None:
        """Tiered: read every round's key bounds (1/32 of its upper keys) beside the lower layers."""
        if not self.tiered:
            return None
        fetcher = self._prefetcher(bounds, finish)
        fetcher.start()
        return fetcher

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
        stats.damaged += [f"round {i}: {reason}" for i, reason in loading.reasons if reason != NO_KV_STORED]
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
        if not self.tiered:
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
        if self.tiered:
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
            if run[0] > valid_rounds and (ringed or not self.windows.held(self.rounds, run[0], valid_rounds,
                                                                          set(recomputed))):
                stats.notes.append(f"{_rounds_words(list(range(valid_rounds, run[0])))}: recomputed again, since "
                                   f"round {run[0]}'s sliding windows read them and they are stored trimmed")
                run = list(range(valid_rounds, run[-1] + 1))
            if run[0] <= valid_rounds:
                valid_rounds = max(valid_rounds, run[-1] + 1)
            self._recompute([(self.rounds[i].token_start, spans[i]) for i in run], stats)
            recomputed += run
        stats.recomputed_rounds = list(rounds)
        return spans

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
                self.saver.save_upper(self.cache, i, upper, range(start, end))
            start = end
        self._recomputed_upper = None

    def _restored(self, stats: RestoreStats, started: float) -> RestoreStats:
        """Close a restore: time it (once the device is done), keep its stats, store again what was recomputed."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        stats.mark("synced", started)
        stats.restore_ms = stats.phases_ms["synced"]
        self.restored = stats
        if self.tiered:
            self.cache.upper_source, self.cache.token_source = self.upper_source, self.token_source
            self.cache.upper_hint = self.upper_reads.hurry
        self.saver.save_recomputed(self.cache, self.rounds, stats.recomputed_rounds)
        self.saver.save_recomputed(self.cache, self.rounds, stats.kept_rounds, only_absent=True)
        return stats

    def _add_tiered_round(self, i: int, start: int, end: int, tokens: list[int] | None,
                          upper: torch.Tensor | None = None) -> None:
        """Tiered: register round i with its upper layers when the restore has them (recomputed by plan, or in a
        segment of every layer, as the full cache stores), else none yet: the background reads bring them; and its
        key bounds."""
        if not self.tiered:
            return
        parts = self._upper_parts.pop(i, [])
        if upper is None and parts:
            upper = assemble_upper(parts, self.split, self.engine.config.n_layers)
        bounds = self._stored_bounds(i, start, end) if upper is None else None
        self.cache.add_closed_round(start, end, upper, tokens, bounds=bounds)

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

    def _recompute_all(self, spans: list[list[int]], stats: RestoreStats, started: float) -> RestoreStats:
        stats.tokens_loaded = 0
        stats.notes = ["the chat's tokens no longer match the stored spans (a new system prompt or chat template); "
                       "recomputed from text"]
        ends = list(itertools.accumulate(len(s) for s in spans))
        total = ends[-1]
        self.cache, self._ring_fork = self.new_cache(total + self.room), None
        self._recompute([(0, [t for s in spans for t in s])], stats, loads_running=False)  # nothing is loaded
        if not self.tiered:
            self.cache.length = total
        else:
            self.upper_reads.segments = {}  # stored for the old spans: not to be trusted
            for e, span in zip(ends, spans):
                self.cache.add_closed_round(e - len(span), e, None, span)
        stats.recomputed_rounds = list(range(len(spans)))
        # The text's tokens are the truth: store the new spans (and forget K/V stored for the old ones).
        self.store.unlink_files(self.store.set_round_spans(self.sid, [e - len(s) for e, s in zip(ends, spans)], ends))
        # (A message committed ahead of its reply, past the rounds restored here, is not one of them.)
        self.rounds = self.store.rounds(self.sid)[:len(self.rounds)]
        return self._restored(stats, started)

    def _load_round(self, i: int, start: int, end: int, segments: list[dict], fetcher: SegmentPrefetcher,
                    keep_from: int = 0) -> str | None:
        """None when round i's K/V of layers [keep_from, split) came from disk, else why it could not."""
        row = self.rounds[i]
        if (row.token_start, row.token_end) != (start, end) or end <= start:
            return "its stored token span is inconsistent"
        reason = unusable(segments, range(keep_from, self.split), self.fingerprint, self.ignore_merges)
        if reason is not None:
            return reason
        t0 = time.perf_counter()
        loaded = fetcher.get(i)
        self._waited += time.perf_counter() - t0
        if isinstance(loaded, str):
            return loaded
        if not hold_span(segments, loaded, start, end):
            return "segment holds another token span"
        listed = set(listed_pairs([s for s in segments if s["kind"] == SEGMENT_KV]))
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

    def _place(self, i: int, layers: range, start: int, kv: torch.Tensor, keep_from: int = 0) -> None:
        """Write loaded K/V of `layers` from `keep_from` up into the cache (the layers below are the recompute
        stream's); tiered, the part above the split waits for its round."""
        if keep_from > layers.start:
            if keep_from >= layers.stop:
                return
            kv, layers = kv[keep_from - layers.start:], range(keep_from, layers.stop)
        if not self.tiered:
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
        if isinstance(self.cache, HostResidentKV):  # streamed through the device a layer at a time, into host memory
            self.cache.compute(m, tokens, start=first)
            stats.tokens_recomputed += len(tokens)
            return
        device_tier = self._recompute_tier(loads_running)
        device_tier.reserve(end)
        # In prefill's chunks: a whole 30k-token chat in one pass would build [T, T]-sized attention masks.
        for at in range(first, end, PrefixRecompute.CHUNK):
            piece = tokens[at - first : at - first + PrefixRecompute.CHUNK]
            m.run_layers(m.embed(torch.tensor(piece)), torch.arange(at, at + len(piece)), device_tier, at,
                         layers=range(self.split))
        stats.tokens_recomputed += len(tokens)


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
