"""Facts about anything (issue 45): the subject of a fact drawn from a wide vocabulary of everyday things, or made
up, rather than from the generator's fixed slots, so that a model learns to find a fact by the words of its subject
— whatever the subject is — and copy its value, not to know a list of subjects ("my cat", "the wifi password").

A subject is one to three words: a head noun ("tally", "quota", "label"), most often after one or two modifiers
("kennel tally", "pension savings quota"), a quarter of the time with a made-up word in it. Training chats tell
such facts and ask about them (engine.data.dialogues `_Writer.open_fact`, `subjects=SHARE`), and ask about subjects
never told, so that a subject must match, not merely be a subject. The templates here are training ones only: held-
out and dev chats never tell an open fact, so the held-out phrasings stay unseen (tests/test_open_facts.py checks
that no template here shares four words in a row with a held-out or dev template of the generator's).

The vocabulary is general (things people keep numbers, codes and dates for); it leaves out every noun the generator
keeps for held-out and dev chats, every held-out value word, and every word of the hand-written set, whose facts
must stay about subjects training never named (the set measures how a model does on sentences and things it has
not seen: issue 45).
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Head nouns: what a value is. The vocabulary shares no word with the hand-written set (app/bench/written_eval.json,
# checked by tests/test_open_facts.py), so the set measures facts about subjects no training chat named.
HEADS = tuple("""price total balance plan route receipt version frequency channel stop target budget setting label
zipcode passcode login title brand shade cabin berth pitch box shelf folder branch quota allowance ration stamp token
badge rating grade mark tally quantity amount figure digit ratio percentage index ranking bunk stall tray crate jar
tin tube bottle flask canister cartridge pad sheet chart map sketch draft memo entry batch lot bundle kit series
edition issue volume chapter verse track tune motto slogan""".split())

# Modifiers: what the value belongs to.
MODIFIERS = tuple("""loyalty employee invoice policy voicemail server streaming tablet mailbox warehouse client
tenant tennis golf cycling quiz film song podcast console cloud kitchen freezer heating meter gas pension savings
bonus package luggage backpack umbrella helmet jacket watch glasses lens prescription allergy blood
harbour marina orchard kennel aviary aquarium pond fountain butcher grocery florist tailor cobbler barber salon
sauna arcade skating hockey rugby cricket baseball darts snooker badminton archery fencing rowing surfing diving
skiing camping picnic carnival parade opera ballet exhibition auction market volunteer scout brownie cadet militia
committee union guild lodge society parish temple mosque synagogue monastery convent seminary academy college campus
dormitory canteen cafeteria buffet pantry cellar attic loft porch balcony terrace patio lawn hedge fence shutter
chimney gutter drain valve pump sprinkler mower trimmer drill hammer ladder scaffold crane forklift trolley
wheelbarrow""".split())

# How a training chat tells an open fact: {d} the determiner and subject ("my kennel tally"), {v} the value.
STATES = ("{d} is {v}", "{d}: {v}", "{d} is now {v}", "{d} has been set to {v}", "{d} will be {v}",
          "{d} was changed to {v}", "{d} ends up being {v}", "{v} is {d}", "I wrote down {d} as {v}",
          "they gave me {v} as {d}", "for {d} I use {v}", "{d} reads {v}", "{d} came out as {v}",
          "the one for {d} is {v}")
# How it asks ({d} as above), and its answer ({A} the answer's determiner and subject).
ASKS = ("What is {d}?", "What's {d}?", "What was {d} again?", "Do you remember {d}?", "Tell me {d}.",
        "Could you look up {d} for me?", "What value has {d}?", "Which is {d}?", "I need {d}, what is it?",
        "Remind me what {d} is.", "Got {d} handy?")
# How it asks what the user said (the "what did I say" family)
RECALLS = ("What did I note as {d}?", "What had I written down as {d}?", "Which {s} did I give you?")
ANSWER = "{A} is {v}."
DETERMINERS = ("my", "my", "our", "the")


def subject(rng: random.Random, made_up: Callable[[random.Random], str], avoid: frozenset[str]) -> str:
    """One to three words naming a thing: [modifier [modifier]] head, a quarter of the time with a made-up word
    (`made_up`, the generator's pseudo_word) for one of them; no word of `avoid` (held-out nouns and values)."""
    while True:
        n_modifiers = rng.choices((0, 1, 2), weights=(25, 55, 20))[0]
        words = [*rng.sample(MODIFIERS, n_modifiers), rng.choice(HEADS)]
        if rng.random() < 0.25:
            words[rng.randrange(len(words))] = made_up(rng)
        if len(set(words)) == len(words) and not any(w in avoid for w in words):
            return " ".join(words)


def answer_determiner(det: str) -> str:
    return {"my": "Your", "our": "Your"}.get(det, det.capitalize())
