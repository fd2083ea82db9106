"""Base models (a GGUF without a chat template) chat as a plain transcript and stop at the next speaker's line; the
reply saved is exactly the reply streamed, for every model family; sliding-window chats shorter than their window
keep their K/V, their context and their restores (issue 42, item 4)."""

from __future__ import annotations

import re

import pytest

import kvchat.engine.generate as generation
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.profile import measure_profile
from kvchat.app.session.service import ChatService
from kvchat.engine.engine import Engine, ModelInfo
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import (FORMAT_TEMPLATE, FORMAT_TRANSCRIPT, FORMAT_TURNS, Conversation, Round,
                                            chat_format_kind)
from kvchat.engine.text.reply_text import ReplyText
from kvchat.storage.db import Store
from kvchat.storage.fingerprint import model_fingerprint

from cli_run import kvchat
from tui_support import make_app, status_text, wait_for, wait_idle

# One small model per family, as the `models` fixture builds them; "base" ones carry no chat template. The gemma3
# ones have a window longer than any chat here (as gemma-3-270m's 512 is longer than a short chat).
FAMILIES = {
    "llama3": dict(style="llama3"),
    "qwen2": dict(arch="qwen2", style="chatml"),
    "qwen3": dict(arch="qwen3", style="chatml"),
    "gemma3": dict(arch="gemma3", style="gemma", n_layers=3, tied=True, sliding_window=256),
    "llama-base": dict(style="none"),
    "gemma3-base": dict(arch="gemma3", style="none", n_layers=3, tied=True, sliding_window=256),
}


@pytest.fixture(scope="module")
def base_profile(models, tmp_path_factory):
    """The gemma3 base model's hardware profile, measured once for this file's chats (seconds each time), with its
    reads made fast and its prefill slow: these tests count each round's stored K/V, which compaction keeps only
    where loading beats recomputing. On a chat of a few dozen tokens that depends on the microseconds the measured
    rates give a round (seen dropping every round's K/V on a loaded two-core machine, and the first round's on CI's),
    not on anything these tests check. At 10 ms a token, loading wins for every round on any machine."""
    import dataclasses

    path = models.get(**FAMILIES["gemma3-base"])
    home = tmp_path_factory.mktemp("base-profile")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVCHAT_HOME", str(home))
        store = Store(home)
        profile = measure_profile(Engine(path, device="cpu"), model_fingerprint(path, store))
        store.close()
    return dataclasses.replace(profile, disk_read_mb_s=1e6, cache_read_mb_s=1e6, decode_mb_s=1e6,
                               segment_overhead_ms=0.0, prefill_a=1e-2, prefill_b=0.0)


def with_profile(profile) -> None:
    """Into this test's $KVCHAT_HOME, as on a machine that has run the model before. The process's own profile of
    the model is forgotten, so the chats read this one: an earlier test's measurement, kept in the process, was
    what CI's chats planned (and compacted) with, not this file's fast reads."""
    import json

    from kvchat.app.session import profile as hardware_profile
    from kvchat.app.session.artifacts import profile_path

    path = profile_path(profile.fingerprint, profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict()))
    with hardware_profile._lock:
        hardware_profile._measured.pop((profile.fingerprint, profile.device), None)


def released(stops: tuple[str, ...], pieces: list[str], strip: bool = False) -> tuple[list[str], ReplyText]:
    text = ReplyText(stops, strip)
    out = [text.feed(p) for p in pieces]
    return out + [text.finish()], text


# ---- the stream filter ----

def test_a_stop_string_over_several_pieces_is_never_shown_and_never_saved():
    out, text = released(("\nUser:",), [" Paris", ".", "\n", "Us", "er", ":", " more"], strip=True)
    assert out == ["Paris", ".", "", "", "", "", "", ""] and text.text == "Paris." and text.stopped


def test_held_text_that_does_not_become_a_stop_is_shown_a_piece_later():
    out, text = released(("\nUser:",), ["A", "\nUs", "ed", " it"])
    assert out == ["A", "", "\nUsed", " it", ""] and text.text == "A\nUsed it" and not text.stopped


def test_stripped_whitespace_shows_only_once_more_text_follows_it():
    out, text = released(("\nUser:",), [" ", " A", "\n\n", "B", " \n", "\n"], strip=True)
    assert out == ["", "A", "", "\n\nB", "", "", ""] and text.text == "A\n\nB"
    _, text = released(("\nUser:",), [" A.", "\n\n", "User:"], strip=True)
    assert text.text == "A." and text.stopped


def test_a_reply_that_opens_with_a_speaker_line_is_empty():
    for pieces in (["\n", "User:", " hi"], [" User", ":"], ["Assistant:", " x"]):
        _, text = released(("\nUser:", "\nAssistant:"), pieces, strip=True)
        assert text.stopped and text.text == "", pieces


def test_without_stops_every_piece_passes_as_it_is():
    out, text = released((), [" a", "\n\n", "b"])
    assert out == [" a", "\n\n", "b", ""] and text.text == " a\n\nb"


# ---- which format a file gets ----

def test_the_chat_format_follows_the_file():
    assert chat_format_kind({"tokenizer.chat_template": "{{ x }}", "general.architecture": "gemma3"}) == FORMAT_TEMPLATE
    # gemma-3-270m's file: no template, no finetune: a base model, whatever Gemma's instruction-tuned turns are
    assert chat_format_kind({"general.architecture": "gemma3", "general.name": "Gemma 3 270m"}) == FORMAT_TRANSCRIPT
    assert chat_format_kind({"general.architecture": "gemma3", "general.finetune": "it"}) == FORMAT_TURNS
    assert chat_format_kind({"general.architecture": "gemma3", "general.name": "Gemma 3 4b It"}) == FORMAT_TURNS
    assert chat_format_kind({"general.architecture": "llama", "general.name": "Llama 3.2 3B Instruct"}) == \
        FORMAT_TRANSCRIPT  # no turn format is known for it: a transcript it can still continue


def test_a_base_model_s_chat_is_a_plain_transcript(models):
    engine = Engine(models.get(**FAMILIES["gemma3-base"]), device="cpu")
    assert engine.chat.transcript and engine.chat_format == FORMAT_TRANSCRIPT
    conv = Conversation([Round(" Hi! ", "Hello."), Round("Where is Paris?")], system="Be brief.")
    text = "".join(engine.chat.round_texts(conv))
    assert text == f"{engine.chat.bos_text}Be brief.\n\nUser: Hi!\nAssistant: Hello.\nUser: Where is Paris?\nAssistant:"
    assert engine.chat.stop_strings == ("\nUser:", "\nAssistant:")


def test_info_says_a_base_model_is_one(models):
    import json

    base = json.loads(kvchat("info", "--model", str(models.get(**FAMILIES["gemma3-base"])), "--json").stdout)
    assert base["chat_format"] == FORMAT_TRANSCRIPT and base["base_model"] is True
    tuned = kvchat("info", "--model", str(models.get(**FAMILIES["gemma3"]))).stdout
    assert re.search(r"chat format +the file's chat template", tuned) and re.search(r"base model +False", tuned)
    assert "base model: the file has no chat template" in kvchat(
        "info", "--model", str(models.get(**FAMILIES["llama-base"]))).stdout
    assert ModelInfo.read(models.get(**FAMILIES["llama3"])).chat_format == FORMAT_TEMPLATE


# ---- what is saved is what streamed ----

def chat_of(store: Store, engine: Engine) -> ChatSession:
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=str(engine.path), system_prompt=None)
    return ChatSession(store, engine, sid)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_saved_reply_is_exactly_the_streamed_one(family, models, kvchat_home):
    engine = Engine(models.get(**FAMILIES[family]), device="cpu")
    store = Store(kvchat_home)
    chat = chat_of(store, engine)
    for i, message in enumerate(["What is the capital of France?", "And of Germany?"]):
        pieces: list[str] = []
        result = chat.send(message, max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=i),
                           on_token=lambda _t, piece: pieces.append(piece))
        assert "".join(pieces) == result.text == store.rounds(chat.sid)[i].assistant_text
    chat.close()


def scripted(monkeypatch, engine: Engine, text: str) -> None:
    """The model 'writes' `text` (then the tokens of '.' forever): a base model that goes on to the next speaker."""
    tokens = engine.tokenizer.encode(text, add_bos=False)
    filler = engine.tokenizer.encode(".", add_bos=False)[0]

    class Scripted:
        def __init__(self, *_args):
            self.left = list(tokens)

        def __call__(self, _logits):
            return self.left.pop(0) if self.left else filler

    monkeypatch.setattr(generation, "Sampler", Scripted)


def test_a_base_model_stops_at_the_next_speaker_line_and_saves_what_it_showed(models, kvchat_home, monkeypatch):
    engine = Engine(models.get(**FAMILIES["gemma3-base"]), device="cpu")
    store = Store(kvchat_home)
    chat = chat_of(store, engine)
    scripted(monkeypatch, engine, " Paris is the capital.\nUser: What is the capital of France?\nAssistant: x")
    pieces: list[str] = []
    result = chat.send("What is the capital of France?", max_tokens=64, on_token=lambda _t, p: pieces.append(p))
    assert result.stop_reason == "stop_string"
    assert pieces and not any("\n" in p for p in pieces)  # not even the start of the speaker line showed
    assert "".join(pieces) == result.text == store.rounds(chat.sid)[0].assistant_text == "Paris is the capital."
    scripted(monkeypatch, engine, " Berlin.\n\nAssistant: Berlin")
    assert chat.send("And of Germany?", max_tokens=64).text == "Berlin."
    chat.close()
    # The rounds' spans are the transcript's tokens: a reopened chat loads every round as it was stored.
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0 and reopened.cache.length == store.rounds(chat.sid)[-1].token_end
    assert engine.chat.conversation_tokens(reopened.conversation()) == \
        sum(engine.chat.round_spans(reopened.conversation()), [])
    reopened.close()


# ---- sliding-window chats shorter than their window ----

def test_a_chat_shorter_than_its_window_keeps_its_k_v_context_and_restores(models, kvchat_home, base_profile):
    path = models.get(**FAMILIES["gemma3-base"])
    with_profile(base_profile)
    service = ChatService(kvchat_home, device="cpu")
    sid = service.create_chat(path)
    contexts, stored = [], []
    for i in range(3):
        service.send(sid, f"Message number {i}.", max_tokens=6, sampling=SamplingParams())
        assert not service.drain()
        stats = service.chat_stats(sid)
        assert stats.context_used == service.store.rounds(sid)[-1].token_end  # the cache kept what it answered
        assert stats.base_model
        contexts.append(stats.context_used)
        stored.append(stats.kv_bytes)
    assert contexts == sorted(set(contexts)) and 0 < stored[0] < stored[1] < stored[2]  # each round's K/V saved
    assert service.store.last_restore(sid) is not None
    service.close()
    shown = kvchat("show", sid).stdout
    assert "last restore:" in shown and "text only" not in shown


async def test_the_status_bar_of_a_base_model_s_chat(models, kvchat_home, base_profile):
    path = models.get(**FAMILIES["gemma3-base"])
    with_profile(base_profile)  # no measuring notice in the way
    app = make_app(model_path=str(path))
    app.preferences.max_tokens = 6
    async with app.run_test(size=(160, 35)) as pilot:
        await wait_for(pilot, lambda: "cpu" in status_text(app), what="the model")
        contexts = []
        for message in ("Hello there.", "How are you?"):
            await pilot.press(*message, "enter")
            await wait_idle(pilot)
            status = status_text(app)
            assert "base model: plain transcript" in status and "KV 0 B" not in status, status
            contexts.append(int(re.search(r"context (\d+)/", status).group(1)))
        assert 0 < contexts[0] < contexts[1]
    app.backend.close()


@pytest.mark.stress
def test_gemma_270m_chats_sensibly(kvchat_home):
    """The real base model (the gemma extra): five messages in one chat, each reply its own sentence, never a
    speaker line or the first message again, saved as streamed, the context growing (minutes on two cores)."""
    import importlib.util

    from kvchat.storage.known_models import KNOWN_MODELS, ensure_assembled

    gemma = KNOWN_MODELS["gemma-3-270m"]
    if importlib.util.find_spec(gemma.chunk_modules[0]) is None:
        pytest.skip("the gemma extra is not installed (./install.sh --dev installs it)")
    service = ChatService(kvchat_home, device="cpu")
    sid = service.create_chat(ensure_assembled(gemma))
    first = "What is the capital of France?"
    contexts = []
    for message in (first, "And what is the capital of Germany?", "Name a river in Paris.",
                    "How many legs does a spider have?", "What colour is the sky on a clear day?"):
        pieces: list[str] = []
        reply = service.send(sid, message, max_tokens=32, sampling=SamplingParams(),
                             on_token=lambda _t, p: pieces.append(p))
        text = reply.round.assistant_text
        assert text and "".join(pieces) == text, (message, text)
        assert "User:" not in text and "Assistant:" not in text and first not in text, (message, text)
        service.drain()
        contexts.append(service.chat_stats(sid).context_used)
    assert contexts == sorted(set(contexts)) and service.store.last_restore(sid) is not None
    service.close()
