"""`ChatService`: what the chat commands (app/chats.py) and the terminal app do with the engine and the store, as
plain thread-safe Python (no click, no textual here): create, open, list, fork, export and import chats, and the
one place a chat's session is wired (`ChatService.wire`: its KV policy, this machine's profile and restore planner,
compaction, cross-layer merges and the K/V writer).

The app calls these methods from worker threads only; a command calls them once and closes the service. The engine
is single-stream, so every piece of model work (restoring a chat, answering, regenerating) runs under one lock;
storage calls that must not interleave with a round being saved (delete, fork, export, a new system prompt) take
the same lock and first wait until the chat's K/V writer has put every finished round on disk. A chat runs under
the KV policy the caller names (the app's setting or `kvchat send --kv-policy`: the full cache, Round Attention on a
tiered cache, or LoopServe); the policy is built once per model (app/session/policies.py, calibrating the model on
its first use). On CUDA every model and chat is planned within the GPU memory budget (`gpu_memory`:
app/session/memory.py, engine/memory_plan.py): a model whose weights cannot fit is refused before it loads, a chat
whose K/V cannot fit whole runs on the tiered cache (Round Attention) whatever policy was asked for, saying so once,
and one that cannot fit even so is refused before its message is committed. The app and the commands share the
semantics: same store, same state files, the title of an untitled chat is its first message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvchat.app.session import memory
from kvchat.app.terminal_text import terminal_line
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.compaction import compact_session
from kvchat.app.session.editing import EditRequest, fork_title
from kvchat.app.session.memory import OPEN_ROOM, Budget, check_weights, plan_chat, plan_host_chat
from kvchat.app.session.merges import chat_merges
from kvchat.app.session.policies import chat_policy
from kvchat.app.session.profile import ensure_profile, profile_planner
from kvchat.app.session.progress import OnProgress
from kvchat.app.session.restore import RestoreStats
from kvchat.app.session.transcripts import render_transcript, write_transcript
from kvchat.app.session.writer import KVWriter
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine, ModelInfo
from kvchat.engine.generate import GenerationResult, TokenCallback
from kvchat.engine.policies import BUDGET_POLICIES, KVPolicy, chat_policy_class
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import Conversation
from kvchat.errors import GPUMemoryError, KvchatError
from kvchat.storage.chat_lock import ChatLock
from kvchat.storage.db import RoundRow, Store, StoreError, chat_parameters
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.statefile import ImportResult, export_session, import_state

# A per-layer budget policy's name with this suffix ("xkv:host") runs the chat host-resident: what the GPU memory
# budget makes of "xkv" when the chat's full K/V does not fit (fitting_policy), and the name a reply reports.
HOST_RESIDENT = ":host"

# How many restored chats keep their KV cache in memory; reopening one of them costs nothing.
CHATS_IN_MEMORY = 4
# How long deleting a chat or changing its system prompt waits for another process writing to it (a send waits
# longer: its own message is at stake, and the user chose to send it now).
CHANGE_WAIT_S = 10.0

Progress = Callable[[int, int], None]  # (done, total)


@dataclass
class ChatSummary:
    """One row of the sidebar."""

    id: str
    title: str
    updated: str  # ISO time of the last change
    n_rounds: int
    kv_bytes: int
    kv_status: str  # "in memory" | "on disk" | "text only" | "empty"
    created: str = ""  # ISO time the chat was made (`kvchat sessions --json`)
    model_path: str = ""


@dataclass
class ChatStats:
    """What the status bar says about one chat."""

    model_path: str
    device: str = ""
    context_used: int = 0
    context_length: int = 0
    kv_bytes: int = 0
    kv_raw_bytes: int = 0
    restore: RestoreStats | None = None
    restore_source: str = ""  # "this run": restored now; "earlier": the store's record of the last open
    memory: str = ""  # why the chat runs on the tiered cache although another policy was asked for, if it does
    base_model: bool = False  # the model has no chat template: its chat is a plain User:/Assistant: transcript


@dataclass
class Reply:
    """A finished answer: the round as stored and how fast it came."""

    round: RoundRow
    result: GenerationResult
    title: str  # the chat's title afterwards (an untitled chat takes its first message)
    restore: RestoreStats | None = None  # the restore this send made (its notes: K/V recomputed because damaged)
    kv_policy: str = "full"  # the policy it ran under (the GPU memory budget may have put it on the tiered cache)


@dataclass
class _OpenChat:
    session: ChatSession
    stats: RestoreStats | None  # None until it is restored (by its first send)
    kv_policy: str  # the policy name it was restored under: another name reopens it


@dataclass
class Transcript:
    info: dict
    rounds: list[RoundRow] = field(default_factory=list)


class ChatService:
    def __init__(self, home: Path | None = None, device: str | None = None, gpu_memory: int | None = None):
        self.home, self.device = home, device
        # Bytes kvchat may allocate on CUDA (`--gpu-memory`, the app's setting; None: what the card has free), and
        # how a refusal names it. Read whenever a model loads or a chat is planned, so a new setting applies to both.
        self.gpu_memory = gpu_memory
        self.gpu_memory_name = "--gpu-memory"
        self._memory_notes: dict[str, str] = {}  # chat -> why the budget put it on the tiered cache (said once)
        self._store: Store | None = None
        self._engines: dict[str, Engine] = {}
        self._writers: dict[str, KVWriter] = {}  # one background writer per model fingerprint
        # (model file, policy name, its budget) -> built policy
        self._policies: dict[tuple[str, str, float | None], KVPolicy | None] = {}
        self._open: OrderedDict[str, _OpenChat] = OrderedDict()  # restored chats, least recently used first
        self.model_lock = threading.RLock()  # one forward pass at a time, and no save racing a delete
        self._state_lock = threading.RLock()
        self._load_lock = threading.Lock()  # a model file is loaded once even when two workers ask at once
        # The app's setting (`kvchat send --compact`): after each saved round, drop the K/V restores on this machine
        # recompute anyway. Read when a round is saved, so a change reaches the chats already open.
        self.compact_kv = True
        # The share of a chat's K/V each reply reads under the xkv policy (`--kv-budget`, the app's setting; None:
        # the policy's default). Read when the policy is built, so a new setting applies to the chats opened next.
        self.kv_budget: float | None = None
        self.notice: Callable[[str], None] | None = None  # tells the user about a profile being measured
        self.on_progress: OnProgress | None = None  # shows how far a profile being measured is (app/session/progress)

    def chat_info(self, sid: str) -> dict:
        """The chat's row (`sid` may be a unique prefix of its id, as the commands take it)."""
        return self.store.session(sid)

    # ---- store, engines ----

    @property
    def store(self) -> Store:
        with self._state_lock:
            if self._store is None:
                self._store = Store(self.home)  # opening sweeps what interrupted saves left behind
            return self._store

    def engine(self, model_path: str | Path) -> Engine:
        """The engine of a model file, loaded once per path."""
        key = str(Path(model_path).resolve())
        with self._load_lock:
            with self._state_lock:
                if key in self._engines:
                    return self._engines[key]
            if not Path(key).exists():
                raise KvchatError(f"the model file {key} is missing")
            check_weights(key, self.budget())  # and torch's allocator capped at the budget, before the model loads
            engine = Engine(key, device=self.device)
            if engine.dequantized_types and self.notice is not None:
                self.notice(f"{Path(key).name}: its {', '.join(engine.dequantized_types)} matrices have no GPU kernel "
                            f"yet and were dequantized to {str(engine.dtype).removeprefix('torch.')} at load (more "
                            f"GPU memory, same answers)")
            with self._state_lock:
                self._engines[key] = engine
            return engine

    def budget(self) -> Budget | None:
        """The GPU memory budget on the device models load on (torch's allocator capped at `gpu_memory`); None off
        CUDA."""
        return memory.memory_budget(self.device, self.gpu_memory, self.gpu_memory_name)

    def fitting_policy(self, sid: str, engine: Engine, kv_policy: str, new_tokens: int,
                       calibrating: Progress | None = None) -> str:
        """The policy the chat can run under within the GPU memory budget, with room for `new_tokens` more (a
        message and its reply): `kv_policy` if its K/V fits; a per-layer budget policy (xkv) with its K/V in host
        memory (`xkv:host`) if that fits; else the tiered cache ("round") if only that fits, either said
        once through `notice` and in the chat's restore notes; GPUMemoryError, in one line with the bytes it
        needs, if nothing fits. The split of the tiered cache is the model's watershed (calibrated on first use)."""
        budget = self.budget()
        if budget is None:
            return kv_policy
        rounds = self.store.rounds(sid)
        lengths = [r.token_end - r.token_start for r in rounds]
        chat_tokens = rounds[-1].token_end if rounds else 0
        cls = chat_policy_class(kv_policy)
        asked_tiered = cls is not None and cls.tiered
        split = self.policy(engine, kv_policy, calibrating).split if asked_tiered else None
        plan = plan_chat(engine, budget, chat_tokens, new_tokens, lengths, split)
        if (plan.kind != "full" and kv_policy in BUDGET_POLICIES
                and (budgeted := self.policy(engine, kv_policy, calibrating)) is not None):  # None: nothing to budget
            # A per-layer budget reads a share of the chat: its K/V can stay in host memory, streamed through the
            # GPU by each message (engine.kv.host_resident), before the tiered cache is tried.
            host = plan_host_chat(engine, budget, chat_tokens, new_tokens, lengths, budgeted)
            if host.kind == "host":
                plan, kv_policy = host, kv_policy + HOST_RESIDENT
                if self._memory_notes.get(sid) is None and self.notice is not None:
                    self.notice(plan.message)
        if plan.kind == "tiered" and split is None:  # the full cache does not fit: the tiered cache, at its split
            kv_policy = "round"
            plan = plan_chat(engine, budget, chat_tokens, new_tokens, lengths,
                             self.policy(engine, kv_policy, calibrating).split)
            if plan.kind == "tiered" and self._memory_notes.get(sid) is None and self.notice is not None:
                self.notice(plan.message)
        if plan.kind == "refused":
            raise GPUMemoryError(plan.message)
        with self._state_lock:
            if plan.kind == "host" or (plan.kind == "tiered" and not asked_tiered):
                self._memory_notes[sid] = plan.message
            else:
                self._memory_notes.pop(sid, None)
        return kv_policy

    def loaded_engine(self, model_path: str | Path) -> Engine | None:
        with self._state_lock:
            return self._engines.get(str(Path(model_path).resolve()))

    def policy(self, engine: Engine, name: str, calibrating: Progress | None = None) -> KVPolicy | None:
        """The chat policy `name` (None: the full cache) for the engine's model, built once. The round policy
        calibrates a model on its first use (seconds to minutes, reported to `calibrating(done, total)`)."""
        base, host_resident = name.removesuffix(HOST_RESIDENT), name.endswith(HOST_RESIDENT)
        key = (str(engine.path), name, self.kv_budget if base in BUDGET_POLICIES else None)
        with self.model_lock:  # calibrating runs the model; held, it also keeps two workers from calibrating twice
            with self._state_lock:
                if key in self._policies:
                    return self._policies[key]
            if base in BUDGET_POLICIES and not engine.config.global_layers:
                # every layer attends within a window of its own: there is no budget to choose, nothing to score
                policy = None
                if self.notice is not None:
                    self.notice(f"{terminal_line(Path(engine.path).name)}: every layer reads only its sliding "
                                f"window, so {base} has nothing to budget; its chats read the full cache")
            else:
                policy = chat_policy(base, engine, calibrating, self.kv_budget, host_resident=host_resident)
            with self._state_lock:
                self._policies[key] = policy
            return policy

    def _writer(self, engine: Engine) -> KVWriter:
        fp = model_fingerprint(Path(engine.path), self.store)
        with self._state_lock:
            if fp not in self._writers:
                self._writers[fp] = KVWriter(self.store, fp)
            return self._writers[fp]

    def drain(self) -> list[str]:
        """Wait until every finished round's K/V is on disk; returns (and forgets) the saves that failed."""
        with self._state_lock:
            writers = list(self._writers.values())
        problems = []
        for w in writers:
            w.drain()
            problems += w.errors
            w.errors.clear()
        return problems

    # ---- the list of chats ----

    def chat_list(self) -> list[ChatSummary]:
        with self._state_lock:
            in_memory = set(self._open)
        out = []
        for r in self.store.sessions():
            if r["id"] in in_memory:
                status = "in memory"
            elif r["kv_bytes"]:
                status = "on disk"
            else:
                status = "text only" if r["n_rounds"] else "empty"
            out.append(ChatSummary(r["id"], r["title"], r["updated"], r["n_rounds"], r["kv_bytes"], status,
                                   created=r["created"], model_path=r["model_path"]))
        return out

    def transcript(self, sid: str) -> Transcript:
        info = self.store.session(sid)
        return Transcript(info, self.store.rounds(info["id"]))

    def create_chat(self, model_path: str | Path, system_prompt: str | None = None, title: str = "") -> str:
        """As `kvchat new`: refuse a bad model now, not at the first message."""
        path = Path(model_path).resolve()
        if not path.exists():
            raise KvchatError(f"the model file {path} is missing")
        info = ModelInfo.read(path)
        fp = model_fingerprint(path, self.store)
        self.store.upsert_model(fp, path=str(path), name=info.name, arch=info.config.arch,
                                n_layers=info.config.n_layers, kv_bytes_per_token=info.config.kv_bytes_per_token(2))
        return self.store.create_session(title=title, model_fingerprint=fp, model_path=str(path),
                                         system_prompt=system_prompt or None)

    # ---- restore and answer ----

    def restore(self, sid: str, progress: Progress | None = None, cancel: threading.Event | None = None, *,
                kv_policy: str = "full", calibrating: Progress | None = None) -> ChatStats:
        """Bring the chat's KV cache into memory under `kv_policy` (from disk where it can); RestoreCancelled when
        `cancel` is set. `calibrating` hears about the calibration the round policy may need first."""
        with self.model_lock:
            kv_policy = self._fit(sid, kv_policy, OPEN_ROOM, calibrating)
            self._session(sid, kv_policy, progress, cancel, calibrating)
        return self.chat_stats(sid)

    def _fit(self, sid: str, kv_policy: str, new_tokens: int, calibrating: Progress | None,
             message: str = "") -> str:
        """fitting_policy for the chat `sid` on its model (loaded here, within the budget), with room for
        `new_tokens` and the tokens of `message` as its round renders them (its template's too)."""
        if self.budget() is None:
            return kv_policy
        info = self.store.session(sid)
        if not Path(info["model_path"]).exists():
            raise KvchatError(f"the chat's model {info['model_path']} is missing; its text is safe")
        engine = self.engine(info["model_path"])
        if message:
            new_tokens += len(engine.chat.open_round_tokens(Conversation([], info["system_prompt"]), message))
        return self.fitting_policy(info["id"], engine, kv_policy, new_tokens, calibrating)

    def _session(self, sid: str, kv_policy: str, progress=None, cancel: threading.Event | None = None,
                 calibrating: Progress | None = None, merge_share: float | None = None,
                 restore: bool = True) -> ChatSession:
        """The chat's session under `kv_policy`, restored (unless `restore` is off: a send restores it after
        committing its message); call with model_lock held."""
        with self._state_lock:
            opened = self._open.get(sid)
            if opened is not None and opened.kv_policy == kv_policy:
                self._open.move_to_end(sid)
        if opened is not None and opened.kv_policy == kv_policy:
            if kv_policy.removesuffix(HOST_RESIDENT) in BUDGET_POLICIES:  # a new budget needs no reopening
                opened.session.use_message_policy(self.policy(opened.session.engine, kv_policy, calibrating))
            if restore and opened.session.restored is None:  # opened by a send that did not get to restore it
                opened.stats = opened.session.restore(progress=progress, cancel=cancel)
            return opened.session
        if opened is not None:  # restored under another policy: its rounds reach the disk, then it is reopened
            self.forget(sid)
            opened.session.close()
        info = self.store.session(sid)
        if not Path(info["model_path"]).exists():
            raise KvchatError(f"the chat's model {info['model_path']} is missing; its text is safe")
        session = self.wire(info, self.engine(info["model_path"]), kv_policy=kv_policy, merge_share=merge_share,
                            calibrating=calibrating)
        session.room = OPEN_ROOM
        note = self._memory_notes.get(sid)
        session.restore_notes = [note] if note else []
        stats = session.restore(progress=progress, cancel=cancel) if restore else None
        with self._state_lock:
            self._open[sid] = _OpenChat(session, stats, kv_policy)
            while len(self._open) > CHATS_IN_MEMORY:
                self._open.popitem(last=False)[1].session.stop_reading()  # its cache is freed; its K/V is on disk
        return session

    def wire(self, info: dict, engine: Engine, *, kv_policy: str = "full", merge_share: float | None = None,
             calibrating: Progress | None = None, planned: bool = True, ignore_merges: bool = False) -> ChatSession:
        """The chat `info` (its store row) as a ChatSession on `engine`, not yet restored: the one place a session
        is put together. Its KV policy `kv_policy` (built once per model; the round policy calibrates a model on
        its first use, reported to `calibrating`); with `planned`, this machine's profile of the model (measured on
        its first chat, a few seconds, said through `notice`) plans its restores, which recompute the chat's front
        while they load the rest, and each saved round is compacted for it while `compact_kv` is on; its
        cross-layer merging as its settings say (`merge_share`, given now, is kept there: `kvchat send --merge`,
        `kvchat merge`), unless `ignore_merges` (`kvchat unmerge`); the model's shared K/V writer."""
        policy = self.policy(engine, kv_policy, calibrating)
        planner = profile = None
        if planned:  # a model's first chat here answers at once, on a quick estimate (refined later)
            profile = ensure_profile(engine, info["model_fingerprint"], self.notice, quick=True,
                                     on_progress=self.on_progress)
            planner = profile_planner(profile)

        def compactor(store: Store, chat: str) -> None:
            # Only on a whole measurement: a quick estimate does not decide what K/V is dropped.
            if self.compact_kv and not planner.current().provisional:
                compact_session(store, chat, planner.current())

        merges = None if ignore_merges else chat_merges(self.store, info, engine, merge_share, calibrating)
        return ChatSession(self.store, engine, info["id"], writer=self._writer(engine), policy=policy,
                           planner=planner, compactor=compactor if planned else None, merges=merges,
                           ignore_merges=ignore_merges)

    def send(self, sid: str, text: str, *, max_tokens: int, sampling: SamplingParams,
             on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
             regenerate: bool = False, kv_policy: str = "full", calibrating: Progress | None = None,
             guard: ReplyGuard = ReplyGuard(), merge_share: float | None = None,
             on_wait: Callable[[dict | None], None] | None = None, lock_wait_s: float | None = None,
             edit: EditRequest | None = None) -> Reply:
        """Answer `text` in the chat (restoring it first under `kv_policy` if needed) and save the round. With
        `regenerate`, the last round is removed first and its message (`text` is ignored) is answered again. With
        `edit`, `text` replaces the message of round `edit.round_idx`: that round and those after it are removed
        (kept first as a fork, `edit.fork_sid`, unless `edit.keep_old` is off) and `text` is answered as that round,
        the rounds before keeping their K/V. The chat's own parameters (`set_parameters`) override `sampling`, and
        its reply cap applies unless `guard` has one of its own.
        `merge_share`: the chat's merge setting from now on, when it is opened here (`kvchat send --merge`).
        `on_wait(holder)`: told when another kvchat process is writing to the chat and this send waits for it
        (storage.chat_lock; the wait is bounded, `lock_wait_s` or the session's default: ChatBusyError names the
        holder)."""
        self.store.check_writable("send a message")  # before seconds of loading and restoring for nothing
        with self.model_lock:
            # Within the GPU memory budget, before the message is committed: a chat that cannot fit is refused with
            # nothing written (the message's tokens counted as if it opened the chat, with its template).
            if regenerate or text.strip():
                kv_policy = self._fit(sid, kv_policy, max_tokens + 1, calibrating, "" if regenerate else text)
            session = self._session(sid, kv_policy, calibrating=calibrating, merge_share=merge_share, restore=False)
            if lock_wait_s is not None:
                session.lock_wait_s = lock_wait_s
            if not regenerate and not text.strip():
                raise KvchatError("the message is empty")
            with session.writing(on_wait, cancel):
                if regenerate:
                    row = session.retract_last_round()
                    if row is None:
                        raise KvchatError("the chat has no reply to regenerate")
                    text = row.user_text
                replaced = self._cut_for_edit(session, edit) if edit is not None else []
                sampling, guard = with_chat_parameters(self.store.session(sid), sampling, guard)
                try:
                    result = session.send(text, max_tokens=max_tokens, sampling=sampling, on_token=on_token,
                                          cancel=cancel, guard=guard)
                except BaseException:
                    # No new round (refused, or failed before its message was committed): the old one comes back
                    # (its K/V is recomputed on the next open).
                    if regenerate and len(self.store.rounds(sid)) == row.idx:
                        self.store.add_round(sid, row)
                        self.forget(sid)
                    if replaced and len(self.store.rounds(sid)) == edit.round_idx:
                        self._uncut(sid, edit, replaced)
                    raise
            with self._state_lock:
                opened = self._open.get(sid)
                if opened is not None and session.sent_restore is not None:
                    opened.stats = session.sent_restore
            title = session.info["title"]
            if not title:  # as `kvchat send`: an untitled chat takes its first message as title
                title = auto_title(text)
                with contextlib.suppress(StoreError):  # the round is saved; a title can wait for the next send
                    self.store.rename_session(sid, title)
                    session.info["title"] = title
            return Reply(session.rounds[-1], result, title, session.sent_restore, kv_policy)

    def _cut_for_edit(self, session: ChatSession, edit: EditRequest) -> list[RoundRow]:
        """Before an edited message is answered (under the chat's writer lock): the chat as it is kept as a fork
        (unless `edit.keep_old` is off), then the edited round and those after it removed; returns them."""
        n = len(session.rounds)
        if not 0 <= edit.round_idx < n:
            raise KvchatError(missing_round_words(edit.round_idx, n))
        session.writer.drain()  # the rounds just answered are forked with their K/V
        if edit.keep_old:
            edit.fork_sid = self.store.fork_session(session.sid, n, edit.fork_title
                                                    or fork_title(session.info["title"], edit.round_idx))
        try:
            replaced = session.retract_rounds_from(edit.round_idx)
        except BaseException:
            if edit.fork_sid is not None:
                self.store.delete_session(edit.fork_sid)  # its files are the chat's too: nothing to unlink
                edit.fork_sid = None
            raise
        edit.replaced = len(replaced)
        # Restored before (the app's open chat): the send answers from the cache as it is, and any restore figures it
        # reports are that earlier open's.
        edit.in_memory = session.restored is not None
        return replaced

    def _uncut(self, sid: str, edit: EditRequest, replaced: list[RoundRow]) -> None:
        """An edit whose message was never committed: the replaced rounds come back (their K/V is recomputed on
        the next open) and the fork made of them goes."""
        for row in replaced:
            self.store.add_round(sid, row)
        if edit.fork_sid is not None:
            self.store.unlink_files(self.store.delete_session(edit.fork_sid))
            edit.fork_sid = None
        self.forget(sid)

    def parameters(self, sid: str) -> dict:
        """The chat's own generation parameters (storage.db.CHAT_PARAMETERS; None: the global default)."""
        return chat_parameters(self.store.session(sid))

    def set_parameters(self, sid: str, parameters: dict) -> dict:
        """Set the chat's parameters named in `parameters` (None: back to the default), checked first; returns them
        all."""
        merged = {**self.parameters(sid), **parameters}
        check_parameters(merged)
        self.store.set_chat_parameters(sid, parameters)
        return self.parameters(sid)

    def chat_stats(self, sid: str) -> ChatStats:
        info = self.store.session(sid)
        stats = ChatStats(info["model_path"])
        rounds = self.store.rounds(sid)
        stats.context_used = rounds[-1].token_end if rounds else 0
        engine = self.loaded_engine(info["model_path"])
        if engine is not None:
            stats.device = f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}"
            stats.context_length = engine.config.context_length
            stats.base_model = engine.chat.transcript
        with self._state_lock:
            opened = self._open.get(sid)
        if opened is not None and opened.stats is not None:
            stats.restore, stats.restore_source = opened.stats, "this run"
        if opened is not None:
            stats.memory = self._memory_notes.get(sid, "")
        if opened is not None and opened.session.restored is not None:
            stats.context_used = opened.session.cache.length
        if stats.restore is None:
            last = self.store.last_restore(sid)
            if last:
                stats.restore = RestoreStats(last["tokens_loaded"], last["tokens_recomputed"], last["restore_ms"],
                                             notes=last["notes"], tokens_planned=last["tokens_planned"],
                                             compute_ms=last["compute_ms"], load_ms=last["load_ms"],
                                             gap_ms=last["gap_ms"], plan=last["plan"])
                stats.restore_source = "earlier"
        for seg in self.store.segments(sid):
            stats.kv_bytes += seg["byte_size"]
            stats.kv_raw_bytes += seg["raw_size"]
        return stats

    def is_in_memory(self, sid: str) -> bool:
        with self._state_lock:
            return sid in self._open

    def forget(self, sid: str) -> None:
        """Drop the chat's in-memory cache (it will be restored from the store next time)."""
        with self._state_lock:
            opened = self._open.pop(sid, None)
        if opened is not None:
            opened.session.stop_reading()

    # ---- chat management ----

    def rename(self, sid: str, title: str) -> None:
        self.store.rename_session(sid, title)
        with self._state_lock:
            if sid in self._open:
                self._open[sid].session.info["title"] = title

    @contextlib.contextmanager
    def _writing(self, sid: str, doing: str):
        """The chat's writer lock across processes (storage.chat_lock) for a change that is not a send: waited for
        briefly, then refused in one line naming the process writing to the chat."""
        try:
            lock = ChatLock.acquire(self.store.home, sid, wait_s=CHANGE_WAIT_S)
        except OSError as exc:
            raise self.store.place_error(exc, doing) from None
        try:
            yield
        finally:
            lock.release()

    def delete(self, sid: str) -> None:
        """As `kvchat rm`: the deletion is committed first, the files no other chat uses are unlinked after."""
        with self.model_lock:  # never while a round of this chat is being answered or saved
            self.drain()
            with self._writing(sid, "delete the chat"):
                self.forget(sid)
                self.store.unlink_files(self.store.delete_session(sid))

    def fork(self, sid: str, rounds: int, title: str) -> str:
        """A new chat holding the first `rounds` rounds (and their stored K/V, shared by file)."""
        with self.model_lock:
            self.drain()  # so the rounds just answered are forked with their K/V
            return self.store.fork_session(sid, rounds, title)

    def export(self, sid: str, path: Path, text_only: bool = False, fmt: str = "state") -> Path:
        """The chat as a state file (`fmt` "state": the chat whole, its K/V unless `text_only`), or as a transcript
        other tools read (app.session.transcripts: "md", "txt", "json"); written atomically either way."""
        path = Path(path).expanduser()
        if fmt != "state":
            transcript = self.transcript(sid)
            return write_transcript(path, render_transcript(transcript.info, transcript.rounds, fmt))
        with self.model_lock:
            self.drain()
            return export_session(self.store, sid, path, text_only=text_only)

    def import_file(self, path: Path, model_path: str | Path) -> ImportResult:
        """As `kvchat import`: the state file becomes a new chat on `model_path`, or nothing changes."""
        path, model = Path(path).expanduser(), Path(model_path).resolve()
        if not path.is_file():
            raise KvchatError(f"{path} is not a file")
        fp = model_fingerprint(model, self.store)
        result = import_state(self.store, path, current_fingerprint=fp, model_path=str(model))
        title = self.store.session(result.session_id)["title"]
        taken = {r["title"] for r in self.store.sessions() if r["id"] != result.session_id}
        if title and title in taken:  # importing a file twice: two chats of one title could not be told apart
            distinct = distinct_title(title, taken)
            with contextlib.suppress(StoreError):  # the chat is imported; its title is only a name
                self.store.rename_session(result.session_id, distinct)
                # Said on a terminal: a title is stored text, its control characters escaped
                result.notices.append(f"a chat titled “{terminal_line(title)}” exists already: imported as "
                                      f"“{terminal_line(distinct)}”")
        return result

    def set_system_prompt(self, sid: str, system_prompt: str) -> None:
        """A new system prompt changes every round's tokens: the stored K/V is dropped and recomputed on open."""
        with self.model_lock:
            self.drain()
            with self._writing(sid, "change the chat's system prompt"):
                self.forget(sid)
                self.store.unlink_files(self.store.update_session(sid, system_prompt=system_prompt))

    def close(self) -> list[str]:
        """Before the app exits: the reply being generated (already told to stop) is saved, then every finished
        round's K/V reaches the disk."""
        with self.model_lock:
            return self.drain()


def missing_round_words(round_idx: int, n_rounds: int) -> str:
    if n_rounds == 0:
        return f"the chat has no round {round_idx}: it has no rounds yet"
    rounds = "its only round is 0" if n_rounds == 1 else f"its rounds are 0–{n_rounds - 1}"
    return f"the chat has no round {round_idx} ({rounds}, as `kvchat show` numbers them)"


def check_parameters(parameters: dict) -> None:
    """A chat's parameters as a user may set them: KvchatError in one line naming the bad one."""
    p = {k: v for k, v in parameters.items() if v is not None}
    SamplingParams(p.get("temperature", 0.0), p.get("top_k", 0), p.get("top_p", 1.0), p.get("seed")).validate()
    if p.get("reply_cap") is not None and p["reply_cap"] < 1:
        raise KvchatError(f"the reply cap must be at least 1 token, not {p['reply_cap']}")


def with_chat_parameters(info: dict, sampling: SamplingParams, guard: ReplyGuard
                         ) -> tuple[SamplingParams, ReplyGuard]:
    """`sampling` and `guard` with the chat's own parameters over them (those it has: NULL is the default). A reply
    cap given with the guard (`--reply-cap`) wins over the chat's; a guard turned off stays off."""
    params = chat_parameters(info)
    chosen = {k: params[k] for k in ("temperature", "top_k", "top_p", "seed") if params[k] is not None}
    if chosen:
        sampling = dataclasses.replace(sampling, **chosen)
    if params["reply_cap"] is not None and guard.enabled and guard.reply_cap is None:
        guard = dataclasses.replace(guard, reply_cap=params["reply_cap"])
    return sampling, guard


def auto_title(message: str, limit: int = 48) -> str:
    """An untitled chat's title from its first message: the message on one line, cut at the last word boundary
    within `limit` characters with an ellipsis ("… she is four years…", never "… four years o")."""
    text = " ".join(message.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    if text[limit - 1] != " " and " " in cut:  # the cut falls inside a word: drop that word's start
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,;:.-") + "…"


def distinct_title(title: str, taken: set[str]) -> str:
    """`title` with the first free number after it: "Trip (2)", "Trip (3)"…"""
    n = 2
    while f"{title} ({n})" in taken:
        n += 1
    return f"{title} ({n})"


def default_model() -> Path:
    if not DEFAULT_MODEL.exists():
        raise KvchatError(f"the embedded model is missing from this install ({DEFAULT_MODEL}); choose a model file "
                          f"in the settings")
    return DEFAULT_MODEL


def is_demo_model(path: str | Path) -> bool:
    """Whether `path` is the embedded demo model (which the app's empty screens describe)."""
    try:
        return Path(path).resolve() == DEFAULT_MODEL.resolve()
    except OSError:
        return False
