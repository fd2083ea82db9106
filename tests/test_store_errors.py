"""Errors about the place the chats live in, through the real `kvchat` command: a read-only home (a read-only mount,
or a folder and database this user cannot write) still reads and refuses every write in one line; a full disk, a
KVCHAT_HOME that is a file or under a missing folder say so; none of them is an internal error or loses a chat.

Read-only is made for real: as root, by bind-mounting the home read-only over itself (EROFS), and by running the
command as `nobody` (root ignores permission bits, so chmod alone would not stop it); as another user, by chmod."""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path

import pytest

from cli_run import kvchat as kvchat_checked
from kvchat.errors import KvchatError
from kvchat.paths import data_dir, place_words, write_json_atomically
from kvchat.storage import db as store_db
from kvchat.storage.db import Store, StoreError

ROOT = os.geteuid() == 0
MOUNT, UNWRITABLE = "read-only mount", "unwritable folder"
CLOSED, CRASHED = "closed cleanly", "left -wal and -shm"


def kvchat(*args: str, **kwargs):
    return kvchat_checked(*args, check=False, **kwargs)


def one_error(proc, *words: str) -> str:
    """The command failed with exit 1 and one `kvchat: error:` line holding `words`; no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kvchat: error: "), proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def shown(sid: str) -> dict:
    out = json.loads(kvchat("show", sid, "--json").stdout)
    return {k: out[k] for k in ("id", "title", "rounds")}


def seed(title: str, exchanges: list[tuple[str, str]]) -> str:
    from tui_support import seed_chat

    return seed_chat(title, exchanges, with_kv=False)


# ---------------------------------------------------------------- making a home read-only


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` to run as")


# What the commands import lazily, imported before becoming `nobody`, who may not be able to read Python's own
# library (under /root where Python was installed by root).
LAZY_IMPORTS = ("encodings.cp437", "kvchat.app.session.service", "kvchat.storage.statefile")


@contextlib.contextmanager
def as_nobody():
    """This process's effective user is `nobody` (permission bits apply); root again afterwards."""
    user = _nobody()
    for name in LAZY_IMPORTS:
        importlib.import_module(name)
    try:
        os.setegid(user.pw_gid)
        os.seteuid(user.pw_uid)
    except PermissionError as exc:
        os.setegid(0)
        pytest.skip(f"cannot run as nobody here: {exc}")
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


class ReadOnly:
    """`with ReadOnly(kind, home):` the home is read-only for what runs inside."""

    def __init__(self, kind: str, home: Path):
        self.kind, self.home = kind, home
        if kind == MOUNT and not ROOT:
            pytest.skip("a read-only mount needs root")
        self._modes: dict[Path, int] = {}
        self._nobody = None

    def __enter__(self):
        gc.collect()  # no connection of an earlier command holds the folder
        if self.kind == MOUNT:
            for args in (["--bind", self.home, self.home], ["-o", "remount,bind,ro", self.home]):
                done = subprocess.run(["mount", *map(str, args)], check=False, capture_output=True, text=True)
                if done.returncode:
                    self._unmount()
                    pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
        elif ROOT:
            self._nobody = as_nobody()
            self._nobody.__enter__()
        else:
            for path in [self.home, *self.home.iterdir()]:
                self._modes[path] = path.stat().st_mode
                path.chmod(0o555 if path.is_dir() else 0o444)
        return self

    def __exit__(self, *exc):
        gc.collect()
        if self.kind == MOUNT:
            self._unmount()
        elif self._nobody is not None:
            self._nobody.__exit__(*exc)
        for path, mode in self._modes.items():
            path.chmod(mode)

    def _unmount(self) -> None:
        if subprocess.run(["umount", str(self.home)], check=False, capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.home)], check=False, capture_output=True)


def _public_folder(mode: int):
    """A folder `nobody` can reach (pytest's own are root's alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="kvchat-test-"))
    folder.chmod(mode)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def home(kvchat_home, monkeypatch):
    """KVCHAT_HOME in a folder `nobody` can read, holding the embedded model's profile as kvchat_home does."""
    for folder in _public_folder(0o755):
        shutil.copytree(kvchat_home / "profiles", folder / "profiles")
        monkeypatch.setenv("KVCHAT_HOME", str(folder))
        yield folder


@pytest.fixture
def outside():
    """A folder anyone may write in (where an export from a read-only home goes)."""
    yield from _public_folder(0o777)


def crash_open(home: Path, sid: str) -> None:
    """The store as a killed process leaves it: -wal and -shm beside the database, the last round only in the WAL."""
    store = Store(home)
    store.db.execute("PRAGMA wal_autocheckpoint=0")
    last = store.rounds(sid)[-1]
    store.add_round(sid, store_db.RoundRow(last.idx + 1, "only in the WAL", "yes", last.token_end,
                                           last.token_end + 9, store_db.now()))
    db = home / "kvchat.db"
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(f"{db}{suffix}", f"{db}{suffix}.kept")
    store.close()  # checkpoints and removes -wal, -shm: put back the copies made while it was open
    for suffix in ("", "-wal", "-shm"):
        os.replace(f"{db}{suffix}.kept", f"{db}{suffix}")
    assert (home / "kvchat.db-wal").stat().st_size > 0


# ---------------------------------------------------------------- read-only home


@pytest.mark.parametrize("state", [CLOSED, CRASHED])
@pytest.mark.parametrize("kind", [MOUNT, UNWRITABLE])
def test_read_only_home_reads_and_refuses_writes(home, outside, kind, state):
    sid = seed("kept", [("hi", "there"), ("how are you", "fine")])
    other = seed("other", [("a", "b")])
    kvchat("export", sid, "-o", str(outside / "kept.kvchat"))
    (outside / "kept.kvchat").chmod(0o644)  # an export is its writer's alone (0600)
    users = [r["user"] for r in shown(sid)["rounds"]]
    if state == CRASHED:
        crash_open(home, sid)
        users.append("only in the WAL")
    gc.collect()  # the commands' connections are closed (their -wal and -shm gone, as when their processes end)
    files = sorted(p.name for p in home.iterdir())

    with ReadOnly(kind, home):
        listed = kvchat("sessions", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {r["id"] for r in json.loads(listed.stdout)} == {sid, other}
        shown_ro = kvchat("show", sid, "--json")
        assert shown_ro.returncode == 0, shown_ro.stderr
        assert [r["user"] for r in json.loads(shown_ro.stdout)["rounds"]] == users  # the WAL's round included
        exported = kvchat("export", sid, "-o", str(outside / "again.kvchat"))
        assert exported.returncode == 0, exported.stderr
        for args, doing in [(("new",), "create a chat"), (("rm", sid), "delete the chat"),
                            (("import", str(outside / "kept.kvchat")), "import a chat")]:
            one_error(kvchat(*args), f"{home} is read-only: cannot {doing}")
        assert sorted(p.name for p in home.iterdir()) == files  # nothing written, not even a lock or a -shm

    assert [r["user"] for r in shown(sid)["rounds"]] == users
    assert len(json.loads(kvchat("sessions", "--json").stdout)) == 2


@pytest.mark.parametrize("kind", [MOUNT, UNWRITABLE])
def test_send_on_a_read_only_home_says_read_only_first(home, kind):
    sid = seed("kept", [("hi", "there")])
    before = shown(sid)
    with ReadOnly(kind, home):
        sent = kvchat("send", sid, "hello", "--device", "cpu")
    one_error(sent, f"{home} is read-only: cannot")
    assert shown(sid) == before


@pytest.mark.parametrize("kind", [MOUNT, UNWRITABLE])
def test_read_only_home_without_its_profile_says_read_only(home, kind):
    sid = seed("kept", [("hi", "there")])
    shutil.rmtree(home / "profiles")
    with ReadOnly(kind, home):
        sent = kvchat("send", sid, "hello", "--device", "cpu")
    one_error(sent, f"{home} is read-only: cannot")  # not a notice that it is being measured
    assert "measuring" not in sent.stderr


def older_store(home: Path, keep: int) -> None:
    """Make the store look written by a kvchat that knew only the first `keep` migrations."""
    with contextlib.closing(sqlite3.connect(home / "kvchat.db")) as conn:
        names = [name for name, _ in store_db.MIGRATIONS[keep:]]
        if "006_round_reply_state" in names:
            conn.execute("ALTER TABLE rounds DROP COLUMN reply_state")
        conn.executemany("DELETE FROM _migrations WHERE name = ?", [(n,) for n in names])
        conn.execute(f"PRAGMA user_version = {keep}")
        conn.commit()


@pytest.mark.parametrize("kind", [MOUNT, UNWRITABLE])
def test_read_only_home_reads_a_store_one_migration_behind(home, kind):
    sid = seed("kept", [("hi", "there"), ("again", "yes")])
    before = shown(sid)
    older_store(home, len(store_db.MIGRATIONS) - 1)
    with ReadOnly(kind, home):
        reading = kvchat("show", sid, "--json")
        assert reading.returncode == 0, reading.stderr
        assert json.loads(reading.stdout)["rounds"] == before["rounds"]
        store = Store()
        assert store.read_only and [r.reply_state for r in store.rounds(sid)] == ["done", "done"]
        store.close()
        one_error(kvchat("rm", sid), f"{home} is read-only: cannot delete the chat")
    assert shown(sid) == before  # migrated on this writable open, nothing lost


@pytest.mark.parametrize("kind", [MOUNT, UNWRITABLE])
def test_read_only_home_with_a_store_too_old_to_read(home, kind):
    seed("kept", [("hi", "there")])
    older_store(home, 4)
    gc.collect()
    before = (home / "kvchat.db").read_bytes()
    with ReadOnly(kind, home):
        one_error(kvchat("sessions"), f"{home} is read-only and its store needs an upgrade by this kvchat; open it "
                                      f"once where it is writable")
    assert (home / "kvchat.db").read_bytes() == before


def test_read_only_home_whose_wal_cannot_be_read(home):
    """A WAL holding commits, without its -shm, in a folder where none can be made: reading would miss them."""
    sid = seed("kept", [("hi", "there")])
    crash_open(home, sid)
    (home / "kvchat.db-shm").unlink()
    with ReadOnly(MOUNT if ROOT else UNWRITABLE, home):
        one_error(kvchat("show", sid), f"{home} is read-only and its store was not closed cleanly",
                  "open it once where it is writable")
    assert len(shown(sid)["rounds"]) == 2


# ---------------------------------------------------------------- where KVCHAT_HOME points


def test_home_that_is_a_file(tmp_path):
    path = tmp_path / "home"
    path.write_text("not a folder")
    one_error(kvchat("sessions", env={"KVCHAT_HOME": str(path)}), f"KVCHAT_HOME {path} is a file, not a folder")
    assert path.read_text() == "not a folder"


def test_home_whose_parent_is_missing_is_not_created(tmp_path):
    path = tmp_path / "unmounted-drive" / "kvchat"
    one_error(kvchat("sessions", env={"KVCHAT_HOME": str(path)}),
              f"KVCHAT_HOME {path}: its parent folder {path.parent} does not exist")
    assert not path.parent.exists()


def test_default_home_gets_its_parents(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCHAT_HOME")
    default = tmp_path / "deep" / "share" / "kvchat"
    monkeypatch.setattr("kvchat.paths.platformdirs.user_data_dir", lambda *a, **k: str(default))
    assert data_dir() == default
    assert kvchat("sessions").returncode == 0
    assert (default / "kvchat.db").is_file()


def test_home_that_cannot_be_created_for_permission(home):
    path = home / "kvchat"
    if ROOT:
        with as_nobody():
            made = kvchat("sessions", env={"KVCHAT_HOME": str(path)})
    else:
        home.chmod(0o555)
        try:
            made = kvchat("sessions", env={"KVCHAT_HOME": str(path)})
        finally:
            home.chmod(0o755)
    one_error(made, f"no permission to write in {home}: cannot create {path}")


@pytest.mark.parametrize("target", ["home", "database"])
def test_home_or_database_that_cannot_be_read(home, target):
    seed("kept", [("hi", "there")])
    gc.collect()
    path = home if target == "home" else home / "kvchat.db"
    mode = path.stat().st_mode
    path.chmod(0o000)
    try:
        with as_nobody() if ROOT else contextlib.nullcontext():
            one_error(kvchat("sessions"), f"no permission to read {path}")
    finally:
        path.chmod(mode)
    assert kvchat("sessions").returncode == 0


@pytest.mark.parametrize("what", ["folder", "garbage"])
def test_database_that_is_not_a_database(kvchat_home, what):
    db = kvchat_home / "kvchat.db"
    if what == "folder":
        db.mkdir()
    else:
        db.write_bytes(b"these bytes are no SQLite database" * 100)
    one_error(kvchat("sessions"), f"{db} is not a usable kvchat database")


# ---------------------------------------------------------------- a full disk


class FullDisk(sqlite3.Connection):
    """A connection whose writes (or only its COMMITs) fail as SQLite fails on a full disk."""

    failing: tuple[str, ...] = ("INSERT", "UPDATE", "DELETE", "REPLACE", "COMMIT")

    def execute(self, sql, *args):
        if sql.lstrip().upper().startswith(self.failing):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, *args)


class FullAtCommit(FullDisk):
    failing = ("COMMIT",)


def full_disk(monkeypatch, connection=FullDisk) -> None:
    connect = sqlite3.connect
    monkeypatch.setattr(store_db.sqlite3, "connect", lambda *a, **k: connect(*a, **k, factory=connection))


@pytest.mark.parametrize("connection", [FullDisk, FullAtCommit])
def test_full_disk_refuses_writes_in_one_line(kvchat_home, monkeypatch, connection):
    sid = seed("kept", [("hi", "there")])
    before = shown(sid)
    with monkeypatch.context() as m:
        full_disk(m, connection)
        one_error(kvchat("new"), f"the disk holding {kvchat_home} is full: cannot create a chat")
        one_error(kvchat("rm", sid), f"the disk holding {kvchat_home} is full: cannot delete the chat")
        assert kvchat("show", sid).returncode == 0  # reading needs no room
    assert shown(sid) == before
    assert [r["id"] for r in json.loads(kvchat("sessions", "--json").stdout)] == [sid]


def test_full_disk_when_sending(kvchat_home, monkeypatch):
    sid = seed("kept", [("hi", "there")])
    before = shown(sid)
    with monkeypatch.context() as m:
        full_disk(m)
        one_error(kvchat("send", sid, "hello", "--device", "cpu"), f"the disk holding {kvchat_home} is full: cannot")
    assert shown(sid) == before


def test_full_disk_for_files(kvchat_home, monkeypatch):
    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("kvchat.paths.tempfile.mkstemp", no_room)
    folder = kvchat_home / "profiles"
    with pytest.raises(KvchatError) as info:
        write_json_atomically(folder / "p.json", {}, "hardware profile")
    assert str(info.value) == f"the disk holding {folder} is full: cannot save the hardware profile (p.json)"
    # A K/V segment that cannot be written: the round's text is kept, the K/V said to be recomputed later.
    sid = seed("kept", [("hi", "there")])
    monkeypatch.setattr("kvchat.storage.segments._write_all", no_room)
    sent = kvchat("send", sid, "hello", "--device", "cpu", "--no-compact", "--max-tokens", "4")
    assert sent.returncode == 0, sent.stderr
    assert "kvchat: warning: the K/V of round 1 was not saved (cannot save KV segment in " in sent.stderr
    assert "No space left on device" in sent.stderr and "internal error" not in sent.stderr
    assert [r["user"] for r in shown(sid)["rounds"]] == ["hi", "hello"]


def test_profile_that_cannot_be_measured_on_a_full_disk(kvchat_home, monkeypatch):
    from kvchat.app.session import profile

    class FullPath(type(Path())):
        def mkdir(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    sid = seed("kept", [("hi", "there")])
    shutil.rmtree(kvchat_home / "profiles")
    monkeypatch.setattr(profile, "probe_folder", lambda name: FullPath(kvchat_home / "profiles" / name))
    sent = kvchat("send", sid, "hello", "--device", "cpu")
    assert sent.stderr.strip().splitlines()[-1] == (f"kvchat: error: the disk holding {kvchat_home} is full: cannot "
                                                    f"measure how fast this machine restores chats")
    assert sent.returncode == 1 and "Traceback" not in sent.stderr


# ---------------------------------------------------------------- the store's own rules


@pytest.mark.parametrize("exc, words", [
    (OSError(errno.EROFS, "Read-only file system"), "{home} is read-only: cannot save it"),
    (OSError(errno.ENOSPC, "No space left on device"), "the disk holding {home} is full: cannot save it"),
    (OSError(errno.EACCES, "Permission denied"), "no permission to write in {home}: cannot save it"),
    (OSError(errno.EIO, "Input/output error"), "an I/O error on the disk holding {home}: cannot save it"),
    (OSError(errno.ENAMETOOLONG, "File name too long"), "cannot save it in {home}: File name too long"),
    (sqlite3.OperationalError("attempt to write a readonly database"), "{home} is read-only: cannot save it"),
    (sqlite3.OperationalError("database or disk is full"), "the disk holding {home} is full: cannot save it"),
    (sqlite3.OperationalError("disk I/O error"), "an I/O error on the disk holding {home}: cannot save it"),
    (sqlite3.OperationalError("database is locked"), "cannot save it in {home}: database is locked"),
])
def test_place_error_words(kvchat_home, exc, words):
    store = Store()
    assert str(store.place_error(exc, "save it")) == words.format(home=kvchat_home)
    assert place_words(kvchat_home, exc, "save it") == words.format(home=kvchat_home)
    store.close()


def test_transaction_keeps_bugs_as_they_are_and_a_failed_rollback_quiet(kvchat_home, monkeypatch):
    store = Store()
    with pytest.raises(sqlite3.IntegrityError), store.transaction() as db:  # a bug, not the place: as it is
        db.execute("INSERT INTO _migrations (name, applied) VALUES ('001_initial', 'again')")
    with pytest.raises(sqlite3.OperationalError, match="no such table"), store.transaction() as db:
        db.execute("SELECT * FROM no_such_table")
    store.close()

    class FullAndStuck(FullAtCommit):
        failing = ("COMMIT", "ROLLBACK")

    sid = seed("kept", [("hi", "there")])
    with monkeypatch.context() as m:
        full_disk(m, FullAndStuck)
        store = Store()
        with pytest.raises(StoreError, match=f"^the disk holding {kvchat_home} is full: cannot rename the chat$"):
            store.rename_session(sid, "new title")
        store.db.conn.close()
    assert shown(sid)["title"] == "kept"
