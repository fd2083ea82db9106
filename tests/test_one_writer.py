"""One writer per chat: processes that send to one chat at once wait their turn (or refuse in one line), a session
whose chat grew under it takes that in, and nothing anyone sent is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Callable

import pytest
import torch

from cli_run import kvchat
from kvchat.app.session.chat import ChatSession
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.generate import prefill
from kvchat.paths import data_dir
from kvchat.storage.chat_lock import ChatBusyError, ChatLock, is_locked, lock_path
from kvchat.storage.db import REPLY_DONE, Store
from kvchat.storage.fingerprint import model_fingerprint

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def new_chat(store: Store) -> str:
    return store.create_session(title="race", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                                model_path=str(DEFAULT_MODEL), system_prompt=SYSTEM)


def holder_process(home, sid: str, seconds: float) -> subprocess.Popen:
    """Another process that takes the chat's lock, says so on stdout, and holds it for `seconds`."""
    code = textwrap.dedent(f"""
        import time
        from kvchat.storage.chat_lock import ChatLock
        lock = ChatLock.acquire({str(home)!r}, {sid!r})
        print("held", flush=True)
        time.sleep({seconds})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_waits_for_the_first_and_names_it(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    holder = holder_process(kvchat_home, sid, 1.5)
    try:
        proc = kvchat("send", sid, "My name is Ada.", "--device", "cpu")
    finally:
        holder.wait()
    assert f"waiting for another kvchat process writing to this chat (pid {holder.pid}" in proc.stderr
    assert [r.user_text for r in Store().rounds(sid)] == ["My name is Ada."]


def test_a_writer_that_will_not_wait_refuses_in_one_line_and_keeps_nothing_half_done(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    holder = holder_process(kvchat_home, sid, 30)
    try:
        proc = kvchat("send", sid, "My name is Ada.", "--device", "cpu", "--wait", "0", check=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"kvchat: error: chat {sid} is being written by pid {holder.pid}, ")
    assert "nothing was sent" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert Store().rounds(sid) == []
    # Killed holding it (SIGKILL: no clean-up), the lock is gone with the process.
    assert not is_locked(kvchat_home, sid)
    kvchat("send", sid, "My name is Ada.", "--device", "cpu", "--wait", "0")


def test_lock_waits_tells_once_and_names_the_holder(kvchat_home):
    told = []
    first = ChatLock.acquire(kvchat_home, "abc")
    assert is_locked(kvchat_home, "abc")
    releaser = threading.Timer(0.3, first.release)
    releaser.start()
    started = time.monotonic()
    # This process's own earlier lock (its K/V writer finishing a round) is waited for without a word.
    second = ChatLock.acquire(kvchat_home, "abc", wait_s=5, on_wait=told.append)
    assert 0.2 < time.monotonic() - started < 5 and told == []
    with pytest.raises(ChatBusyError, match=rf"chat abc is being written by pid {os.getpid()}, `"):
        ChatLock.acquire(kvchat_home, "abc", wait_s=0.2)
    second.release()
    second.release()  # twice is harmless
    assert not is_locked(kvchat_home, "abc")
    assert json.loads(lock_path(kvchat_home, "abc").read_text())["pid"] == os.getpid()


def test_a_session_whose_chat_grew_elsewhere_reloads_and_answers_as_one_that_saw_it_all(engine, kvchat_home):
    store = Store()
    sid = new_chat(store)
    stale = ChatSession(store, engine, sid)
    stale.restore()
    stale.send("My name is Ada.")
    other = ChatSession(Store(), engine, sid)  # another writer (its own connection), on the chat as it now is
    other.send("My sister's name is Mira.")
    other.close()
    # Before: IntegrityError (UNIQUE rounds.session_id, rounds.idx), the round lost.
    reply = stale.send("What is my sister's name?").text
    stale.close()
    assert reply == "Your sister's name is Mira."
    rounds = store.rounds(sid)
    assert [r.user_text for r in rounds] == ["My name is Ada.", "My sister's name is Mira.",
                                              "What is my sister's name?"]
    assert [r.token_start for r in rounds[1:]] == [r.token_end for r in rounds[:-1]]
    # The stale session's cache now is the chat's, exactly as computed in one go.
    tokens = [t for span in engine.chat.round_spans(stale.conversation()) for t in span]
    fresh = engine.new_cache(len(tokens) + 8)
    with torch.inference_mode():
        prefill(engine.model, fresh, tokens)
    n = len(tokens)
    assert stale.cache.length == n
    assert (stale.cache.kv[:, :, :, :n] - fresh.kv[:, :, :, :n]).abs().max() < 1e-2


WORKER = """
import sys
from kvchat.app.cli import main
sid, max_tokens, messages = sys.argv[1], sys.argv[2], sys.argv[3:]
for message in messages:  # `kvchat send` as its command line runs it, once per message, in this one process
    try:
        main(["send", sid, message, "--device", "cpu", "--max-tokens", max_tokens])
    except SystemExit as exc:
        if exc.code:
            sys.exit(exc.code)
"""


WAITING = "kvchat: notice: waiting for another kvchat process writing to this chat"


def race(sid: str, workers: int, rounds: int, short: bool = False) -> list[list[tuple[str, str]]]:
    """`workers` processes at once, each sending `rounds` messages to the chat one after another through the
    `kvchat send` command: what each sent and what it printed. `short`: messages and replies of a few tokens (160
    rounds of the demo model's must fit its 4,096 tokens of context)."""
    met: list[bool] = []
    sent = race_processes(sid, workers, rounds, met, short)()
    assert met == [True]  # they did meet: some process waited for another
    return sent


def race_processes(sid: str, workers: int, rounds: int, met: list[bool] | None = None,
                   short: bool = False) -> Callable[[], list[list[tuple[str, str]]]]:
    """The race started: call the result to wait for its processes and have what each sent and printed (and, in
    `met`, whether any waited for another)."""
    note = "K{w}-{r}" if short else "Note {w}-{r}: my code is K{w}{r}."
    sent = [[note.format(w=w, r=r) for r in range(rounds)] for w in range(workers)]
    max_tokens = "4" if short else "12"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, sid, max_tokens, *messages], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "KVCHAT_DEBUG": ""})
             for messages in sent]
    return lambda: _raced(procs, sent, rounds, met if met is not None else [])


def _raced(procs: list[subprocess.Popen], sent: list[list[str]], rounds: int,
           met: list[bool]) -> list[list[tuple[str, str]]]:
    workers = len(procs)
    outs = [p.communicate(timeout=1800) for p in procs]
    said = [[line for line in err.splitlines() if not line.startswith(WAITING)] for _, err in outs]
    assert [(p.returncode, lines) for p, lines in zip(procs, said)] == [(0, [])] * workers
    met.append(any(WAITING in err for _, err in outs))
    replies = [out.splitlines() for out, _ in outs]
    assert [len(r) for r in replies] == [rounds] * workers  # one line per reply
    return [list(zip(messages, mine)) for messages, mine in zip(sent, replies)]


def check_race(engine, sid: str, sent: list[list[tuple[str, str]]]) -> None:
    """Every message and the reply its process printed are in the chat, each process's in the order it sent them,
    the spans follow one another, the database is sound, every file is referenced and every referenced file there,
    and the chat restores exactly: the K/V each process saved is that of the chat as it was."""
    store = Store(data_dir())
    rounds = store.rounds(sid)
    stored = [(r.user_text, r.assistant_text) for r in rounds]
    assert sorted(stored) == sorted(pair for mine in sent for pair in mine)
    for mine in sent:
        assert [stored.index(pair) for pair in mine] == sorted(stored.index(pair) for pair in mine)
    assert [r.idx for r in rounds] == list(range(len(rounds))) and {r.reply_state for r in rounds} == {REPLY_DONE}
    assert rounds[0].token_start == 0 and [r.token_start for r in rounds[1:]] == [r.token_end for r in rounds[:-1]]
    assert store.integrity_ok()
    assert {p.name for p in store.kv_dir.iterdir()} == store.referenced_files()
    chat = ChatSession(store, engine, sid)
    stats = chat.restore()
    assert stats.tokens_recomputed == 0 and stats.notes == []
    tokens = [t for span in engine.chat.round_spans(chat.conversation()) for t in span]
    assert chat.cache.length == len(tokens) == rounds[-1].token_end
    fresh = engine.new_cache(len(tokens) + 8)
    with torch.inference_mode():
        prefill(engine.model, fresh, tokens)
    n = len(tokens)
    # The same K/V up to float32's order of summation: a reply's K/V was made one token at a time, the fresh one in
    # one batch, and the difference grows through the layers (layer 0: ~1e-6; the last: 0.004-0.011, measured, with
    # K/V values up to 28). Any K/V of other tokens would differ by the values' own size.
    stored, expected = chat.cache.kv[:, :, :, :n], fresh.kv[:, :, :, :n]
    assert (stored - expected).abs().max() < 1e-3 * expected.abs().max()
    chat.close()


def test_four_processes_three_rounds_each_lose_nothing(engine, kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    check_race(engine, sid, race(sid, workers=4, rounds=3))


@pytest.mark.stress
def test_eight_processes_twenty_rounds_each_lose_nothing(engine, kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    check_race(engine, sid, race(sid, workers=8, rounds=20, short=True))


def test_sigterm_while_waiting_for_the_lock_sends_nothing(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    holder = holder_process(kvchat_home, sid, 30)
    try:
        waiter = subprocess.Popen([sys.executable, "-m", "kvchat.app.cli", "send", sid, "hi", "--device", "cpu"],
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "KVCHAT_DEBUG": ""})
        assert "waiting for another kvchat process" in waiter.stderr.readline()
        waiter.send_signal(signal.SIGTERM)
        rest = waiter.stderr.read()
        assert waiter.wait(timeout=60) == 1
    finally:
        holder.kill()
        holder.wait()
    assert rest.startswith(f"kvchat: error: chat {sid} is being written by pid {holder.pid}")
    assert Store().rounds(sid) == []
