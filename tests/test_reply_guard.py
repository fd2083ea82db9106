"""The generation guard: a looping reply and one past the model's reply cap are stopped, and the stop is reported."""

from __future__ import annotations

import json

import pytest
from cli_run import kvchat

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.reply_guard import DEMO_REPLY_CAP, DEFAULT_REPLY_CAP, ReplyGuard, repeating_tail


@pytest.mark.parametrize("tokens, period", [
    ([5] * 16, 1),
    ([1, 2, 3] * 6, 3),
    ([9, 8] + [1, 2, 3, 4, 5] * 4, 5),
    (list(range(40)) + list(range(100, 132)) * 4, 32),
])
def test_a_looping_tail_is_found_with_its_period(tokens, period):
    assert repeating_tail(tokens) == period


@pytest.mark.parametrize("tokens", [
    [5] * 15,  # too short a stretch
    [1, 2, 3] * 5,  # 15 tokens
    [1, 2, 3, 4, 5] * 3,  # three repeats only
    list(range(64)),
    [1, 1, 2, 2, 3, 3, 4, 4] * 2,  # words said twice are not a loop
    [1, 2, 3, 4] * 4 + [7],  # it looped, but has moved on
])
def test_no_loop_where_there_is_none(tokens):
    assert repeating_tail(tokens) == 0


def test_the_cap_comes_from_the_model_unless_set():
    assert ReplyGuard().cap_for({"kvchat.reply_cap": 40}) == 40
    assert ReplyGuard().cap_for({}) == DEFAULT_REPLY_CAP
    assert ReplyGuard(reply_cap=7).cap_for({"kvchat.reply_cap": 40}) == 7
    assert ReplyGuard.off().cap_for({"kvchat.reply_cap": 40}) is None
    assert Engine(DEFAULT_MODEL, device="cpu").metadata["kvchat.reply_cap"] == DEMO_REPLY_CAP


def test_a_random_model_s_loop_is_stopped_where_it_starts(models):
    """Random weights drift into cycles of a dozen tokens; a guard that stops at the third repeat stops there."""
    engine = Engine(models.get(), device="cpu")
    guard = ReplyGuard(min_repeats=3)
    for text in ("the", "once upon a time", "hello"):
        prompt = engine.encode_prompt(text)
        free = generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                        max_tokens=300)
        starts = [n for n in range(1, len(free.tokens) + 1) if repeating_tail(free.tokens[:n], min_repeats=3)]
        if starts:
            break
    assert starts, "greedy decoding of random weights should fall into a cycle within 300 tokens"
    guarded = generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                       max_tokens=300, guard=guard)
    assert guarded.stop_reason == "repetition"
    assert guarded.tokens == free.tokens[: starts[0]]


def test_the_cli_reports_the_guard_s_stop_and_can_turn_it_off(models):
    path = str(models.get())
    capped = kvchat("generate", "--model", path, "--max-tokens", "50", "--reply-cap", "3", "--json", "hello")
    out = json.loads(capped.stdout)
    assert out["stop_reason"] == "reply_cap" and len(out["tokens"]) == 3
    shown = kvchat("generate", "--model", path, "--max-tokens", "50", "--reply-cap", "3", "hello")
    assert "stopped at the model's reply cap (reply_cap)" in shown.stderr
    free = json.loads(kvchat("generate", "--model", path, "--max-tokens", "50", "--no-guard", "--json",
                             "hello").stdout)
    assert free["stop_reason"] in ("max_tokens", "eog") and free["stop_reason"] != "repetition"
    bad = kvchat("generate", "--model", path, "--no-guard", "--reply-cap", "3", "hello", check=False)
    assert bad.returncode != 0 and bad.stderr.strip() == "kvchat: error: --reply-cap needs the guard: drop --no-guard"
