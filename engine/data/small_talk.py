"""Everyday sentences for training chats' small talk (`TrainConfig.talk`): a small grammar, so that the model meets
thousands of sentences that state nothing to remember rather than the ten of `dialogues._FILLER`; and everyday
requests (`TrainConfig.requests`, `everyday_request`), so that it meets thousands of things it cannot do rather than
the twenty-odd request templates of `dialogues._REQUESTS`.

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

Why the requests (issue 45, docs/embedded-model.md "The sixth run"): a model trained on the copy mix learned that any
sentence with a number or an unknown word in it tells a value, and took held-out requests for facts: "Calculate 41
plus 59." got "Noted: your locker number is 59.", "Could you describe earthquakes in detail?" got "Noted: you love
detail." (86% of held-out requests answered politely, against the shipped model's 93%). The request grammar's words
keep the same rules as the small talk's, but "is" (a request may ask "what is ..."), and its numbers and topics are
the training's own (`{a}`, `{b}`: numbers; `{t}`: a training topic).
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


# Requests: asked (a modal, then "?") or told (an imperative, then "." or "!"); each form's task a phrase of its own.
ASKED = ("could you", "can you", "would you", "will you", "any chance you could", "do you think you could",
         "would you be able to")
TOLD = ("please", "go ahead and", "I'd like you to", "I need you to", "quick favour:", "next,", "right, now",
        "hey, could you just", "for me, please")
WRITINGS = ("a limerick", "a sonnet", "a rap verse", "a bedtime tale", "an essay", "a speech", "a product review",
            "a tweet", "a news report", "a riddle", "a quiz", "a paragraph", "some lyrics", "an article",
            "a slogan", "a diary entry", "a cover letter", "a travel guide", "a menu", "a recipe")
WRITE = ("write", "draft", "put together", "come up with", "knock out", "produce")
TEACH = ("walk me through", "break down", "give me an overview of", "outline", "summarise", "go over",
         "teach me the basics of", "give me a rundown of", "clarify", "lay out the history of",
         "compare {t} with", "list three myths about", "quiz me on", "give me five questions on")
SUMS = ("add {a} and {b}", "add {a} to {b}", "subtract {b} from {a}", "take {b} away from {a}", "divide {a} by {b}",
        "work out {a} squared", "find {a} percent of {b}", "convert {a} miles into kilometres",
        "convert {a} kilos into pounds", "round {a}.{b} to the nearest whole number", "total up {a}, {b} and 7",
        "double {a}", "halve {b}", "say what {a} plus {b} makes", "check whether {a} divides {b}",
        "find the average of {a} and {b}", "share {a} euros between {b} people", "count from {a} to {b}")
TASKS = ("book a table for {a} people", "set a timer for {a} minutes", "order a takeaway", "check tomorrow's forecast",
         "find me a cheap flight", "play some music", "turn on the lights", "send a text to everyone",
         "make a shopping list", "suggest a film for tonight", "plan a workout", "sort these files",
         "tidy up this paragraph", "rewrite this in plain english", "proofread this essay",
         "translate this into german", "convert this recipe for {a} servings", "give me directions to the airport",
         "pick a place to eat nearby",
         "schedule a call at {a} past {b}", "write a script that renames files", "debug this function",
         "turn this loop into a list comprehension", "give me a regex for email addresses",
         "make a chart of these figures", "generate a strong password", "find a word that rhymes with chimney")
TOPIC_WORK = ("about", "on the subject of", "explaining", "inspired by")
REQUEST_FORMS = (
    (ASKED, WRITE, WRITINGS, TOPIC_WORK, "{t}", "?"),
    (TOLD, WRITE, WRITINGS, TOPIC_WORK, "{t}", "."),
    (ASKED, TEACH, "{t}", "?"),
    (TOLD, TEACH, "{t}", "."),
    (ASKED, SUMS, "?"),
    (TOLD, SUMS, "."),
    (SUMS, ", please."),
    (ASKED, TASKS, "?"),
    (TOLD, TASKS, "!"),
    (TASKS, ", please."),
)


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def _written(form: tuple, rng: random.Random) -> str:
    words = []
    for part in form:
        words.append(part if isinstance(part, str) else rng.choice(part))
    text = " ".join(words)
    for mark in ",;.?!":  # a literal part that is punctuation joins the word before it
        text = text.replace(" " + mark, mark)
    return _capitalized(text)


def everyday_sentence(rng: random.Random) -> str:
    """One sentence of small talk: a form, then a phrase for each of its parts."""
    return _written(rng.choice(FORMS), rng)


def everyday_request(rng: random.Random, topics: list[str]) -> str:
    """One request the demo model cannot do (a polite reply's prompt): a form, a phrase for each of its parts, then
    its numbers (2-99) and a topic of `topics` (the training's)."""
    text = _written(rng.choice(REQUEST_FORMS), rng)
    return text.format(t=rng.choice(topics), a=rng.randint(2, 99), b=rng.randint(2, 99))


def _words(phrase: str) -> tuple[str, ...]:
    """Lower-cased words, punctuation stripped (the rule tests/test_dialogues.py compares sentences by)."""
    return tuple(w for w in (w.strip(".,?!:;()-") for w in phrase.lower().split()) if w)


def vocabulary(forms: tuple = FORMS) -> frozenset[str]:
    """Every word the grammar can write (of the small talk, or of `REQUEST_FORMS`)."""
    parts = [p for form in forms for p in form]
    return frozenset(w for part in parts for phrase in ((part,) if isinstance(part, str) else part)
                     for w in _words(phrase))


def four_word_sequences(forms: tuple = FORMS) -> set[tuple[str, ...]]:
    """Every four words in a row of every sentence the grammar can make (words as `_words` gives them): each form
    read part by part, keeping the distinct last three words so far, and every four words that end in a part's
    phrase collected (a part may add no word, as a comma does)."""
    found: set[tuple[str, ...]] = set()
    for form in forms:
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
