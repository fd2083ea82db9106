"""The shipped model: small, the default of every command, remembers, and runs the same in our engine and llama.cpp."""

from __future__ import annotations

import json

import pytest
from cli_run import kvchat

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.engine.engine import Engine, ModelInfo
from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.app.bench.parity import ours_greedy, reference_greedy
from kvchat.engine.policies import make_policy
from kvchat.engine.reply_guard import ReplyGuard


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def test_shipped_model_is_a_small_llama_with_gqa():
    assert DEFAULT_MODEL.stat().st_size <= 30 * 2**20
    cfg = ModelInfo.read(DEFAULT_MODEL).config
    assert cfg.arch == "llama" and cfg.n_layers >= 8 and cfg.n_kv_heads < cfg.n_heads


def test_every_command_defaults_to_it():
    proc = kvchat("info", "--json", check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["name"] == "kvchat-memory-demo"


def test_it_remembers_across_rounds(engine):
    """In the phrasings it was trained on (held-out values), as the app answers: 16 of 17, pinned (2026-11-26, CPU;
    tests/test_recall_pinned.py pins held-out phrasings under each chat policy)."""
    result = evaluate(engine, make_policy("full"), heldout_chats(2, 7, 24, 28), mode="app")
    assert (result.overall.questions, result.overall.correct) == (17, 16), result.failures[:3]


def test_same_greedy_answers_as_llama_cpp(engine):
    chat = heldout_chats(1, 3, 20, 20)[0]
    for q in chat.questions[:3]:
        rounds = chat.rounds[: q.round_index] + [Round(chat.rounds[q.round_index].user)]
        prompt = sum(engine.chat.round_spans(Conversation(rounds, chat.system)), [])
        ours = ours_greedy(engine, prompt, 40)
        end = next((i + 1 for i, t in enumerate(ours) if t in engine.tokenizer.eog_ids), len(ours))
        assert ours[:end] == reference_greedy(DEFAULT_MODEL, prompt, end)


def test_it_answers_what_a_new_user_types(engine):
    """The issue's example, as a new user typed it, and a question about something never told."""
    from kvchat.engine.data.dialogues import DEMO_REPLY, UNKNOWN_REPLY
    from kvchat.engine.generate import generate, prefill

    conv, cache, replies = Conversation([], None), engine.new_cache(512), []
    for message in ("Remember that the boat is called Wavelet.", "What is the boat called?",
                    "What is my sister's name?", "Write me a poem about cats"):
        start = cache.length
        out = generate(engine.model, cache, engine.chat.open_round_tokens(conv, message), max_tokens=60,
                       decoder=engine.tokenizer.stream_decoder(), stop_tokens=engine.tokenizer.eog_ids,
                       stop_strings=engine.chat.stop_strings, **engine.guarding(ReplyGuard()))
        replies.append(out.text)
        conv.rounds.append(Round(message, out.text))
        cache.truncate(start)
        prefill(engine.model, cache, engine.chat.round_spans(conv)[-1])
    assert replies == ["Noted: the boat is called Wavelet.", "The boat is called Wavelet.", UNKNOWN_REPLY,
                       DEMO_REPLY]
