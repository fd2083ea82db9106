"""Rounds and their token spans under real template styles (Llama 3, ChatML/Qwen, Mistral) and the fallback."""

from __future__ import annotations

import pytest

from kvchat.engine.text.chat_format import ChatFormat, Conversation, Round, TemplateError
from kvchat.engine.gguf.reader import GGUFFile
from kvchat.engine.text.tokenizer import Tokenizer

CHAT = [
    Round("Hi! My name is Alice.", "Hello Alice, nice to meet you."),
    Round("  I live in Paris, on rue de Rivoli 12.  ", "Noted: Paris, rue de Rivoli 12."),
    Round("Actually, correct that: I moved to Munich.", "Understood, you live in Munich now."),
    Round("Where do I live?", None),
]
STYLES = {"llama3": "llama", "chatml": "qwen2", "mistral": "llama", "none": "llama"}


@pytest.fixture(params=list(STYLES))
def style(request):
    return request.param


@pytest.fixture
def fmt(style, models) -> ChatFormat:
    path = models.get(style=style, arch=STYLES[style])
    return ChatFormat(Tokenizer(path), GGUFFile(path).metadata.get("tokenizer.chat_template"))


@pytest.mark.parametrize("system", [None, "You are a terse assistant."])
@pytest.mark.parametrize("n_rounds", [1, 2, 4])
def test_round_spans_concatenate_to_the_whole_conversation(style, fmt, system, n_rounds):
    conv = Conversation(CHAT[:n_rounds], system=system)
    if style == "mistral" and system:
        # Mistral's template refuses system prompts outright; that must be an error, not a silent drop.
        with pytest.raises(TemplateError):
            fmt.round_spans(conv)
        return
    spans = fmt.round_spans(conv)
    assert len(spans) == n_rounds and all(spans)
    assert sum(spans, []) == fmt.conversation_tokens(conv)


def test_round_text_has_the_messages(fmt):
    texts = fmt.round_texts(Conversation(CHAT))
    assert "Alice" in texts[0] and "Munich" in texts[2] and "Where do I live?" in texts[3]
    assert "Munich" not in texts[0] + texts[1]


def test_open_round_ends_with_generation_prompt(fmt):
    closed = fmt.round_texts(Conversation([Round("Where do I live?", "In Munich.")]))[0]
    open_ = fmt.round_texts(Conversation([Round("Where do I live?", None)]))[0]
    # The reply continues the open round's text: the prompt is a prefix of the closed round.
    assert closed.startswith(open_) and len(closed) > len(open_)


def test_llama3_rounds_start_at_headers(models):
    path = models.get(style="llama3")
    fmt = ChatFormat(Tokenizer(path), GGUFFile(path).metadata["tokenizer.chat_template"])
    spans = fmt.round_spans(Conversation(CHAT[:2]))
    tok = fmt.tokenizer
    assert tok.token_text(spans[0][0]) == "<|begin_of_text|>"
    assert tok.token_text(spans[1][0]) == "<|start_header_id|>"
    assert tok.token_text(spans[0][-1]) == "<|eot_id|>"
    assert spans[0].count(tok.bos_id) == 1  # the template's BOS, not a second one from the tokenizer


def test_stop_tokens_include_template_end_of_turn(models):
    for style, end in (("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>"), ("mistral", "</s>")):
        tok = Tokenizer(models.get(style=style, arch=STYLES[style]))
        assert tok.encode(end, special=True)[0] in tok.eog_ids


def test_template_errors_are_kvchat_errors(models):
    path = models.get(style="mistral")
    fmt = ChatFormat(Tokenizer(path), GGUFFile(path).metadata["tokenizer.chat_template"])
    with pytest.raises(TemplateError, match="alternate|roles"):
        fmt.render([{"role": "assistant", "content": "x"}], add_generation_prompt=False)
    with pytest.raises(TemplateError, match="does not parse"):
        ChatFormat(fmt.tokenizer, "{% for %}")


def test_template_sandbox_blocks_attribute_escapes(models):
    path = models.get(style="llama3")
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatFormat(Tokenizer(path), evil).render([], add_generation_prompt=False)


def test_tokenizer_round_trip(models):
    tok = Tokenizer(models.get(style="chatml", arch="qwen2"))
    text = "Grüße aus München! 12345 — 日本語 and emoji 🎉."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = tok.stream_decoder()
    assert "".join(stream.feed(t) for t in ids) + stream.flush() == text
