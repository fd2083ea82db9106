"""Chats under the xkv policy: the full cache stays, each reply reads its per-layer budgets, the latest budgets are
kept with the chat and shown; bad budgets are refused in one line with nothing changed."""

from __future__ import annotations

import json

from cli_run import kvchat
from kvchat.storage.db import Store

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
MESSAGES = ["My name is Ada.", "My sister's name is Mira.", "I live in Lisbon.", "What is my sister's name?"]


def chat_under(policy: list[str]) -> tuple[str, list[str]]:
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    replies = [kvchat("send", sid, m, "--device", "cpu", *policy).stdout.strip() for m in MESSAGES]
    return sid, replies


def test_a_chat_under_xkv_answers_and_keeps_its_budgets(kvchat_home):
    # (budget 1.0 gives the full cache's tokens: tests/test_layer_budgets.py)
    sid, replies = chat_under(["--kv-policy", "xkv", "--kv-budget", "0.4"])
    assert replies[-1] == "Your sister's name is Mira."  # the full cache's answer
    budgets = json.loads(kvchat("show", sid, "--json").stdout)["kv_budgets"]
    rounds = Store().rounds(sid)
    assert budgets["policy"] == "xkv" and budgets["budget"] == 0.4 and budgets["round_idx"] == 3
    # the input: the history and the last message's prompt, not its reply
    assert rounds[-1].token_start < budgets["input_slots"] < rounds[-1].token_end
    n = budgets["input_slots"]
    kept = budgets["kept"]
    assert len(kept) == 8 and sum(kept) == 8 * max(8, -(-4 * n // 10))  # the budget, spent across the layers
    # a layer may keep its window alone (the model's layer costs weigh some layers at 1% of others): R = 0 there
    assert all(0 <= r <= 1 for r in budgets["retention"]) and max(budgets["retention"]) > 0
    shown = kvchat("show", sid).stdout
    assert "KV budgets (xkv 0.4, at round 3)" in shown and "per layer: " + " ".join(map(str, kept)) in shown
    # the model's average over every reply of every chat on it (XKV's sampling mode): 4 replies, then 8
    average = json.loads(kvchat("show", sid, "--json").stdout)["model_kv_budgets"]
    assert average["policy"] == "xkv" and average["replies"] == 4 and len(average["kept_share"]) == 8
    assert all(0 < x <= 1 for x in average["kept_share"]) and all(0 <= r <= 1 for r in average["retention"])
    assert "this model's average (xkv, 4 replies of every chat)" in kvchat("show", sid).stdout
    other, _ = chat_under(["--kv-policy", "xkv", "--kv-budget", "0.4"])
    assert json.loads(kvchat("show", sid, "--json").stdout)["model_kv_budgets"]["replies"] == 8
    assert json.loads(kvchat("show", other, "--json").stdout)["model_kv_budgets"]["replies"] == 8


def test_the_models_average_budgets_are_the_mean_of_every_replys_shares(kvchat_home):
    store = Store()
    sid = store.create_session(title="", model_fingerprint="f" * 64, model_path="model.gguf", system_prompt=None)
    for kept, retention in (([10, 40, 20], [0.5, 0.9]), ([30, 20, 20], [0.7, 0.8])):
        store.save_kv_budgets(sid, policy="xkv", budget=0.3, input_slots=100, kept=kept, retention=retention,
                              round_idx=0, fingerprint="f" * 64)
    store.save_kv_budgets(sid, policy="uniform", budget=0.3, input_slots=50, kept=[5, 5, 5], retention=[1.0, 1.0],
                          round_idx=1, fingerprint="f" * 64)
    average = store.model_kv_budgets("f" * 64, "xkv")
    assert average == {"policy": "xkv", "replies": 2, "kept_share": [0.2, 0.3, 0.2], "retention": [0.6, 0.85]}
    assert store.model_kv_budgets("f" * 64, "uniform")["kept_share"] == [0.1, 0.1, 0.1]
    assert store.model_kv_budgets("e" * 64, "xkv") is None
    assert store.kv_budgets(sid)["policy"] == "uniform"  # the chat keeps its latest alone


def test_a_bad_kv_budget_is_one_line_and_sends_nothing(kvchat_home):
    sid = kvchat("new", "--system", SYSTEM).stdout.strip()
    for args, words in ((["--kv-policy", "xkv", "--kv-budget", "0"], "in (0, 1], not 0"),
                        (["--kv-policy", "xkv", "--kv-budget", "1.5"], "in (0, 1], not 1.5"),
                        (["--kv-policy", "full", "--kv-budget", "0.2"], "an option of the xkv policy")):
        proc = kvchat("send", sid, "hi", "--device", "cpu", *args, check=False)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert Store().rounds(sid) == []
    proc = kvchat("--kv-budget", "0.2", "sessions", check=False)
    assert proc.returncode != 0 and "apply to the app only" in proc.stderr
