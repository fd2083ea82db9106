"""Editing a past message (`kvchat edit`), exporting transcripts (`kvchat export --format`) and a chat's own
parameters (`kvchat params`), through the real commands."""

from __future__ import annotations

import json
from pathlib import Path

from cli_run import kvchat
from kvchat.paths import data_dir
from kvchat.storage.db import Store, chat_parameters
from tui_support import seed_chat


def store() -> Store:
    return Store(data_dir())


def chat_with(*messages: str) -> str:
    sid = kvchat("new").stdout.strip()
    for message in messages:
        kvchat("send", sid, message)
    return sid


def test_edit_keeps_the_kv_of_earlier_rounds_and_the_old_branch_as_a_fork():
    sid = chat_with("My name is Ada.", "I live in Paris.", "Where do I live?")
    before = store().rounds(sid)
    out = json.loads(kvchat("edit", sid, "1", "I live in Rome.", "--json").stdout)
    assert out["edited_round"] == 1 and out["reply"] == "Noted: you live in Rome."
    restore = out["restore"]  # a new process: rounds 0 restored from disk, nothing recomputed for want of K/V
    assert restore["tokens_recomputed"] == 0
    assert restore["tokens_loaded"] + restore["tokens_planned"] == before[1].token_start
    rounds = store().rounds(sid)
    assert [r.user_text for r in rounds] == ["My name is Ada.", "I live in Rome."]
    assert rounds[0] == before[0]  # the round before is untouched
    fork = out["fork"]
    assert [r.user_text for r in store().rounds(fork)] == [r.user_text for r in before]
    assert store().session(fork)["title"] == "My name is Ada. (before editing round 1)"
    # The fork's K/V is the old chat's, shared by file: it restores from disk.
    assert len({s["round_idx"] for s in store().segments(fork)}) == 3
    said = kvchat("edit", sid, "1", "I live in Oslo.").stderr  # streamed, then the line of what was kept
    assert "edited round 1: kept the K/V of round 0" in said and "only the edited round was computed" in said


def test_edit_with_drop_old_leaves_no_fork():
    sid = chat_with("My name is Ada.", "I live in Paris.")
    out = kvchat("edit", sid, "0", "My name is Bob.", "--drop-old")
    assert out.stdout.strip() == "Noted: your name is Bob."
    assert "the replaced 2 rounds dropped" in out.stderr
    assert [s["id"] for s in store().sessions()] == [sid]
    assert [r.user_text for r in store().rounds(sid)] == ["My name is Bob."]


def test_an_edit_of_a_round_that_does_not_exist_is_one_line_and_changes_nothing():
    sid = seed_chat("text", [("My name is Ada.", "Noted: your name is Ada.")], with_kv=False)
    before = store().rounds(sid)
    for round_idx in ("1", "-1"):
        bad = kvchat("edit", sid, "--", round_idx, "x", check=False)
        assert bad.returncode != 0 and bad.stdout == ""
        assert bad.stderr.strip().splitlines() == [f"kvchat: error: the chat has no round {round_idx} (its only round "
                                                   f"is 0, as `kvchat show` numbers them)"]
    empty = kvchat("new").stdout.strip()
    bad = kvchat("edit", empty, "0", "x", check=False)
    assert bad.stderr.strip().splitlines() == ["kvchat: error: the chat has no round 0: it has no rounds yet"]
    assert store().rounds(sid) == before and len(store().sessions()) == 2  # and the empty one


def test_export_as_markdown_text_and_json_messages(tmp_path):
    reply = "Like this:\n\n```python\nprint('hi')\n```"
    sid = seed_chat("code", [("How do I print?", reply), ("Thanks.", "You are welcome.")], with_kv=False,
                    system_prompt="Be brief.")
    kvchat("export", sid, "-o", str(tmp_path / "chat.json"), "--format", "json")
    assert json.loads((tmp_path / "chat.json").read_text()) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "How do I print?"},
        {"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."}]
    kvchat("export", sid, "-o", str(tmp_path / "chat.md"), "--format", "md")
    md = (tmp_path / "chat.md").read_text()
    assert md.startswith("# code\n\n## System prompt\n\nBe brief.\n\n## User\n\nHow do I print?\n\n## Assistant\n\n")
    assert "```python\nprint('hi')\n```" in md and md.count("## User") == 2 and md.count("## Assistant") == 2
    kvchat("export", sid, "-o", str(tmp_path / "chat.txt"), "--format", "txt")
    assert "user:\nThanks.\n\nassistant:\nYou are welcome.\n" in (tmp_path / "chat.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.md", "chat.txt"]  # no temp file left


def test_an_export_to_an_unwritable_path_is_one_line_and_writes_nothing(tmp_path):
    sid = seed_chat("text", [("My name is Ada.", "Noted: your name is Ada.")], with_kv=False)
    for fmt in ("md", "state"):
        target = tmp_path / "missing" / f"chat.{fmt}"
        bad = kvchat("export", sid, "-o", str(target), "--format", fmt, check=False)
        assert bad.returncode != 0 and bad.stdout == ""
        assert bad.stderr.strip().splitlines() == [f"kvchat: error: cannot write {target}: No such file or directory"]
    assert list(tmp_path.iterdir()) == []


def test_parameters_are_stored_with_the_chat_forked_exported_and_used(tmp_path):
    sid = chat_with("My name is Ada.")
    assert json.loads(kvchat("params", sid, "--json").stdout)["parameters"] == {
        "temperature": None, "top_p": None, "top_k": None, "seed": None, "reply_cap": None}
    kvchat("params", sid, "--temperature", "0.7", "--seed", "3", "--reply-cap", "2")
    shown = kvchat("params", sid).stdout
    assert "temperature: 0.7\n" in shown and "seed: 3\n" in shown and "top-p: default\n" in shown
    bad = kvchat("params", sid, "--top-p", "0", check=False)
    assert bad.returncode == 2 and "--top-p" in bad.stderr
    # The reply cap is used by a send (a --reply-cap given to the send wins).
    capped = json.loads(kvchat("send", sid, "What is my name?", "--json").stdout)
    assert capped["stop_reason"] == "reply_cap"
    whole = json.loads(kvchat("send", sid, "What is my name?", "--json", "--reply-cap", "40").stdout)
    assert whole["stop_reason"] != "reply_cap"
    # A state file carries them, and an import keeps them.
    kvchat("export", sid, "-o", str(tmp_path / "chat.kvstate"))
    imported = kvchat("import", str(tmp_path / "chat.kvstate")).stdout.strip()
    again = json.loads(kvchat("params", imported, "--json").stdout)["parameters"]
    assert again == {"temperature": 0.7, "top_p": None, "top_k": None, "seed": 3, "reply_cap": 2}
    fork = store().fork_session(sid, 1, "fork")  # and a fork (an edit's too) takes them along
    assert chat_parameters(store().session(fork)) == again
    kvchat("params", sid, "--reset", "all", "--top-k", "5")
    assert json.loads(kvchat("params", sid, "--json").stdout)["parameters"] == {
        "temperature": None, "top_p": None, "top_k": 5, "seed": None, "reply_cap": None}


def test_a_chat_at_temperature_0_answers_greedily_whatever_the_default():
    from kvchat.app.session.service import ChatService
    from kvchat.engine.sampling import SamplingParams
    from tui_support import shared_engine

    sid = seed_chat("ada", ["My name is Ada."])
    service = ChatService(device="cpu")
    service._engines[str(Path(shared_engine().path).resolve())] = shared_engine()
    hot = SamplingParams(temperature=100.0, seed=1)
    wild = service.send(sid, "What is my name?", max_tokens=12, sampling=hot, regenerate=False)
    assert wild.round.assistant_text != "Your name is Ada."  # sampled at 100, the default gives noise
    service.set_parameters(sid, {"temperature": 0.0})
    greedy = service.send(sid, "What is my name?", max_tokens=12, sampling=hot, edit=None)
    assert greedy.round.assistant_text == "Your name is Ada."
    service.close()
