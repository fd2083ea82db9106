"""Everyday sentences for training chats' small talk (`TrainConfig.talk`): a small grammar, so that the model meets
thousands of sentences that state nothing to remember rather than the ten of `dialogues._FILLER`.

Why (issue 45, docs/embedded-model.md "The fourth run"): trained on ten fixed small-talk sentences, the model skips
those ten and nothing else. On the held-out chats, whose small talk it never saw, the shipped model answers a
question with small talk around it almost never (2% of such questions), and a model trained to copy random strings
copies the small talk's words as values ("The roads is called turned."). Small talk drawn from a grammar teaches the
difference between a sentence that tells something and one that does not, whatever its words.

What keeps it from leaking into what measures the model (tests/test_small_talk.py): no word of the value pools,
the named things' nouns, the relations, weekdays or months; no frame that tells a fact ("called", "name", "live",
"born", "favorite", "love", "remember"); and no four words in a row in common with the held-out or dev small talk
and templates, or with the hand-written evaluation set — checked over every sentence the grammar can make
(`four_word_sequences`), not over a sample.
"""

from __future__ import annotations

import random

SUBJECTS = ("I", "we", "the two of us", "a few of us", "half the office", "everyone at the gym", "the kids",
            "my roommate and I", "our whole floor")
ACTIONS = ("cleaned the windows", "repainted the gate", "cooked a huge pot of soup", "watched an old film",
           "read half a paperback", "sorted the recycling", "fixed a wobbly chair", "washed the curtains",
           "planted some herbs", "assembled a bookcase", "carried boxes up the stairs", "tidied the cupboards",
           "walked for an hour", "queued for ages", "played cards", "swept the steps", "ironed a pile of shirts",
           "rearranged the furniture", "defrosted the freezer", "hung a few pictures", "mended a torn jacket",
           "baked muffins for the staff room", "jogged around the block", "tried a dance workout",
           "sang far too loudly", "wrapped some presents", "raked the leaves", "filled in a long form",
           "changed a flat tyre",
           "unpacked the shopping", "waited for a delivery", "listened to the radio", "wrote some postcards",
           "dusted every shelf", "argued about the thermostat", "lost track of time")
PLACES = ("in the kitchen", "at the market", "on the balcony", "downtown", "at the community hall",
          "in the backyard", "at the office", "by the canal", "in the attic", "at the station", "on the terrace",
          "in the hallway", "at the leisure centre", "near the fountain square", "in the shed")
TIMES = ("this morning", "last night", "after lunch", "over the weekend", "earlier today", "before dinner",
         "yesterday evening", "around noon", "at dawn", "late in the afternoon", "on the way home")
REACTIONS = ("it took longer than expected", "it was more fun than it sounds", "now I could use a nap",
             "nobody complained for once", "it felt good to get it done", "my back feels a bit sore now",
             "the time flew by", "I was exhausted afterwards", "it was oddly relaxing", "we laughed a lot")
WEATHER = ("It was windy", "The sky stayed cloudy", "It was warm and bright", "It drizzled on and off",
           "It was freezing", "The air was muggy", "There was a thick fog", "The wind finally dropped")

# Each form's parts, in order: a tuple of phrases, or a literal joining word(s).
FORMS = (
    (TIMES, ",", SUBJECTS, ACTIONS, PLACES, "."),
    (SUBJECTS, ACTIONS, TIMES, "; honestly,", REACTIONS, "."),
    (WEATHER, ", so", SUBJECTS, ACTIONS, PLACES, TIMES, "."),
    (SUBJECTS, ACTIONS, PLACES, TIMES, "."),
)


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def everyday_sentence(rng: random.Random) -> str:
    """One sentence of small talk: a form, then a phrase for each of its parts."""
    form = rng.choice(FORMS)
    words = []
    for part in form:
        words.append(part if isinstance(part, str) else rng.choice(part))
    text = " ".join(words).replace(" ,", ",").replace(" ;", ";").replace(" .", ".")
    return _capitalized(text)


def _words(phrase: str) -> tuple[str, ...]:
    """Lower-cased words, punctuation stripped (the rule tests/test_dialogues.py compares sentences by)."""
    return tuple(w for w in (w.strip(".,?!:;()-") for w in phrase.lower().split()) if w)


def vocabulary() -> frozenset[str]:
    """Every word the grammar can write."""
    parts = [p for form in FORMS for p in form]
    return frozenset(w for part in parts for phrase in ((part,) if isinstance(part, str) else part)
                     for w in _words(phrase))


def four_word_sequences() -> set[tuple[str, ...]]:
    """Every four words in a row of every sentence the grammar can make (words as `_words` gives them): each form
    read part by part, keeping the distinct last three words so far, and every four words that end in a part's
    phrase collected (a part may add no word, as a comma does)."""
    found: set[tuple[str, ...]] = set()
    for form in FORMS:
        tails: set[tuple[str, ...]] = {()}
        for part in form:
            phrases = {_words(part)} if isinstance(part, str) else {_words(p) for p in part}
            next_tails = set()
            for tail in tails:
                for phrase in phrases:
                    words = tail + phrase
                    found.update(words[i : i + 4] for i in range(max(len(tail) - 3, 0), len(words) - 3))
                    next_tails.add(words[-3:])
            tails = next_tails
    return found
