"""Chat templates and rounds.

A conversation is a list of rounds (a user message and the assistant's reply; the system prompt, if any, belongs to
the first round). The template stored in the GGUF file is rendered in a sandboxed jinja2 environment. Each round's
tokens are the tokens of the text that round adds to the rendering, so a chat can grow by appending one round's
tokens (and its KV) without touching earlier rounds; `round_spans` returns them. A file without a template is a
base model's: its chats are a plain transcript (TRANSCRIPT_TEMPLATE), its replies cut at the next speaker's line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvchat.engine.text.tokenizer import Tokenizer
from kvchat.errors import KvchatError

# A base model (a file without a chat template) was never trained on turns or their markers: it continues text, and
# given another family's turn markers it wanders (gemma-3-270m repeated the first message with marker debris). It gets
# a plain transcript instead, the kind of text it has seen: the system prompt as a first paragraph, then one line per
# speaker. The generation prompt ends at "Assistant:" (the reply's first word brings its own space); the reply ends
# where the model starts the next speaker's line, a stop string that is cut off the reply (engine.text.reply_text).
TRANSCRIPT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set content = m.content | trim %}"
    "{% if m.role == 'system' %}{{ content }}\n\n"
    "{% elif m.role == 'user' %}User: {{ content }}\n"
    "{% else %}Assistant:{{ ' ' + content if content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TRANSCRIPT_STOP_STRINGS = ("\nUser:", "\nAssistant:")

# Gemma's turn format (its instruction-tuned models' template, minus the system-prompt handling: a system message
# is a turn of its own here), for an instruction-tuned Gemma 3 file that comes without a template: llama.cpp knows
# this format by the <start_of_turn> marker, and <end_of_turn> ends a reply (an end-of-generation token in its vocab).
# Not for a base file such as gemma-3-270m's: it was never trained on these turns.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Templates for instruction-tuned files of an architecture that may come without one.
ARCH_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}
# Words of general.finetune / general.name that mark an instruction-tuned file ("gemma-3-4b-it", "...-Instruct").
_TUNED_WORDS = {"it", "instruct", "chat"}

# How a chat is put to the model: what `kvchat info` and the app say.
FORMAT_TEMPLATE, FORMAT_TURNS, FORMAT_TRANSCRIPT = "template", "turns", "transcript"
FORMAT_WORDS = {
    FORMAT_TEMPLATE: "the file's chat template",
    FORMAT_TURNS: "Gemma's turn format (an instruction-tuned file without a template)",
    FORMAT_TRANSCRIPT: "a plain User:/Assistant: transcript (a base model: the file has no chat template)",
}


def instruction_tuned(metadata: dict) -> bool:
    """Whether the file says it is an instruction-tuned model (general.finetune or general.name)."""
    words = f"{metadata.get('general.finetune', '')} {metadata.get('general.name', '')}".lower()
    return bool(_TUNED_WORDS & set(re.split(r"[^a-z0-9]+", words)))


def chat_template(metadata: dict) -> str | None:
    """The file's template; else, for an instruction-tuned file, its architecture's known one; else None: a base
    model, which gets the plain transcript."""
    own = metadata.get("tokenizer.chat_template")
    if own:
        return own
    return ARCH_TEMPLATES.get(metadata.get("general.architecture")) if instruction_tuned(metadata) else None


def chat_format_kind(metadata: dict) -> str:
    """FORMAT_TEMPLATE, FORMAT_TURNS or FORMAT_TRANSCRIPT (a base model), from the metadata alone."""
    if metadata.get("tokenizer.chat_template"):
        return FORMAT_TEMPLATE
    return FORMAT_TURNS if chat_template(metadata) else FORMAT_TRANSCRIPT


@dataclass
class Round:
    user: str
    assistant: str | None = None  # None while the reply is being generated


@dataclass
class Conversation:
    rounds: list[Round] = field(default_factory=list)
    system: str | None = None

    def messages(self, n_rounds: int | None = None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for r in self.rounds[:n_rounds]:
            msgs.append({"role": "user", "content": r.user})
            if r.assistant is not None:
                msgs.append({"role": "assistant", "content": r.assistant})
        return msgs


class TemplateError(KvchatError):
    pass


def _raise_exception(message: str):
    raise TemplateError(f"chat template refused the conversation: {message}")


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, template: str | None):
        self.tokenizer = tokenizer
        # No template: a base model, put to it as a plain transcript whose replies end at the next speaker's line.
        self.transcript = not template
        self.stop_strings = TRANSCRIPT_STOP_STRINGS if self.transcript else ()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        # No strftime_now: a template that stamps today's date into the prompt would change old rounds' tokens
        # from one day to the next, and their saved KV with them. Templates fall back to a fixed date.
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(template or TRANSCRIPT_TEMPLATE)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not parse: {exc}") from None
        self.bos_text = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id >= 0 else ""
        self.eos_text = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id >= 0 else ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_text,
                eos_token=self.eos_text, tools=None,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template failed: {exc}") from None

    def round_texts(self, conv: Conversation) -> list[str]:
        """The text each round adds to the rendering; an open last round ends with the generation prompt."""
        texts, previous = [], ""
        for i, rnd in enumerate(conv.rounds):
            rendered = self.render(conv.messages(i + 1), add_generation_prompt=rnd.assistant is None)
            if not rendered.startswith(previous):
                raise TemplateError("the model's chat template rewrites earlier rounds when a round is added, "
                                    "so a chat cannot be extended round by round")
            texts.append(rendered[len(previous):])
            previous = rendered
        return texts

    def round_spans(self, conv: Conversation) -> list[list[int]]:
        """Each round's tokens; their concatenation is the tokenization of the whole rendered conversation."""
        return [self._encode(text, first=i == 0) for i, text in enumerate(self.round_texts(conv))]

    def open_round_tokens(self, conv: Conversation, user: str) -> list[int]:
        """Tokens a new round adds after the closed rounds of `conv`: the user's message and the assistant header,
        up to where the reply begins (two renders, however long the chat)."""
        before = self.render(conv.messages(), add_generation_prompt=False) if conv.rounds else ""
        opened = self.render(Conversation(conv.rounds + [Round(user)], conv.system).messages(),
                             add_generation_prompt=True)
        if not opened.startswith(before):
            raise TemplateError("the model's chat template rewrites earlier rounds when a round is added, "
                                "so a chat cannot be extended round by round")
        return self._encode(opened[len(before):], first=not conv.rounds)

    def _encode(self, text: str, first: bool) -> list[int]:
        """The template's own BOS counts: the tokenizer adds one only to a first text that lacks it."""
        add_bos = first and self.tokenizer.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        return self.tokenizer.encode(text, add_bos=add_bos, special=True)

    def conversation_tokens(self, conv: Conversation) -> list[int]:
        """The whole conversation rendered at once and tokenized (what `round_spans` must add up to)."""
        open_ = bool(conv.rounds) and conv.rounds[-1].assistant is None
        text = self.render(conv.messages(), add_generation_prompt=open_)
        return self._encode(text, first=True)
