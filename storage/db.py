"""The chat store: one SQLite database (WAL) in the data folder, with named migrations each applied in one
transaction, through sqlite-utils.

Tables: models (fingerprints), sessions, rounds (the text, committed as soon as a reply ends), kv_segments (one row
per stored piece of a round, of a kind: its K/V or its key bounds; committed only once its file is durable) and
restores (what the last restores cost).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from sqlite_utils import Database

from kvchat.errors import KvchatError
from kvchat.paths import can_read, can_write, data_dir, place_problem, place_words, prepare_home

log = logging.getLogger("kvchat.store")


class StoreError(KvchatError):
    pass


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# What a kv_segments row holds: a round's K/V ([layers, 2, Hkv, tokens, D]) or its key bounds (per block of tokens,
# the per-dimension min and max of the keys: [layers, 2, Hkv, blocks, D]).
SEGMENT_KV = "kv"
SEGMENT_KEY_BOUNDS = "key-bounds"
# Two layers' K/V of a round merged into one (engine.kv.cross_layer; [2, 2, Hkv, tokens + retained, D]): the row's
# layer range runs from the lower layer to the higher one, and only those two are in it. The round's K/V segment
# holds those layers as zeros and names the pair in its `merged` column.
SEGMENT_MERGED = "merged"
# A round's retrieval units (LouisKV, app/session/units.py): per global layer and KV head, the centroid of each unit
# of the round's keys and each token's unit, packed in one float32 tensor [G, 2, Hkv, rows, D] (rows <= tokens); the
# row's layer range is the model's every layer, the G global ones inside it. An index, not K/V: a restore never
# reads it as K/V, and a round without one gets it rebuilt from its K/V.
SEGMENT_UNITS = "units"
# A round's K/V a second time, in its units' order, each unit's rows a frame readable alone (storage.unit_frames):
# what a lazily resumed chat reads before its first token (app/session/lazy.py). A copy, not the chat's K/V: a restore
# never reads it, a state file does not carry it, and a round without one is read whole.
SEGMENT_UNIT_ROWS = "unit-rows"
SEGMENT_KINDS = (SEGMENT_KV, SEGMENT_KEY_BOUNDS, SEGMENT_MERGED, SEGMENT_UNITS, SEGMENT_UNIT_ROWS)
CACHE_KINDS = (SEGMENT_KV, SEGMENT_KEY_BOUNDS, SEGMENT_MERGED)  # the kinds a restore places in the cache
_SEGMENT_PK = ("session_id", "round_idx", "layer_start", "kind")


# A round's reply: whole ("done"); stopped early by the user (Esc, Ctrl-C, SIGTERM: what had streamed is kept);
# or not saved ("pending": being answered now by the process holding the chat's lock, or that process stopped first).
REPLY_DONE, REPLY_PARTIAL, REPLY_PENDING = "done", "partial", "pending"
REPLY_STATES = (REPLY_DONE, REPLY_PARTIAL, REPLY_PENDING)


def check_segment_kind(kind: str) -> None:
    if kind not in SEGMENT_KINDS:
        raise ValueError(f"unknown KV segment kind {kind!r}; known kinds are {', '.join(SEGMENT_KINDS)}")


# ---- migrations: append only; a name is never reused or edited once released ----

def _m001_initial(db: Database) -> None:
    db["models"].create({"fingerprint": str, "path": str, "name": str, "arch": str, "n_layers": int,
                         "kv_bytes_per_token": int, "created": str}, pk="fingerprint")
    db["model_files"].create({"path": str, "size": int, "mtime_ns": int, "sha256": str}, pk="path")
    db["sessions"].create({"id": str, "title": str, "created": str, "updated": str, "model_fingerprint": str,
                           "model_path": str, "system_prompt": str, "settings": str}, pk="id",
                          not_null={"title", "created", "updated", "model_fingerprint", "settings"})
    db["rounds"].create({"session_id": str, "idx": int, "user_text": str, "assistant_text": str,
                         "token_start": int, "token_end": int, "created": str}, pk=("session_id", "idx"),
                        not_null={"user_text", "assistant_text", "token_start", "token_end"},
                        foreign_keys=[("session_id", "sessions", "id")])
    db["kv_segments"].create({"session_id": str, "round_idx": int, "layer_start": int, "layer_end": int,
                              "token_start": int, "token_end": int, "codec": str, "dtype": str, "byte_size": int,
                              "raw_size": int, "checksum": str, "file": str, "model_fingerprint": str,
                              "created": str}, pk=("session_id", "round_idx", "layer_start"),
                             foreign_keys=[("session_id", "sessions", "id")])
    db["kv_segments"].create_index(["file"])
    db["restores"].create({"id": int, "session_id": str, "at": str, "tokens_loaded": int, "tokens_recomputed": int,
                           "restore_ms": float, "ttft_ms": float, "notes": str}, pk="id",
                          foreign_keys=[("session_id", "sessions", "id")])
    db["restores"].create_index(["session_id", "at"])


def _m002_segment_kind(db: Database) -> None:
    # A round may store, beside its K/V, other per-round pieces (key bounds); the kind joins the primary key so one
    # round and layer group can hold one piece of each kind. Rows written before are all K/V.
    segments = db["kv_segments"]
    segments.add_column("kind", str, not_null_default=SEGMENT_KV)
    segments.transform(pk=_SEGMENT_PK)
    segments.create_index(["file"], if_not_exists=True)  # transform recreates it; make sure across versions


def _m003_restore_streams(db: Database) -> None:
    # A restore recomputes the chat's first tokens by plan while it loads the rest: what each stream did.
    restores = db["restores"]
    for column, kind in (("tokens_planned", int), ("compute_ms", float), ("load_ms", float), ("gap_ms", float)):
        restores.add_column(column, kind, not_null_default=0)
    restores.add_column("plan", str, not_null_default="")


def _m004_window_live_from(db: Database) -> None:
    # Sliding-window layers (Gemma 3) never read a token again once the chat has moved a window past it: a segment
    # stores those layers' K/V as zeros before `live_from` (a token position). Rows written before hold them all.
    db["kv_segments"].add_column("live_from", int, not_null_default=0)


def _m005_merged_layers(db: Database) -> None:
    # Cross-layer merging (Krul): a K/V segment may hold some layer pairs as zeros, their K/V being in a segment of
    # kind "merged"; `merged` names those pairs ("4+5,6+7"), so a restore never takes the zeros for K/V. Each chat
    # keeps the attention statistics that choose its pairs.
    db["kv_segments"].add_column("merged", str, not_null_default="")
    db["layer_stats"].create({"session_id": str, "stats": str, "updated": str}, pk="session_id",
                             not_null={"stats", "updated"}, foreign_keys=[("session_id", "sessions", "id")])


def _m006_round_reply_state(db: Database) -> None:
    # A round's message is committed before its reply is generated (a crash then keeps the message): `reply_state`
    # says whether the reply is whole, stopped early by the user, or not saved at all. Rows written before are whole.
    db["rounds"].add_column("reply_state", str, not_null_default=REPLY_DONE)


def _m007_message_search(db: Database) -> None:
    # Full-text search over every message and reply (`kvchat search`, the app's search): an FTS5 index of the
    # rounds, kept current by triggers, filled here with the rounds already stored (storage/search.py).
    from kvchat.storage.search import create_index

    create_index(db.conn)


# A chat's own generation parameters (`kvchat params`, the app's chat parameters dialog): NULL is the global default
# (the app's settings, `kvchat send`'s own). The system prompt has its own column since 001.
CHAT_PARAMETERS = {"temperature": float, "top_p": float, "top_k": int, "seed": int, "reply_cap": int}


def _m008_chat_parameters(db: Database) -> None:
    have = db["sessions"].columns_dict
    for column, kind in CHAT_PARAMETERS.items():
        if column not in have:  # a store whose record of this migration was lost keeps its columns
            db["sessions"].add_column(column, kind)


def _m009_kv_budgets(db: Database) -> None:
    # Per-layer KV budgets (XKV and its baselines) are chosen again for each reply: each chat keeps its latest choice
    # (the policy and its share, the input slots each layer kept, the attention share each global layer kept),
    # shown by `kvchat show`.
    db["kv_budgets"].create({"session_id": str, "policy": str, "budget": float, "input_slots": int, "kept": str,
                             "retention": str, "round_idx": int, "updated": str}, pk="session_id",
                            not_null={"policy", "kept", "retention", "updated"},
                            foreign_keys=[("session_id", "sessions", "id")], if_not_exists=True)


def _m010_model_kv_budgets(db: Database) -> None:
    # The model's average per-layer budgets (XKV's "sampling mode": what a layer keeps of a chat on this model, over
    # every reply chosen so far), per model fingerprint and policy: sums and a count, so each reply adds to them.
    db["model_kv_budgets"].create({"fingerprint": str, "policy": str, "replies": int, "kept_share_sums": str,
                                   "retention_sums": str, "updated": str}, pk=("fingerprint", "policy"),
                                  not_null={"replies", "kept_share_sums", "retention_sums", "updated"},
                                  if_not_exists=True)


MIGRATIONS: list[tuple[str, Callable[[Database], None]]] = [("001_initial", _m001_initial),
                                                            ("002_segment_kind", _m002_segment_kind),
                                                            ("003_restore_streams", _m003_restore_streams),
                                                            ("004_window_live_from", _m004_window_live_from),
                                                            ("005_merged_layers", _m005_merged_layers),
                                                            ("006_round_reply_state", _m006_round_reply_state),
                                                            ("007_message_search", _m007_message_search),
                                                            ("008_chat_parameters", _m008_chat_parameters),
                                                            ("009_kv_budgets", _m009_kv_budgets),
                                                            ("010_model_kv_budgets", _m010_model_kv_budgets)]


# Migrations a store may lack and still be read by this kvchat (on a read-only home, where none can run): readers
# take a missing rounds.reply_state as "done", missing chat parameters as the defaults; a search without the
# message index builds one in memory; a chat or model without stored KV budgets has none to show.
READABLE_WITHOUT = {"006_round_reply_state", "007_message_search", "008_chat_parameters", "009_kv_budgets",
                    "010_model_kv_budgets"}
SAVING = "save to the chat store"  # what a write was doing, when its caller does not say


def _about_the_place(exc: BaseException) -> bool:
    """Whether a SQLite error is about where the database lives (full, read-only, I/O, locked, unreadable) rather
    than a bug in what was asked (a constraint, bad SQL: those propagate as they are)."""
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, (
            sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.DataError, sqlite3.InternalError,
            sqlite3.NotSupportedError)):
        return False
    if place_problem(exc) is not None:
        return True
    name = getattr(exc, "sqlite_errorname", None) or ""
    text = str(exc).lower()
    return (name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_CORRUPT", "SQLITE_NOTADB"))
            or any(w in text for w in ("database is locked", "unable to open database", "malformed", "not a database")))


def _can_write(home: Path, db_path: Path) -> bool:
    return can_write(home) and (not db_path.exists() or can_write(db_path))


def chat_parameters(info: dict) -> dict:
    """A chat's generation parameters from its row (`Store.session`), None where it takes the global default (and
    where a store read as it is predates them)."""
    return {name: info.get(name) for name in CHAT_PARAMETERS}


@dataclass
class RoundRow:
    idx: int
    user_text: str
    assistant_text: str
    token_start: int
    token_end: int
    created: str
    reply_state: str = REPLY_DONE


class Store:
    """The database and the folder of KV segment files beside it (`kv/`)."""

    def __init__(self, home: Path | None = None):
        """The store in `home` (default: $KVCHAT_HOME or the platform's data folder). A home this user cannot write
        (a read-only mount, a folder or database of someone else's) is opened read-only (`read_only`): everything
        can be read, and every write raises StoreError saying the home is read-only."""
        self.home = Path(home) if home is not None else data_dir()
        try:
            prepare_home(self.home, from_env=home is None and bool(os.environ.get("KVCHAT_HOME")))
        except KvchatError as exc:
            raise StoreError(str(exc)) from None
        path = self.home / "kvchat.db"
        unreadable = next((p for p in (self.home, path) if p.exists() and not can_read(p)), None)
        if unreadable is not None:  # not "read-only" nor "not a database": the permission is what is wrong
            raise StoreError(f"no permission to read {unreadable}")
        self.read_only = not _can_write(self.home, path)
        self._lock = threading.RLock()  # one writer at a time from this process's threads
        try:
            if self.read_only:
                conn = self._connect_read_only(path)
            else:
                try:
                    self.kv_dir.mkdir(exist_ok=True)
                except OSError as exc:
                    raise self.place_error(exc, "create its kv folder") from None
                conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self.db = Database(conn)
            if not self.read_only:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            if not self.read_only:
                self.sweep()
        except sqlite3.DatabaseError as exc:
            # A full or read-only disk, an I/O error or another process's lock is about the place, not the file: a
            # user told the file is unusable might delete a healthy database.
            if place_problem(exc) is not None or "database is locked" in str(exc):
                raise self.place_error(exc, "open the chat store") from None
            raise StoreError(f"{path} is not a usable kvchat database ({exc})") from None

    def _connect_read_only(self, path: Path) -> sqlite3.Connection:
        """`mode=ro`, which reads the WAL's latest commits through its -shm file; where that file is missing and
        cannot be created (the folder is read-only), `immutable=1`, which reads the database file alone: exact when
        the WAL holds nothing (a store closed cleanly leaves none)."""
        if not path.exists():
            raise StoreError(f"{self.home} is read-only: cannot create the chat store there")
        uri = path.resolve().as_uri()

        def connect(query: str) -> sqlite3.Connection:
            conn = sqlite3.connect(f"{uri}?{query}", uri=True, isolation_level=None, check_same_thread=False,
                                   timeout=30)
            try:
                conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            except BaseException:
                conn.close()
                raise
            return conn

        try:
            return connect("mode=ro")
        except sqlite3.OperationalError:
            wal = path.with_name(path.name + "-wal")
            if path.is_file() and wal.exists() and wal.stat().st_size > 32:  # 32: a WAL header without frames
                raise StoreError(f"{self.home} is read-only and its store was not closed cleanly (its latest "
                                 f"changes are in {wal.name}): open it once where it is writable") from None
            return connect("mode=ro&immutable=1")

    def place_error(self, exc: BaseException, doing: str) -> StoreError:
        """An OSError or SQLite error met while trying to `doing`, as one line about the place (the data folder or
        its disk), not the file that happened to fail first. In a read-only store, a refused write says read-only
        whatever the refusal was (EROFS, EACCES, SQLITE_READONLY)."""
        if self.read_only and place_problem(exc) in ("read-only", "permission"):
            return StoreError(f"{self.home} is read-only: cannot {doing}")
        return StoreError(place_words(self.home, exc, doing))

    def sweep(self, orphan_age_s: float = 300.0) -> list[str]:
        """Remove what interrupted saves left in kv/ (at start-up; safe beside other running kvchat processes)."""
        from kvchat.storage.segments import sweep

        return sweep(self.kv_dir, self.referenced_files(), orphan_age_s)

    @property
    def kv_dir(self) -> Path:
        return self.home / "kv"

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def transaction(self, doing: str | None = None) -> Iterator[Database]:
        """One write transaction. A read-only store, and SQLite errors about the place (a full disk, a read-only
        one, an I/O error, another process's lock), raise StoreError saying so and what was being done (`doing`,
        default "save to the chat store"); nothing of the transaction is kept. Other errors propagate unchanged."""
        doing = doing or SAVING
        with self._lock:
            self.check_writable(doing)
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.DatabaseError as exc:
                if _about_the_place(exc):
                    raise self.place_error(exc, doing) from exc
                raise
            try:
                yield self.db
                self.db.execute("COMMIT")
            except BaseException as exc:
                self._roll_back()
                if _about_the_place(exc):
                    raise self.place_error(exc, doing) from exc
                raise

    def check_writable(self, doing: str = SAVING) -> None:
        """StoreError when the store is read-only (for callers that write files before their rows)."""
        if self.read_only:
            raise StoreError(f"{self.home} is read-only: cannot {doing}")

    def _roll_back(self) -> None:
        # SQLite may have ended the transaction itself (a full disk or an I/O error can); and a ROLLBACK that fails
        # must not replace the error that brought us here, which is the one to report.
        if not self.db.conn.in_transaction:
            return
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.warning("ROLLBACK failed in %s: %s", self.home, exc)

    # Every thread shares the one connection: reads take the writers' lock too and fetch their rows at once, so a
    # read never runs inside another thread's transaction nor interleaves with sqlite-utils' savepoints (seen as
    # "no such savepoint: sqlite_utils_query" when a chat's K/V writer committed during a sidebar refresh).
    def _query(self, sql: str, params=()) -> list[dict]:
        with self._lock, self._reading():
            return list(self.db.query(sql, params))

    def _fetch(self, sql: str, params=()) -> list[tuple]:
        with self._lock, self._reading():
            return self.db.execute(sql, params).fetchall()

    @contextmanager
    def _reading(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if _about_the_place(exc):
                raise self.place_error(exc, "read the chat store") from exc
            raise

    def _migrate(self) -> None:
        known = [name for name, _ in MIGRATIONS]
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise StoreError(f"{self.home / 'kvchat.db'} was written by a newer kvchat (schema {version}; this "
                             f"program knows {len(MIGRATIONS)}); upgrade kvchat to open it")
        tracked = "_migrations" in self.db.table_names()
        if not tracked and not self.read_only:
            self.db["_migrations"].create({"name": str, "applied": str}, pk="name")
        applied = {r["name"] for r in self.db["_migrations"].rows} if tracked or not self.read_only else set()
        unknown = applied - set(known)
        if unknown:
            raise StoreError(f"{self.home / 'kvchat.db'} has migrations this kvchat does not know "
                             f"({', '.join(sorted(unknown))}); upgrade kvchat to open it")
        if self.read_only:  # nothing can be migrated: read as it is where this kvchat can
            if set(known) - applied - READABLE_WITHOUT:
                raise StoreError(f"{self.home} is read-only and its store needs an upgrade by this kvchat; open it "
                                 f"once where it is writable")
            return
        for i, (name, apply) in enumerate(MIGRATIONS):
            if name in applied:
                continue
            with self.transaction("upgrade the chat store") as db:
                apply(db)
                db["_migrations"].insert({"name": name, "applied": now()})
                db.execute(f"PRAGMA user_version = {i + 1}")

    # ---- models ----

    def cached_file_hash(self, path: Path, size: int, mtime_ns: int) -> str | None:
        rows = self._fetch("SELECT sha256 FROM model_files WHERE path = ? AND size = ? AND mtime_ns = ?",
                           [str(path), size, mtime_ns])
        return rows[0][0] if rows else None

    def remember_file_hash(self, path: Path, size: int, mtime_ns: int, sha256: str) -> None:
        if self.read_only:  # a cache: a read-only store hashes the file again next time
            return
        with self.transaction() as db:
            db["model_files"].upsert({"path": str(path), "size": size, "mtime_ns": mtime_ns, "sha256": sha256},
                                     pk="path")

    def upsert_model(self, fingerprint: str, **info) -> None:
        with self.transaction("create a chat") as db:
            db["models"].upsert({"fingerprint": fingerprint, "created": now(), **info}, pk="fingerprint")

    # ---- sessions ----

    def create_session(self, *, title: str, model_fingerprint: str, model_path: str, system_prompt: str | None,
                       settings: dict | None = None) -> str:
        sid = uuid.uuid4().hex[:12]
        stamp = now()
        with self.transaction("create a chat") as db:
            db["sessions"].insert({"id": sid, "title": title, "created": stamp, "updated": stamp,
                                   "model_fingerprint": model_fingerprint, "model_path": model_path,
                                   "system_prompt": system_prompt, "settings": json.dumps(settings or {})})
        return sid

    def insert_session(self, *, title: str, model_fingerprint: str, model_path: str, system_prompt: str | None,
                       settings: dict, rounds: list[RoundRow], segments: list[dict],
                       parameters: dict | None = None) -> str:
        """A whole chat in one transaction (imports): it is there completely or not at all."""
        sid, stamp = uuid.uuid4().hex[:12], now()
        for seg in segments:
            check_segment_kind(seg.get("kind", SEGMENT_KV))
        with self.transaction("import a chat") as db:
            db["sessions"].insert({"id": sid, "title": title, "created": stamp, "updated": stamp,
                                   "model_fingerprint": model_fingerprint, "model_path": model_path,
                                   "system_prompt": system_prompt, "settings": json.dumps(settings),
                                   **{k: v for k, v in (parameters or {}).items() if v is not None}})
            db["rounds"].insert_all({"session_id": sid, "idx": r.idx, "user_text": r.user_text,
                                     "assistant_text": r.assistant_text, "token_start": r.token_start,
                                     "token_end": r.token_end, "created": r.created,
                                     "reply_state": r.reply_state} for r in rounds)
            # Every row names its kind: insert_all fills a key missing from some rows with NULL, not the default.
            db["kv_segments"].insert_all({"session_id": sid, "created": stamp, "kind": SEGMENT_KV, **seg}
                                         for seg in segments)
        return sid

    def sessions(self) -> list[dict]:
        return self._query(
            "SELECT s.*, (SELECT COUNT(*) FROM rounds r WHERE r.session_id = s.id) AS n_rounds, "
            "(SELECT COALESCE(SUM(byte_size), 0) FROM kv_segments k WHERE k.session_id = s.id) AS kv_bytes "
            "FROM sessions s ORDER BY updated DESC")

    def session(self, ref: str) -> dict:
        """A session by id or unique id prefix."""
        rows = self._query("SELECT * FROM sessions WHERE id LIKE ? || '%'", [ref]) if ref else []
        if not rows:
            raise StoreError(f"no session {ref!r} (see `kvchat sessions`)")
        if len(rows) > 1:
            raise StoreError(f"session prefix {ref!r} is ambiguous ({', '.join(r['id'] for r in rows[:5])})")
        row = rows[0]
        row["settings"] = json.loads(row["settings"] or "{}")
        return row

    def rename_session(self, sid: str, title: str) -> None:
        with self.transaction("rename the chat") as db:
            db["sessions"].update(sid, {"title": title, "updated": now()})

    def fork_session(self, sid: str, rounds: int, title: str) -> str:
        """A new session holding the first `rounds` rounds of `sid` and their K/V (the segment files are shared:
        they are named by content, so forking copies rows, not bytes)."""
        src = self.session(sid)
        stamp = now()
        new_sid = uuid.uuid4().hex[:12]
        with self.transaction() as db:
            db["sessions"].insert({"id": new_sid, "title": title, "created": stamp, "updated": stamp,
                                   "model_fingerprint": src["model_fingerprint"], "model_path": src["model_path"],
                                   "system_prompt": src["system_prompt"], "settings": json.dumps(src["settings"]),
                                   **chat_parameters(src)})
            db.execute("INSERT INTO rounds (session_id, idx, user_text, assistant_text, token_start, token_end, "
                       "created, reply_state) SELECT ?, idx, user_text, assistant_text, token_start, token_end, "
                       "created, reply_state FROM rounds WHERE session_id = ? AND idx < ?", [new_sid, sid, rounds])
            columns = [c for c in db["kv_segments"].columns_dict if c not in ("session_id", "created")]
            listed = ", ".join(columns)
            db.execute(f"INSERT INTO kv_segments (session_id, created, {listed}) SELECT ?, ?, {listed} "
                       f"FROM kv_segments WHERE session_id = ? AND round_idx < ?", [new_sid, stamp, sid, rounds])
        return new_sid

    def update_session(self, sid: str, *, system_prompt: str | None = None,
                       settings: dict | None = None) -> list[str]:
        """Change a chat's system prompt or settings. A new system prompt changes every round's tokens, so the
        stored K/V no longer applies: it is dropped in the same transaction (the files are returned for unlinking)."""
        changes: dict = {"updated": now()}
        if settings is not None:
            changes["settings"] = json.dumps(settings)
        dropped: list[str] = []
        with self.transaction() as db:
            if system_prompt is not None:
                changes["system_prompt"] = system_prompt or None
                dropped = [r[0] for r in db.execute("SELECT DISTINCT file FROM kv_segments WHERE session_id = ?",
                                                    [sid])]
                db.execute("DELETE FROM kv_segments WHERE session_id = ?", [sid])
            db["sessions"].update(sid, changes)
        return self.unreferenced(dropped)

    def set_chat_parameters(self, sid: str, parameters: dict) -> None:
        """Set the chat's generation parameters named in `parameters` (None: back to the global default)."""
        unknown = set(parameters) - set(CHAT_PARAMETERS)
        if unknown:
            raise ValueError(f"unknown chat parameters {', '.join(sorted(unknown))}")
        with self.transaction("change the chat's parameters") as db:
            db["sessions"].update(sid, {**parameters, "updated": now()})

    def delete_rounds_from(self, sid: str, first: int) -> tuple[list[RoundRow], list[str]]:
        """Remove rounds `first`, `first` + 1, … of a chat and their K/V rows in one transaction (a message edited:
        the chat goes on from before it); returns the rounds and the segment files no session references any more
        (to unlink after the commit)."""
        with self.transaction("edit the chat") as db:
            rows = db.execute("SELECT idx, user_text, assistant_text, token_start, token_end, created, reply_state "
                              "FROM rounds WHERE session_id = ? AND idx >= ? ORDER BY idx", [sid, first]).fetchall()
            files = [r[0] for r in db.execute("SELECT DISTINCT file FROM kv_segments WHERE session_id = ? AND "
                                              "round_idx >= ?", [sid, first])]
            db.execute("DELETE FROM kv_segments WHERE session_id = ? AND round_idx >= ?", [sid, first])
            db.execute("DELETE FROM rounds WHERE session_id = ? AND idx >= ?", [sid, first])
            db["sessions"].update(sid, {"updated": now()})
        return [RoundRow(*r) for r in rows], self.unreferenced(files)

    def delete_last_round(self, sid: str) -> tuple[RoundRow | None, list[str]]:
        """Remove a chat's last round and its K/V rows in one transaction (to regenerate the reply); returns the
        round and the segment files no session references any more (to unlink after the commit)."""
        with self.transaction() as db:
            row = db.execute("SELECT idx, user_text, assistant_text, token_start, token_end, created, reply_state "
                             "FROM rounds "
                             "WHERE session_id = ? ORDER BY idx DESC LIMIT 1", [sid]).fetchone()
            if row is None:
                return None, []
            files = [r[0] for r in db.execute("SELECT DISTINCT file FROM kv_segments WHERE session_id = ? AND "
                                              "round_idx = ?", [sid, row[0]])]
            db.execute("DELETE FROM kv_segments WHERE session_id = ? AND round_idx = ?", [sid, row[0]])
            db.execute("DELETE FROM rounds WHERE session_id = ? AND idx = ?", [sid, row[0]])
            db["sessions"].update(sid, {"updated": now()})
        return RoundRow(*row), self.unreferenced(files)

    def delete_session(self, sid: str) -> list[str]:
        """Commit the deletion first; return the segment files no session references any more (to unlink after)."""
        with self.transaction("delete the chat") as db:
            files = [r[0] for r in db.execute("SELECT DISTINCT file FROM kv_segments WHERE session_id = ?", [sid])]
            for table in ("kv_segments", "restores", "rounds", "layer_stats", "kv_budgets"):
                if table in self._tables(db):
                    db.execute(f"DELETE FROM {table} WHERE session_id = ?", [sid])
            db.execute("DELETE FROM sessions WHERE id = ?", [sid])
        return self.unreferenced(files)

    def unlink_files(self, names: list[str]) -> None:
        """Unlink segment files whose rows are already deleted and committed (a crash before this leaves orphans,
        which the start-up sweep removes; never a row pointing at nothing)."""
        for name in names:
            try:
                (self.kv_dir / name).unlink(missing_ok=True)
            except OSError:
                pass  # the sweep retries

    # ---- rounds ----

    def rounds(self, sid: str) -> list[RoundRow]:
        # A read-only store may predate reply_state (READABLE_WITHOUT): its replies were all whole.
        return [RoundRow(r["idx"], r["user_text"], r["assistant_text"], r["token_start"], r["token_end"], r["created"],
                         r.get("reply_state", REPLY_DONE))
                for r in self._query("SELECT * FROM rounds WHERE session_id = ? ORDER BY idx", [sid])]

    def add_round(self, sid: str, row: RoundRow) -> None:
        """A round as it is (its message and reply in one commit); the next index must be free (the caller holds the
        chat's writer lock: storage.chat_lock)."""
        with self.transaction() as db:
            self._insert_round(db, sid, row)

    def _insert_round(self, db: Database, sid: str, row: RoundRow) -> None:
        taken = db.execute("SELECT COUNT(*) FROM rounds WHERE session_id = ? AND idx = ?", [sid, row.idx]).fetchone()
        if taken[0]:
            raise StoreError(f"round {row.idx} of chat {sid} was written by another kvchat process meanwhile")
        if row.reply_state not in REPLY_STATES:
            raise ValueError(f"unknown reply state {row.reply_state!r}")
        db["rounds"].insert({"session_id": sid, "idx": row.idx, "user_text": row.user_text,
                             "assistant_text": row.assistant_text, "token_start": row.token_start,
                             "token_end": row.token_end, "created": row.created, "reply_state": row.reply_state})
        db["sessions"].update(sid, {"updated": now()})

    def finish_round(self, sid: str, row: RoundRow) -> None:
        """Replace a round's reply, span and state (its pending reply, once generated): one UPDATE, one commit."""
        with self.transaction() as db:
            changed = db.execute("UPDATE rounds SET assistant_text = ?, token_start = ?, token_end = ?, reply_state = ? "
                                 "WHERE session_id = ? AND idx = ? AND created = ?",
                                 [row.assistant_text, row.token_start, row.token_end, row.reply_state, sid, row.idx,
                                  row.created]).rowcount
            if changed != 1:
                raise StoreError(f"round {row.idx} of chat {sid} was removed by another kvchat process meanwhile")
            db["sessions"].update(sid, {"updated": now()})

    def drop_pending_round(self, sid: str, row: RoundRow) -> None:
        """Remove a message committed ahead of its reply that was then refused (the context cannot hold it)."""
        with self.transaction() as db:
            db.execute("DELETE FROM rounds WHERE session_id = ? AND idx = ? AND created = ? AND reply_state = ?",
                       [sid, row.idx, row.created, REPLY_PENDING])

    def data_version(self) -> int:
        """Changes whenever another connection (another kvchat process) commits to the database: the app polls it
        to refresh what it shows."""
        return self._fetch("PRAGMA data_version")[0][0]

    def search(self, query: str, limit: int = 20, snippet_tokens: int = 12) -> list:
        """Every chat's rounds whose message or reply holds each word of `query` (as the beginning of a word, in any
        case, accents folded), best first, as storage.search.SearchHit with a snippet of the match. Nothing in
        `query` is FTS syntax; one with no word of letters or digits raises SearchError (a one-line KvchatError)."""
        from kvchat.storage import search as message_search

        message_search.query_words(query)  # refused before any index is built
        with self._lock, self._reading():
            if not self._fetch("SELECT 1 FROM main.sqlite_master WHERE name = ?", [message_search.FTS_TABLE]):
                # A store read as it is, from before the index (READABLE_WITHOUT): one in memory, built again
                # whenever another process has changed the store.
                version = self.data_version()
                if getattr(self, "_temporary_search_version", None) != version:
                    message_search.temporary_index(self.db.conn)
                    self._temporary_search_version = version
            return message_search.search(self.db.conn, query, limit, snippet_tokens)

    def set_round_spans(self, sid: str, starts: list[int], ends: list[int]) -> list[str]:
        """Give a chat's rounds new token spans (its text now tokenizes differently) and drop its K/V rows, which
        belong to the old spans; returns the files no session references any more."""
        with self.transaction() as db:
            files = [r[0] for r in db.execute("SELECT DISTINCT file FROM kv_segments WHERE session_id = ?", [sid])]
            db.execute("DELETE FROM kv_segments WHERE session_id = ?", [sid])
            for idx, (start, end) in enumerate(zip(starts, ends)):
                db.execute("UPDATE rounds SET token_start = ?, token_end = ? WHERE session_id = ? AND idx = ?",
                           [start, end, sid, idx])
        return self.unreferenced(files)

    # ---- KV segments ----

    def add_segment(self, sid: str, *, kind: str = SEGMENT_KV, **row) -> None:
        check_segment_kind(kind)
        with self.transaction() as db:
            db["kv_segments"].upsert({"session_id": sid, "created": now(), "kind": kind, **row}, pk=_SEGMENT_PK)

    def segments(self, sid: str) -> list[dict]:
        return self._query("SELECT * FROM kv_segments WHERE session_id = ? ORDER BY round_idx, kind, layer_start",
                           [sid])

    def drop_segment_rows(self, sid: str, keys: list[tuple[int, str, int]]) -> list[str]:
        """Delete the segment rows named by (round_idx, kind, layer_start) in one transaction; returns the files no
        session references any more (to unlink after the commit)."""
        with self.transaction() as db:
            files = []
            for round_idx, kind, layer_start in keys:
                where = [sid, round_idx, kind, layer_start]
                files += [r[0] for r in db.execute("SELECT file FROM kv_segments WHERE session_id = ? AND round_idx = ? "
                                                   "AND kind = ? AND layer_start = ?", where)]
                db.execute("DELETE FROM kv_segments WHERE session_id = ? AND round_idx = ? AND kind = ? AND "
                           "layer_start = ?", where)
        return self.unreferenced(sorted(set(files)))

    def layer_stats(self, sid: str) -> dict | None:
        """The chat's attention statistics (engine.policies.layer_stats.LayerStats as a dict), or None."""
        rows = self._fetch("SELECT stats FROM layer_stats WHERE session_id = ?", [sid])
        return json.loads(rows[0][0]) if rows else None

    def save_layer_stats(self, sid: str, stats: dict) -> None:
        with self.transaction() as db:
            db["layer_stats"].upsert({"session_id": sid, "stats": json.dumps(stats), "updated": now()},
                                     pk="session_id")

    def drop_segments(self, sid: str, round_idx: int) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM kv_segments WHERE session_id = ? AND round_idx = ?", [sid, round_idx])

    def unreferenced(self, files: list[str]) -> list[str]:
        """Those of `files` that no session's segment rows name any more (safe to unlink once that is committed)."""
        still = {r[0] for r in self._fetch(
            "SELECT DISTINCT file FROM kv_segments WHERE file IN (SELECT value FROM json_each(?))", [json.dumps(files)])}
        return [f for f in files if f not in still]

    def referenced_files(self) -> set[str]:
        return {r[0] for r in self._fetch("SELECT DISTINCT file FROM kv_segments")}

    # ---- restores ----

    def record_restore(self, sid: str, *, tokens_loaded: int, tokens_recomputed: int, restore_ms: float,
                       ttft_ms: float | None, notes: list[str], tokens_planned: int = 0, compute_ms: float = 0.0,
                       load_ms: float = 0.0, gap_ms: float = 0.0, plan: str = "") -> None:
        """`tokens_recomputed`: the fallback's (K/V that could not be loaded); `tokens_planned`: the plan's."""
        with self.transaction() as db:
            db["restores"].insert({"session_id": sid, "at": now(), "tokens_loaded": tokens_loaded,
                                   "tokens_recomputed": tokens_recomputed, "restore_ms": restore_ms,
                                   "ttft_ms": ttft_ms, "notes": json.dumps(notes), "tokens_planned": tokens_planned,
                                   "compute_ms": compute_ms, "load_ms": load_ms, "gap_ms": gap_ms, "plan": plan})

    def last_restore(self, sid: str) -> dict | None:
        rows = self._query("SELECT * FROM restores WHERE session_id = ? ORDER BY id DESC LIMIT 1", [sid])
        if not rows:
            return None
        rows[0]["notes"] = json.loads(rows[0]["notes"] or "[]")
        return rows[0]

    # ---- per-layer KV budgets ----

    def save_kv_budgets(self, sid: str, *, policy: str, budget: float, input_slots: int, kept: list[int],
                        retention: list[float], round_idx: int, fingerprint: str | None = None) -> None:
        """The chat's latest per-layer budgets (one row a chat, replaced by each reply's choice); with the model's
        `fingerprint`, added to the model's average (`model_kv_budgets`) in the same transaction."""
        with self.transaction("save the chat's KV budgets") as db:
            db["kv_budgets"].upsert({"session_id": sid, "policy": policy, "budget": budget,
                                     "input_slots": input_slots, "kept": json.dumps(kept),
                                     "retention": json.dumps([round(r, 4) for r in retention]),
                                     "round_idx": round_idx, "updated": now()}, pk="session_id")
            if fingerprint is None:
                return
            shares = [n / max(input_slots, 1) for n in kept]
            rows = list(db["model_kv_budgets"].rows_where("fingerprint = ? AND policy = ?", [fingerprint, policy]))
            replies, share_sums, retention_sums = 0, [0.0] * len(shares), [0.0] * len(retention)
            if rows and len(json.loads(rows[0]["kept_share_sums"])) == len(shares):
                replies = rows[0]["replies"]
                share_sums = json.loads(rows[0]["kept_share_sums"])
                retention_sums = json.loads(rows[0]["retention_sums"])
            db["model_kv_budgets"].upsert({
                "fingerprint": fingerprint, "policy": policy, "replies": replies + 1,
                "kept_share_sums": json.dumps([a + b for a, b in zip(share_sums, shares)]),
                "retention_sums": json.dumps([a + b for a, b in zip(retention_sums, retention)]),
                "updated": now()}, pk=("fingerprint", "policy"))

    def model_kv_budgets(self, fingerprint: str, policy: str) -> dict | None:
        """A model's average budgets under `policy` over every reply chosen so far: {"policy", "replies",
        "kept_share" (per layer, the mean share of the input kept), "retention" (per global layer, the mean share of
        the scored attention kept)}, or None."""
        if "model_kv_budgets" not in self._tables(self.db):  # a read-only store older than migration 010
            return None
        rows = self._query("SELECT * FROM model_kv_budgets WHERE fingerprint = ? AND policy = ?", [fingerprint, policy])
        if not rows:
            return None
        n = rows[0]["replies"]
        return {"policy": policy, "replies": n,
                "kept_share": [round(x / n, 4) for x in json.loads(rows[0]["kept_share_sums"])],
                "retention": [round(x / n, 4) for x in json.loads(rows[0]["retention_sums"])]}

    def kv_budgets(self, sid: str) -> dict | None:
        """The chat's latest per-layer budgets (kept, retention as lists), or None."""
        if "kv_budgets" not in self._tables(self.db):  # a read-only store older than migration 009
            return None
        rows = self._query("SELECT * FROM kv_budgets WHERE session_id = ?", [sid])
        if not rows:
            return None
        return rows[0] | {"kept": json.loads(rows[0]["kept"]), "retention": json.loads(rows[0]["retention"])}

    @staticmethod
    def _tables(db: Database) -> set[str]:
        return set(db.table_names())

    def integrity_ok(self) -> bool:
        return self._fetch("PRAGMA integrity_check")[0][0] == "ok"
