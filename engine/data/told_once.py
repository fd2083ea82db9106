"""Told-once chats: each fact is told once and asked about once, at least `min_distance` rounds later, with held-out
small talk and out-of-scope prompts between; what `kvchat eval` measures exact copying on (issue 45).

Two sources of facts:

- **random values** (`random_value_chats`): the generator's held-out (or dev, or trained) phrasings, with values
  that are random strings (letters, digits, mixed case, 2-16 characters, sometimes several words), so that nothing
  but copying from the chat answers; the first target of issue 45 (>= 95% copied exactly, asked >= 20 rounds later).
- **written sets** (app/bench/written_eval.py): fact/question/answer triples written by hand, outside the generator,
  laid out by `told_once_chats` the same way.

The rounds between never tell anything (held-out small talk, greetings, thanks, requests: no question about
something never told, whose fixed reply could be wrong here) and never mention a value of the chat, so the only
facts of a chat are the ones it asks about and each value is in one user message; two facts about one subject
(`ToldOnce.subject`), or one whose value is in the other's sentences, never share a chat. Everything is
deterministic from the random generator passed in. The exact-copy metric (`copies_value`) lives here too, since
the chats keep to it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

from kvchat.engine.data import dialogues as d
from kvchat.engine.data.dialogues import SYSTEM_PROMPT, Dialogue, Question, Slot, pools
from kvchat.engine.text.chat_format import Round

# Facts per chat: 8 facts and 8 questions among the 44-52 rounds `kvchat eval` draws by default, so a set of 320
# fills 40 chats.
PER_CHAT = 8
MIN_DISTANCE = 20
RANDOM_VALUE_STYLES = ("lower", "capitalised", "upper", "digits", "mixed")
_STYLE_WEIGHTS = (15, 15, 10, 10, 50)
_ALPHABETS = {"lower": "abcdefghijklmnopqrstuvwxyz", "upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
              "digits": "0123456789"}
_ALPHABETS["mixed"] = _ALPHABETS["lower"] + _ALPHABETS["upper"] + _ALPHABETS["digits"]


@dataclass(frozen=True)
class ToldOnce:
    """One fact of a told-once chat: the message that tells it, the question about it, and the value the reply must
    copy byte for byte."""

    fact: str
    fact_reply: str  # the expected acknowledgement
    question: str
    reply: str  # the expected reply to the question; holds `value`
    value: str
    kind: str  # what kind of value it is, reported apart (a written set's `kind`; a random value's style)
    subject: str  # what the fact is about: two facts about one subject could contradict each other in one chat
    stated: str = "written"  # how it was told: a family of STATED_FAMILIES, or "written"
    asked: str = "written"  # how it is asked: a family of ASKED_FAMILIES, or "written"


@dataclass
class ToldOnceQuestion(Question):
    """A question of a told-once chat: its value's kind is the item's, not a slot's (a written fact has no slot)."""

    value_kind: str = ""

    @property
    def values_seen_in_training(self) -> bool:
        return False  # random strings and written values are no pool's


def copies_value(text: str, value: str) -> bool:
    """Whether `value` is in `text` byte for byte and whole: not the start or end of a longer word or number
    ("Bq9" is not copied by "Bq9x", "417" not by "4170" or "2.417", "7" not by "7.5"); the words around it are
    free. The exact-copy metric of `kvchat eval`, and how a chat keeps a value to the one round that tells it."""
    return bool(value) and value in text and _value_pattern(value).search(text) is not None


@lru_cache(maxsize=None)
def _value_pattern(value: str) -> re.Pattern:
    before = r"(?<![^\W_])(?<!\d[.,:])" if value[:1].isalnum() else ""
    after = r"(?![^\W_])(?![.,:]\d)" if value[-1:].isalnum() else ""
    return re.compile(before + re.escape(value) + after)


def _clash(a: ToldOnce, b: ToldOnce) -> bool:
    """Two facts that cannot share a chat: about one subject, or one's value in the other's sentences."""
    return a.subject == b.subject or any(copies_value(text, x.value) for x, y in ((a, b), (b, a))
                                         for text in (y.fact, y.question))


def group_items(items: list[ToldOnce], rng: random.Random, per_chat: int = PER_CHAT) -> list[list[ToldOnce]]:
    """`items` shuffled into as few chats of at most `per_chat` as hold them all, none with two facts that clash
    (about one subject, or one's value in the other's sentences); chats differ in size by at most one where the
    clashes allow it."""
    order = list(items)
    rng.shuffle(order)
    groups: list[list[ToldOnce]] = [[] for _ in range(-(-len(order) // per_chat))]
    for item in order:
        free = [g for g in groups if len(g) < per_chat and not any(_clash(item, i) for i in g)]
        if not free:  # (it clashes with a fact of every chat)
            groups.append([])
            free = [groups[-1]]
        min(free, key=len).append(item)
    return groups


def layout(rng: random.Random, n_rounds: int, count: int, min_distance: int) -> list[tuple[int, int]]:
    """(fact round, question round) for `count` facts in a chat of `n_rounds`: every question at least
    `min_distance` rounds after its fact, no two on one round. The facts fall in the first n_rounds - min_distance
    rounds, the questions in the last n_rounds - min_distance; the i-th fact told is the i-th asked."""
    if count and (n_rounds < min_distance + count or n_rounds < 2 * count):
        raise ValueError(f"a chat of {n_rounds} rounds cannot ask {count} facts each {min_distance}+ rounds after "
                         f"it is told")
    for _ in range(10_000):
        facts = sorted(rng.sample(range(n_rounds - min_distance), count))
        asks = sorted(rng.sample([r for r in range(min_distance, n_rounds) if r not in facts], count))
        if all(a - f >= min_distance for f, a in zip(facts, asks)):
            return list(zip(facts, asks))
    # (chats barely long enough): the earliest facts, the latest questions
    return list(zip(range(count), range(n_rounds - count, n_rounds)))


def told_once_chats(groups: list[list[ToldOnce]], rng: random.Random, min_rounds: int, max_rounds: int,
                    min_distance: int = MIN_DISTANCE, phrasing: str = "heldout",
                    label: str | None = None) -> list[Dialogue]:
    """One chat per group: each item's fact told once, its question asked `min_distance`+ rounds later, the other
    rounds `phrasing`'s small talk and out-of-scope prompts (greetings, thanks, requests). `label` is the chats'
    `phrasing` as the evaluation reports it (default: `phrasing`). `known_before` is keyed "told:<subject>" (no
    slot: `Dialogue.recall_rounds` does not apply)."""
    chats = []
    for group in groups:
        n_rounds = rng.randint(min_rounds, max_rounds)
        with_system = rng.random() < 0.8
        dlg = Dialogue(SYSTEM_PROMPT if with_system else None, label or phrasing)
        writer = d._Writer(rng, pools("heldout"), phrasing, dlg, never_told=0)
        told, asked = {}, {}
        for item, (fact_at, ask_at) in zip(group, layout(rng, n_rounds, len(group), min_distance)):
            told[fact_at], asked[ask_at] = item, (item, fact_at)
        values = [item.value for item in group]
        known: dict[str, str] = {}
        for i in range(n_rounds):
            dlg.known_before.append(dict(known))
            if i in told:
                item = told[i]
                dlg.rounds.append(Round(item.fact, item.fact_reply))
                known[f"told:{item.subject}"] = item.value
            elif i in asked:
                item, fact_at = asked[i]
                dlg.questions.append(ToldOnceQuestion(i, "single", "alone", i - fact_at, (f"told:{item.subject}",),
                                                      (item.value,), item.stated, item.asked, value_kind=item.kind))
                dlg.rounds.append(Round(item.question, item.reply))
            else:
                dlg.rounds.append(_filler_round(writer, rng, i, values))
        dlg.known_before.append(dict(known))
        chats.append(dlg)
    return chats


def _filler_round(writer: d._Writer, rng: random.Random, i: int, values: list[str]) -> Round:
    """Small talk or an out-of-scope prompt that mentions none of the chat's values ("Calculate 12 plus 40" beside
    a table number 12 would tell it twice)."""
    for _ in range(1000):
        kept = len(writer.dlg.out_of_scope)
        rnd = writer.chatter() if rng.random() < 0.5 else writer.out_of_scope(i)
        if not any(copies_value(rnd.user, v) for v in values):
            return rnd
        del writer.dlg.out_of_scope[kept:]  # drawn again
    raise ValueError(f"every small talk and prompt mentions one of {values}")


# -- random values --

@lru_cache(maxsize=1)
def _chat_words() -> frozenset[str]:
    """Every word the generator's sentences, small talk and replies use: a random value is never one of them, so it
    is found in a chat only where it was told."""
    texts = [*d._FILLER, *d._FILLER_HELDOUT, *d.POLITE_REPLIES, d.LIST_ACK, *d._TOPICS, *d._TOPICS_HELDOUT,
             *d._TOPICS_DEV, *d._NOUNS_TRAIN, *d._NOUNS_HELDOUT, *d._NOUNS_DEV, *d._RELATIONS, *d._SPARE_WORDS]
    # (not the copy mix's own wrappers: no told-once chat uses them, and the eval's values stay the ones measured)
    groups = [v for v in vars(d).values() if isinstance(v, d.Templates) and all(v is not w for w in d.COPY_WRAPPERS)]
    for slot in [*d.SLOTS, d.called_slot("my", "boat")]:
        groups += [slot.states, slot.asks, slot.recalls]
        texts.append(slot.answer)
    for g in groups:
        texts += [*g.train, *g.heldout, *g.dev, *g.more]
    return frozenset(w.strip(".,?!:;()-'\"").lower() for t in texts for w in t.replace("{", " ").split())


def random_value(rng: random.Random) -> tuple[str, str]:
    """(value, style): a random string of 2-16 characters (spaces included), drawn as one of RANDOM_VALUE_STYLES
    (lower-case letters, a capitalised word, capitals, digits, or letters of both cases and digits mixed); one in
    four is two or three words of 2+ characters (style "several words"). The style reported is what the value
    turned out to be. No word of it is a word of the generator's sentences."""
    style = rng.choices(RANDOM_VALUE_STYLES, weights=_STYLE_WEIGHTS)[0]
    while True:
        length = rng.randint(2, 16)
        n_words = rng.choice((2, 2, 3)) if rng.random() < 0.25 else 1
        n_words = max(1, min(n_words, (length + 1) // 3))  # words of 2+ characters and the spaces between
        letters = length - (n_words - 1)
        cuts = sorted(rng.sample(range(2, letters - 1), n_words - 1)) if n_words > 1 else []
        while any(b - a < 2 for a, b in zip([0, *cuts], [*cuts, letters])):
            cuts = sorted(rng.sample(range(2, letters - 1), n_words - 1))
        words = []
        for a, b in zip([0, *cuts], [*cuts, letters]):
            if style == "capitalised":
                word = rng.choice(_ALPHABETS["upper"]) + "".join(rng.choices(_ALPHABETS["lower"], k=b - a - 1))
            else:
                word = "".join(rng.choices(_ALPHABETS[style], k=b - a))
            words.append(word)
        if not any(w.lower() in _chat_words() for w in words):
            return " ".join(words), "several words" if n_words > 1 else _style_of(words[0])


def _style_of(word: str) -> str:
    """What a word turned out to be: a short "mixed" draw may hold letters of one case only."""
    if word.isdigit():
        return "digits"
    if word.isalpha():
        return "lower" if word.islower() else "upper" if word.isupper() else \
            "capitalised" if word[0].isupper() and word[1:].islower() else "mixed"
    return "mixed"


def _random_value_slots() -> list[Slot]:
    """The slots a random value can fill: any but birthdays and meeting days, whose templates ask for a date or a
    weekday."""
    return [s for s in d.SLOTS if s.field not in d.SHARED_VALUE_FIELDS]


def random_value_item(writer: d._Writer, taken: set[str]) -> ToldOnce:
    """A fact with a random value, stated and asked in the writer's phrasing (the generator's templates, openers
    and closers, and its question families: plain, "what did I say", no question mark, lower case, a typo); its
    subject (a slot, or a named thing's noun) is not in `taken`."""
    rng = writer.rng
    while True:
        if rng.random() < 0.35:
            noun = writer.noun()
            slot, subject = d.called_slot(rng.choice(("my", "my", "our", "the")), noun), f"called:{noun}"
        else:
            slot = rng.choice(_random_value_slots())
            subject = slot.key
        if subject not in taken:
            break
    value, style = random_value(rng)
    template = writer.pick(slot.states)
    while template.startswith("{v}"):  # a capital at the start of the message would alter the value
        template = writer.pick(slot.states)
    if rng.random() < 0.15:
        template = template.lower()
    clause = template.replace("{v}", value)
    if rng.random() < 0.4:
        text, stated = writer.pick(d._REMEMBER).format(c=clause), "remember"
    else:
        text, stated = d._cap(clause) + ".", "plain"
    text = d._cap(writer.dressed(text, d._OPENERS, d._CLOSERS))
    asked = writer.asked_family()
    return ToldOnce(text, slot.ack(value), writer.question_text(slot, asked), slot.reply(value), value, style,
                    subject, "called" if subject.startswith("called:") else stated, asked)


def random_value_chats(count: int, seed: int, min_rounds: int, max_rounds: int, min_distance: int = MIN_DISTANCE,
                       phrasing: str = "heldout", per_chat: int = PER_CHAT) -> list[Dialogue]:
    """`count` told-once chats of `per_chat` facts with random values (random_value), stated and asked in
    `phrasing`'s templates, each asked `min_distance`+ rounds after it is told."""
    if phrasing not in d.PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r} (accepted: {', '.join(d.PHRASINGS)})")
    rng = random.Random(f"random-values:{phrasing}:{seed}")
    writer = d._Writer(rng, pools("heldout"), phrasing, Dialogue(None, phrasing))
    groups = []
    for _ in range(count):
        group: list[ToldOnce] = []
        while len(group) < per_chat:
            item = random_value_item(writer, {i.subject for i in group})
            if not any(item.value.lower() in i.value.lower() or i.value.lower() in item.value.lower()
                       for i in group):  # one value inside another would be told twice
                group.append(item)
        groups.append(group)
    return told_once_chats(groups, rng, min_rounds, max_rounds, min_distance, phrasing)
