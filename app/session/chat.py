"""A stored chat driven by the engine: restore its KV from disk, answer a new message, save the round.

A round's message is committed before it is answered and its reply the moment it ends (or is stopped); its K/V
(all layers) is written to a segment file by a background thread after, and its database row only once the file is
durable. One process writes a chat at a time (`writing`: a lock across processes; a session whose chat another
process wrote to takes that in first). Restoring loads every round's stored K/V
into the cache at its original slots and recomputes from text any round whose K/V is missing, corrupt, or from
another model, saying why.

Under a tiered KV policy (Round Attention) each round is stored as two segments, its lower and its upper layers;
restoring loads the lower layers of every round onto the device and starts reading every round's upper layers
into host memory in the background, from where a message's chosen rounds are copied to the device.

ChatSession is the conversation and its cache; the jobs it hands off live beside it: one restore
(restore.RestoreRun), saving rounds (saving.RoundSaver), the writer thread (writer.KVWriter), sliding-window
trimming (windows.WindowTrim), the upper tier's reads (tiered.UpperReads) and the stored layout (layout).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import torch

from kvchat.app.session.lazy import FrameFilesOpening, LazyResumeFailed, StoredRows, lazily_loadable
from kvchat.app.session.layout import Planner, chat_groups
from kvchat.app.session.merges import ChatMerges
from kvchat.app.session.restore import RestoreCancelled, RestoreProgress, RestoreRun, RestoreStats
from kvchat.app.session.saving import RoundSaver
from kvchat.app.session.tiered import UpperReads
from kvchat.app.session.units import ChatUnits, stores_units
from kvchat.app.session.windows import WindowTrim
from kvchat.app.session.writer import KVWriter
from kvchat.engine.engine import Engine
from kvchat.engine.generate import GenerationResult, TokenCallback, generate, prefill
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.host_resident import HostResidentKV
from kvchat.engine.kv.tiered import TieredKV
from kvchat.engine.policies import KVPolicy
from kvchat.engine.policies.unit_retrieval import UnitRetrievalPolicy
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.errors import ContextOverflowError, KvchatError
from kvchat.storage.chat_lock import ChatLock
from kvchat.storage.db import REPLY_DONE, REPLY_PARTIAL, REPLY_PENDING, RoundRow, Store, StoreError, now
from kvchat.storage.failpoints import crash_point
from kvchat.storage.fingerprint import model_fingerprint

log = logging.getLogger("kvchat.session")


def settled_prefix(have: list[int], closed: list[int]) -> int:
    """How many of the closed round's tokens generation already computed K/V for (`have`: the prompt and the reply
    as fed), which settling a round keeps."""
    common = 0
    for a, b in zip(have, closed):
        if a != b:
            break
        common += 1
    return common


def held_weakly(method: Callable) -> Callable:
    """A session's bound method that does not keep the session alive, for a cache to hold: the session holds its
    cache, and a cycle between the two would keep a dropped chat's K/V on the GPU until the cycle collector ran (at
    32k under an 8 GiB budget, the last resume's tiers beside the next one's: out of memory)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is None:
            raise RuntimeError("the chat session of this cache is gone")
        return bound(*args)
    return call


class ChatSession:
    def __init__(self, store: Store, engine: Engine, sid: str, writer: KVWriter | None = None,
                 policy: KVPolicy | None = None, planner: Planner | None = None,
                 compactor: Callable[[Store, str], object] | None = None, trim_windows: bool = True,
                 merges: "ChatMerges | None" = None, ignore_merges: bool = False, lazy_resume: bool = False):
        """`policy`: a tiered KV policy (engine.policies, e.g. "round"), one over the full cache ("loopserve"), or
        None for the full cache.
        `planner`: chooses what a restore recomputes and what it loads (app.session.profile.profile_planner);
        None loads everything stored. `compactor`: run on the writer's thread after each round is saved
        (app.session.compaction), or None. `trim_windows`: store sliding-window layers only where a later round can
        still read them (see `live_from`); off, every layer of every token is stored (the bench's comparison).
        `lazy_resume`: a louiskv chat's first message after opening is answered before its K/V is in
        (app/session/lazy.py), where the chat allows it."""
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
        self.cache: KVCache | TieredKV | HostResidentKV = self._new_cache(256)
        self.restored: RestoreStats | None = None
        self.merges = merges
        self.ignore_merges = ignore_merges
        self.lazy_resume = lazy_resume
        self.lazy_rows: StoredRows | None = None  # the latest lazy resume's reads (for the bench and tests)
        self.lazy_open_s: dict[str, float] = {}  # the latest lazy open's parts (s): checks, cache, units, layout
        # One writer per chat across processes (storage.chat_lock): how long a send waits for another one's.
        self.lock_wait_s = 600.0
        self._writer_lock: ChatLock | None = None
        self._stale = False  # a failed save left the store and this session apart: reload before the next write
        self.sent_restore: RestoreStats | None = None  # the restore the last send made and recorded, if any
        # Slots a restore leaves past the chat for the message and reply to come (a send sets it to what it needs:
        # answering then grows no cache, which would hold the old and the new side by side for a moment).
        self.room = 512
        # Said with every restore (its notes, so `kvchat show` has them): e.g. that the GPU memory budget put the
        # chat on the tiered cache.
        self.restore_notes: list[str] = []
        self._start_helpers()

    def _new_cache(self, capacity: int) -> KVCache | TieredKV | HostResidentKV:
        if self.policy is not None:
            return TieredKV(self.engine.model, self.policy, capacity)
        own = self.message_policy.chat_cache(self.engine.model, capacity) if self.message_policy is not None \
            else None
        if own is not None:  # a per-layer budget's chat in host memory (engine.kv.host_resident)
            return own
        # Sliding-window layers (Gemma 3) keep only their window, in a ring: unless every layer of every token is to
        # be stored (trim_windows off).
        return self.engine.new_cache(capacity, ring=self.trim_windows)

    @property
    def host_resident(self) -> bool:
        """The chat's K/V lives in host memory, streamed through the device by each message."""
        return isinstance(self.cache, HostResidentKV)

    def use_message_policy(self, policy: KVPolicy | None) -> None:
        """Answer the next messages under `policy`, a policy over the full cache of the same kind (a new budget):
        the cache stays as it is (a host-resident one reads its new budget)."""
        self.message_policy = policy
        if isinstance(self.cache, HostResidentKV):
            self.cache.policy = policy

    @property
    def split(self) -> int:
        """Layers [0, split) are loaded at restore; the rest (tiered policies) only when a message picks a round."""
        return self.engine.config.n_layers if self.policy is None else self.policy.split

    @property
    def _tiered_split(self) -> int | None:
        return self.policy.split if self.policy is not None else None

    @property
    def storage_groups(self) -> tuple[range, ...]:
        """The layer groups each round is stored as: the full cache's groups, or a tiered chat's lower tier."""
        return chat_groups(self.engine, self._tiered_split)

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
        # A host-resident chat loads what is stored into host memory; recomputing a front of it on the device while
        # the rest loads (the planner's split) would need its K/V there.
        planner = None if self.host_resident else self.planner
        self._drop_lazy_resume()  # a whole restore: no message of this cache brings rows in
        run = self._restore_run(self._new_cache, planner)
        # the rounds' retrieval units (louiskv): their files read beside the K/V, handed over after it
        stored_units = self._units_of_policy()
        ahead = stored_units.read_ahead(self.rounds) if stored_units is not None else None
        try:
            stats = run.run(progress, cancel)
            stats.notes[:0] = self.restore_notes
            if stored_units is not None and isinstance(run.cache, KVCache):  # read (ahead), or built once and stored
                stats.notes += stored_units.load(run.cache, run.rounds, ahead)
        except RestoreCancelled:
            self.rounds = run.rounds
            self.cache, self.restored = self._new_cache(256), None
            raise
        except BaseException:
            self._adopt(run)  # whatever the failed restore had made, as the session holds it
            raise
        self._adopt(run)
        return stats

    def _restore_run(self, new_cache: Callable[[int], object], planner: Planner | None) -> RestoreRun:
        return RestoreRun(self.store, self.engine, self.sid, self.rounds, self.system, fingerprint=self.fingerprint,
                          split=self.split, tiered=self.policy is not None, new_cache=new_cache, planner=planner,
                          windows=self.windows, saver=self.saver, upper_reads=self.upper_reads,
                          upper_source=held_weakly(self._fetch_upper), token_source=held_weakly(self._round_tokens),
                          ignore_merges=self.ignore_merges, room=self.room)

    @torch.inference_mode()
    def restore_lazily(self) -> bool:
        """Open the chat for its next message without its K/V (app/session/lazy.py): its rounds' units read, an
        empty cache of its length, and the message policy told to bring rows in as the message's layers choose them,
        then the rest. False (nothing done, the reason in the next restore's notes) where the chat does not allow it."""
        policy, model = self.message_policy, self.engine.model
        if not isinstance(policy, UnitRetrievalPolicy) or not stores_units(policy) or not self.rounds:
            return False
        started = time.perf_counter()
        segments = self.store.segments(self.sid)
        why = ("its model has sliding-window layers" if any(layer.window for layer in model.layers) else
               lazily_loadable(segments, self.rounds, self.engine.config.n_layers))
        total = self.rounds[-1].token_end
        cache = None
        opened = time.perf_counter()
        opening = None
        if why is None:  # (the device's full cache: a policy over it makes no cache of its own)
            cache = self._new_cache(total + self.room)
            made = time.perf_counter()
            # the unit-frames files opened on reader threads while the units are read (the first layer needs both)
            opening = FrameFilesOpening(self.store, segments, self.rounds, self.fingerprint, cache.kv.dtype)
            stored_units = self._units_of_policy()
            try:
                missing = stored_units.load_stored(cache, self.rounds)
            except BaseException:
                opening.close()
                raise
            self.lazy_open_s = {"checks": opened - started, "cache": made - opened,
                                "units": time.perf_counter() - made,
                                **{f"units_{part}": took for part, took in stored_units.load_stored_s.items()}}
            if missing:
                why = f"{len(missing)} of {len(self.rounds)} rounds have no stored retrieval units"
        if why is not None:
            if opening is not None:
                opening.close()
            self.restore_notes = [*self.restore_notes, f"not opened lazily: {why}"]
            return False
        cache.length = total
        stats = RestoreStats(notes=[*self.restore_notes])
        stats.plan = "lazy: units read; rounds brought in as the message's layers choose them, the rest after its " \
                     "first token"
        laid_out = time.perf_counter()
        try:
            rows = StoredRows(self.store, segments, self.fingerprint, self.rounds, cache, stats,
                              restore_whole=lambda: self._restore_whole_into(cache, stats),
                              members={r.idx: cache.units[(r.token_start, r.token_end)].member for r in self.rounds},
                              global_layers=model.cfg.global_layers,
                              after_complete=lambda: stored_units.load(cache, self.rounds), opening=opening)
        except BaseException:  # (the files being opened are closed, not left to the collector)
            opening.close()
            raise
        policy.lazy = self.lazy_rows = rows
        self.lazy_open_s["layout"] = time.perf_counter() - laid_out
        self.cache, self.restored = cache, stats
        stats.restore_ms = 1000 * (time.perf_counter() - started)
        return True

    def _drop_lazy_resume(self) -> None:
        """This session's lazy resume let go: its files and reader threads closed now (not when the cycle collector
        runs; the rows keep their figures, for the bench and the tests), and the policy, which may outlive the
        session, no longer holding them, nor through them the cache."""
        if self.lazy_rows is not None:
            self.lazy_rows.close()
        if isinstance(self.message_policy, UnitRetrievalPolicy) and self.message_policy.lazy is self.lazy_rows:
            self.message_policy.lazy = None

    def _restore_whole_into(self, cache: KVCache, stats: RestoreStats) -> None:
        """A lazily opened chat's whole restore, into the cache its first token was answered from (where a round
        could not be read as it was brought in: the restore recomputes it)."""
        whole_run = self._restore_run(lambda capacity: cache, self.planner)
        whole = whole_run.run(None, None)
        self.rounds = whole_run.rounds
        stats.tokens_loaded, stats.tokens_recomputed = whole.tokens_loaded, whole.tokens_recomputed
        stats.tokens_planned, stats.compute_ms, stats.load_ms = whole.tokens_planned, whole.compute_ms, whole.load_ms
        stats.notes += whole.notes

    def _adopt(self, run: RestoreRun) -> None:
        """Take what a restore made: its cache (once made), its stats (once done), the rounds as it read them."""
        self.rounds = run.rounds
        if run.cache is not None:
            self.cache = run.cache
        if run.restored is not None:
            self.restored = run.restored

    def _units(self, cache) -> ChatUnits | None:
        """The chat's stored retrieval units, where its message policy keeps them (louiskv) on a cache of every
        layer (KVCache); None elsewhere."""
        if not isinstance(cache, KVCache):
            return None
        return self._units_of_policy()

    def _units_of_policy(self) -> ChatUnits | None:
        """The chat's stored retrieval units where its message policy keeps them (louiskv), whatever the cache."""
        if not stores_units(self.message_policy):
            return None
        return ChatUnits(self.store, self.writer, self.sid, self.fingerprint, self.engine.model, self.message_policy,
                         unit_rows=self.lazy_resume)

    def _fetch_upper(self, i: int) -> torch.Tensor | None:
        """TieredKV's upper_source: round i's upper layers from the store, or None to recompute them."""
        row = self.rounds[i]
        return self.upper_reads.fetch(i, row, self.restored.notes if self.restored is not None else None)

    def _round_tokens(self, i: int) -> list[int]:
        return self.engine.chat.round_spans(self.conversation())[i]

    # ---- storing the chat again ----

    def store_all(self) -> None:
        """Store every round's K/V from the restored cache, the way rounds are saved as a chat goes on (a chat
        imported or created as text; the bench's stored chats). Full cache only."""
        self.saver.store_all(self.cache, self.rounds)

    def store_merged(self) -> int:
        """Store every round again merged in the pairs the chat's statistics pick, after a probe at each round's
        end (a chat stored before it merged: `kvchat merge`); returns how many rounds hold merged pairs."""
        if self.merges is None or self.restored is None:
            raise RuntimeError("store_merged needs a restored chat with merging on")
        spans = self.engine.chat.round_spans(self.conversation())
        return self.saver.store_merged(self.cache, self.rounds, [t for span in spans for t in span])

    def store_tiers(self) -> int:
        """Tiered: store again, as a lower and an upper segment, every round whose K/V came as one segment of all
        layers (a chat saved under the full cache), so the next open reads only the lower layers up front.
        Returns how many rounds were re-stored."""
        if self.policy is None or self.restored is None:
            raise RuntimeError("store_tiers needs a tiered chat, restored")
        return self.saver.store_tiers(self.cache, self.rounds)

    # ---- sliding-window layers (Gemma 3) ----

    def live_from(self, i: int) -> int:
        """Where round i's stored sliding-window K/V begins (window_live_from at the chat's end; never below
        what the cache itself holds, after a restore from trimmed segments)."""
        return self.windows.live_from(self.rounds, i)

    # ---- the upper tier's background read ----

    def answering(self):
        """While the model answers, the background read of upper layers starts nothing new: its threads would take
        the cores and the GIL from the decode loop (at 32k on an H200 decoding fell below the full cache's speed).
        Rounds a message picks are still read at once; the rest resumes when the answer is done."""
        return self.upper_reads.answering()

    def wait_for_upper(self) -> None:
        """Until the background read of every round's upper layers is done (benchmarks: a user who types for a
        while after opening the chat)."""
        self.upper_reads.wait()

    # ---- a new round ----

    # ---- one writer at a time ----

    @contextlib.contextmanager
    def writing(self, on_wait: Callable[[dict | None], None] | None = None, cancel: threading.Event | None = None):
        """Hold the chat's writer lock across processes (storage.chat_lock) for what follows, and first take in what
        another process wrote to the chat since it was read here. The lock is let go by the K/V writer once every
        round saved meanwhile is on disk, so no other process replaces a round whose K/V is still being written.
        Re-entrant (regenerating: a retraction, then a send)."""
        if self._writer_lock is not None:
            yield
            return
        try:
            lock = ChatLock.acquire(self.store.home, self.sid, wait_s=self.lock_wait_s, on_wait=on_wait,
                                    cancel=cancel)
        except OSError as exc:
            raise self.store.place_error(exc, "lock the chat for writing") from None
        self._writer_lock = lock
        try:
            self.reload_if_changed()
            yield
        finally:
            self._writer_lock = None
            self.writer.submit_job(lock.release, f"letting go of chat {self.sid}")

    def reload_if_changed(self) -> bool:
        """Whether the chat's text in the store differs from what this session holds (another process wrote to it,
        or a save here failed half-way): then the session starts again from the store, and the next message restores
        the chat — loading the other process's rounds where their K/V is stored, recomputing them where not."""
        rows, info = self.store.rounds(self.sid), self.store.session(self.sid)
        if not self._stale and rows == self.rounds and info["system_prompt"] == self.system:
            return False
        self.upper_reads.close()
        self.info, self.rounds, self._stale = info, rows, False
        self.cache, self.restored = self._new_cache(256), None
        self._start_helpers()
        return True

    def _start_helpers(self) -> None:
        """The helpers that outlive a restore, fresh: what is stored of the sliding windows, how rounds are saved,
        and (tiered) the background read of the upper layers, which the cache pulls rounds from."""
        self.windows = WindowTrim(self.engine.config, self.trim_windows)
        self.saver = RoundSaver(self.store, self.writer, self.sid, self.engine.config, self.storage_groups,
                                self.windows, split=self._tiered_split, merges=self.merges)
        self.upper_reads = UpperReads(self.store, self.engine, self.sid, self.fingerprint, self.split,
                                      self.ignore_merges)

    # ---- a new round ----

    def send(self, text: str, *, max_tokens: int = 512, sampling: SamplingParams = SamplingParams(),
             on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
             guard: ReplyGuard = ReplyGuard(), on_wait: Callable[[dict | None], None] | None = None
             ) -> GenerationResult:
        """Answer `text` as the chat's next round and save it.

        The message is committed first (its reply pending), so no crash from then on loses it; the reply replaces
        the pending one when it ends — whole, or as far as it got when stopped (`cancel`, which the CLI's Ctrl-C and
        SIGTERM set) or interrupted by an exception (marked partial). The K/V is saved after, in the background.
        An empty message, or one the context cannot hold, is refused and leaves nothing behind. `on_wait` hears when
        another process is writing to the chat and this send waits for it."""
        if not text.strip():
            raise KvchatError("the message is empty")
        with self.writing(on_wait, cancel):
            return self._send(text, max_tokens=max_tokens, sampling=sampling, on_token=on_token, cancel=cancel,
                              guard=guard)

    def _send(self, text: str, *, max_tokens: int, sampling: SamplingParams, on_token: TokenCallback | None,
              cancel: threading.Event | None, guard: ReplyGuard) -> GenerationResult:
        idx = len(self.rounds)
        start = self.rounds[-1].token_end if self.rounds else 0
        # The message as a round whose reply is empty: a crash before the reply is saved leaves a chat that restores.
        empty = self.engine.chat.round_spans(self.conversation(Round(text, "")))[-1]
        pending = RoundRow(idx, text, "", start, start + len(empty), now(), REPLY_PENDING)
        crash_point("message-text")
        self.store.add_round(self.sid, pending)  # the message is safe from here on
        crash_point("message-committed")
        streamed: list[str] = []

        def collect(token: int, piece: str) -> None:
            streamed.append(piece)
            if on_token is not None:
                on_token(token, piece)
            if len(streamed) == 1:
                crash_point("reply-token")

        def answer() -> tuple[int, list[int], GenerationResult]:
            start = self.cache.length
            prompt = self.engine.chat.open_round_tokens(self.conversation(), text)
            self._make_room(start + len(prompt) + max_tokens + 1)
            mp = self.message_policy
            starts = [r.token_start for r in self.rounds]
            view = mp.for_message(self.engine.model, self.cache, starts, [], prompt) if mp is not None else \
                contextlib.nullcontext()
            with view as attend, self.answering():
                return start, prompt, generate(
                    self.engine.model, self.cache, prompt, decoder=self.engine.tokenizer.stream_decoder(),
                    max_tokens=max_tokens, sampling=sampling, stop_tokens=self.engine.tokenizer.eog_ids,
                    stop_strings=self.engine.chat.stop_strings, on_token=collect, cancel=cancel, attend=attend,
                    policy=mp, strip=self.engine.chat.transcript, **self.engine.guarding(guard))

        try:
            self.sent_restore = None
            self.room = max(self.room, len(empty) + max_tokens + 1)
            if self.restored is None and not (self.lazy_resume and self.restore_lazily()):
                self.restore(cancel=cancel)
            try:
                start, prompt, result = answer()
            except LazyResumeFailed as exc:  # raised in the message's prefill: no token is out yet
                self.cache, self.restored = self._new_cache(256), None
                self.restore(cancel=cancel).notes.append(f"the lazy resume stopped ({exc}): restored whole")
                start, prompt, result = answer()
            if getattr(self.message_policy, "lazy", None) is not None:
                # a lazily answered reply that ended at its first token (no decode step finished the resume)
                self.message_policy.finish_lazy_resume(self.engine.model, self.cache, start)
        except ContextOverflowError:
            self.store.drop_pending_round(self.sid, pending)  # refused: as if never sent
            self._stale = True
            self._drop_lazy_resume()
            raise
        except BaseException:
            # Stopped in the middle (a second Ctrl-C, a failure): what had streamed is kept as a partial reply; the
            # cache is let go (the next message restores the chat, whole).
            self._stale = True
            self._drop_lazy_resume()
            self._keep_partial(pending, "".join(streamed))
            raise
        state = REPLY_PARTIAL if result.stop_reason == "cancelled" else REPLY_DONE
        closed = self.engine.chat.round_spans(self.conversation(Round(text, result.text)))[-1]
        row = RoundRow(idx, text, result.text, start, start + len(closed), pending.created, state)
        crash_point("round-text")
        try:
            self.store.finish_round(self.sid, row)  # the reply is safe from here on
        except StoreError as exc:
            self._stale = True
            raise StoreError(f"{exc}; the reply was not saved (the message is, its reply marked not saved)") from None
        except BaseException:
            self._stale = True  # the message stays, its reply pending
            raise
        crash_point("round-committed")
        self.rounds.append(row)
        self._save_budgets(self.message_policy, idx)
        if not self._settle_cache(start, prompt + result.tokens[:-1], closed):
            return result  # its K/V are computed again (and stored) when the chat is next restored
        if self.merges is not None and self.policy is None and not self.host_resident:
            # the chat's statistics: late rows of message and reply (read on the device)
            with torch.inference_mode():
                self.merges.observe(self.cache, [(start + len(prompt), closed[:len(prompt)]), (row.token_end, closed)])
        self.saver.save_round(self.cache, self.rounds, idx)
        units = self._units(self.cache)
        if units is not None:  # its retrieval units (louiskv), from its K/V and the reply's trigger
            units.save(self.cache, row, start + len(prompt))
        if self.compactor is not None:
            compactor = self.compactor
            self.writer.submit_job(lambda: compactor(self.store, self.sid), f"compacting after round {idx}")
        if self.restored is not None:
            r = self.restored
            try:
                self.store.record_restore(self.sid, tokens_loaded=r.tokens_loaded,
                                          tokens_recomputed=r.tokens_recomputed, restore_ms=r.restore_ms,
                                          ttft_ms=1000 * result.first_token_seconds, notes=r.notes,
                                          tokens_planned=r.tokens_planned, compute_ms=r.compute_ms, load_ms=r.load_ms,
                                          gap_ms=r.gap_ms, plan=r.plan)
            except StoreError as exc:  # what the open cost is for `show`; the round itself is saved
                log.warning("the restore's figures were not recorded: %s", exc)
            if r.tokens_loaded or r.tokens_recomputed or r.notes:
                self.sent_restore = r
            self.restored = RestoreStats(notes=[])  # recorded once per open
        return result

    def _make_room(self, slots: int) -> None:
        """Grow the cache once, to exactly what the message and its reply need, rather than by doubling as it
        fills (what the GPU memory plan counts; the decode graph reserves the same)."""
        slots = min(slots, self.engine.config.context_length + 1)
        device_tier = self.cache.lower if isinstance(self.cache, TieredKV) else self.cache
        if device_tier.capacity < slots:
            device_tier.reserve(slots, exact=True)

    def _save_budgets(self, policy: KVPolicy | None, idx: int) -> None:
        """A layer-budget policy's choice for this reply (XKV: engine.policies.budgets), kept with the chat and
        added to the model's average, for `kvchat show`. The reply is saved already: a store that refuses this
        costs the figures, nothing else."""
        choice = getattr(policy, "last_choice", None)
        if choice is None:
            return
        try:
            self.store.save_kv_budgets(self.sid, policy=policy.name, budget=policy.budget,
                                       input_slots=choice.input_slots, kept=choice.kept,
                                       retention=choice.retention, round_idx=idx, fingerprint=self.fingerprint)
        except StoreError:
            pass

    def _keep_partial(self, pending: RoundRow, text: str) -> None:
        """Save what streamed of an interrupted reply over its pending one, if the store still takes writes."""
        closed = self.engine.chat.round_spans(self.conversation(Round(pending.user_text, text)))[-1]
        start = self.rounds[-1].token_end if self.rounds else 0  # a restore may have tokenized the chat anew
        row = RoundRow(pending.idx, pending.user_text, text, start, start + len(closed), pending.created,
                       REPLY_PARTIAL)
        with contextlib.suppress(Exception):  # the original failure is the one to report
            self.store.finish_round(self.sid, row)

    @torch.inference_mode()
    def _settle_cache(self, start: int, have: list[int], closed: list[int]) -> bool:
        """Make slots [start, ...) hold exactly the closed round's tokens: keep what generation already computed
        where it agrees with the template's tokens, compute the rest (usually just the end-of-turn tail). False:
        the cache was let go instead (the next message restores the chat)."""
        common = settled_prefix(have, closed)
        if self.windows.gone(self.cache, start + common):
            # A reply that re-reads differently from far back in a long round: the rings no longer hold what the
            # windows read there. The next message restores the chat (recomputing this round's K/V).
            self.cache, self.restored = self._new_cache(256), None
            return False
        self.cache.truncate(start + common)
        if common < len(closed):
            if self.host_resident:  # through the layers again, choosing nothing
                self.cache.compute(self.engine.model, closed[common:])
            elif self.policy is None:
                prefill(self.engine.model, self.cache, closed[common:])
            else:
                self.cache.prefill(closed[common:])
        return True

    def retract_last_round(self) -> RoundRow | None:
        """Remove the last round (text and K/V) from the store and the cache, to answer its message again (under
        `writing()`, with the send that answers it)."""
        self.writer.drain()  # its K/V may still be on the way to disk
        row, orphans = self.store.delete_last_round(self.sid)
        self.store.unlink_files(orphans)
        if row is None:
            return None
        self.rounds = self.rounds[:-1]
        self.windows.forget(len(self.rounds), self.storage_groups)
        if self.windows.gone(self.cache, row.token_start):
            # The window before the new end was restored from segments stored trimmed (zeros in the cache): the
            # next message restores the chat again, which recomputes what the windows read.
            self.cache, self.restored = self._new_cache(256), None
        elif self.restored is not None or self.cache.length:
            self.cache.truncate(row.token_start)
            self.saver.retrim(self.cache, self.rounds)
        return row

    def retract_rounds_from(self, first: int) -> list[RoundRow]:
        """Remove rounds `first`, `first` + 1, … (text and K/V) from the store and the cache, to answer an edited
        message as round `first` (under `writing()`, with the send that answers it). The rounds before keep their
        K/V: in the cache, truncated at round `first`'s start, and on disk."""
        self.writer.drain()  # their K/V may still be on the way to disk
        rows, orphans = self.store.delete_rounds_from(self.sid, first)
        self.store.unlink_files(orphans)
        if not rows:
            return []
        for row in rows:
            self.windows.forget(row.idx, self.storage_groups)
        self.rounds = self.rounds[:first]
        if self.windows.gone(self.cache, rows[0].token_start):
            self.cache, self.restored = self._new_cache(256), None  # as in retract_last_round
        elif self.restored is not None or self.cache.length:
            self.cache.truncate(rows[0].token_start)
            self.saver.retrim(self.cache, self.rounds)
        return rows

    def close(self) -> None:
        self.writer.drain()
        self.stop_reading()
        self._drop_lazy_resume()  # (one not completed: a closed chat, an answer cut short)

    def stop_reading(self) -> None:
        """Stop the background read of upper layers (a chat put out of memory): no more disk or memory spent on it."""
        self.upper_reads.close()
