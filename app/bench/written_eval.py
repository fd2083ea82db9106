"""The differently-written evaluation set of issue 45 (written_eval.json beside this module): fact/question/answer
triples written by hand, by none of the generator's templates, and the told-once chats `kvchat eval --phrasing
written` runs them in.

It lives under app/bench/ (package data of `kvchat.app.bench`) so that training cannot read it: engine/ never imports
app/ (tests/import_contract.py), and nothing chooses between models on it. Every triple is asked once per seed:
the set is shuffled into chats of PER_CHAT facts (no two about one subject), each fact told once and asked
`min_distance`+ rounds later, held-out small talk and out-of-scope prompts between (engine/data/told_once.py). The
replies are scored on exact copy (engine/data/told_once.py: `copies_value`): the answer byte for byte, whatever the
words around it.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from kvchat.engine.data.dialogues import Dialogue
from kvchat.engine.data.told_once import MIN_DISTANCE, PER_CHAT, ToldOnce, group_items, told_once_chats

WRITTEN_SET = Path(__file__).with_name("written_eval.json")
WRITTEN_KINDS = ("random-code", "name", "date", "time", "number-with-unit", "phone-like", "number", "place",
                 "attribute-of-entity", "spelling-variant")
_FIELDS = ("kind", "subject", "fact", "question", "answer", "reply")


@lru_cache(maxsize=1)
def written_triples() -> tuple[dict, ...]:
    """The set's triples as written (dicts of kind, subject, fact, question, answer, reply)."""
    triples = json.loads(WRITTEN_SET.read_text(encoding="utf-8"))["triples"]
    for t in triples:
        if set(t) != set(_FIELDS) or t["kind"] not in WRITTEN_KINDS or t["answer"] not in t["fact"]:
            raise ValueError(f"{WRITTEN_SET.name}: a malformed triple: {t}")
    return tuple(triples)


def written_items() -> list[ToldOnce]:
    """The triples as told-once items: the fact acknowledged the way the generator's facts are ("Noted: your ...")."""
    return [ToldOnce(t["fact"], _acknowledgement(t["reply"]), t["question"], t["reply"], t["answer"], t["kind"],
                     t["subject"]) for t in written_triples()]


def _acknowledgement(reply: str) -> str:
    first = reply.split(" ", 1)[0]
    return "Noted: " + (reply[:1].lower() + reply[1:] if first in ("Your", "You", "The") else reply)  # not a name


def written_chat_count(per_chat: int = PER_CHAT) -> int:
    return len(group_items(written_items(), random.Random(0), per_chat))


def written_chats(seed: int, min_rounds: int, max_rounds: int, min_distance: int = MIN_DISTANCE,
                  chats: int | None = None, per_chat: int = PER_CHAT) -> list[Dialogue]:
    """The whole set (or its first `chats` chats) as told-once chats, shuffled and laid out by `seed`; their
    `phrasing` is "written" (the small talk between is the held-out phrasing's)."""
    rng = random.Random(f"written:{seed}")
    groups = group_items(written_items(), rng, per_chat)
    return told_once_chats(groups[:chats], rng, min_rounds, max_rounds, min_distance, "heldout", label="written")
