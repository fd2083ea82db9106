"""Memory dialogues: multi-round chats where the user states facts (some later corrected) between other rounds and
later asks questions whose answers need one or several earlier rounds.

They train the embedded model (engine.train) and score every KV policy on the same held-out chats (`kvchat eval`).
Everything is deterministic from a seed. What is split between training and held-out chats, and what is not:

- values (`split=`): training chats use made-up words for names, cities, colors, foods and animals, held-out chats
  real ones training never shows; numbers (locker numbers) come from disjoint residue classes mod 7; so a held-out
  answer can only come from reading the chat. Birthdays (a month and a day of 1-28) and meeting days (a weekday)
  are NOT split: both splits draw them from the same lists (SHARED_VALUE_FIELDS), and a question about one says so
  (`Question.values_seen_in_training`), so that the evaluation reports it apart.
- phrasings (`phrasing=`): every way of stating, correcting or asking something, the words around it (openers,
  closers, lists) and every out-of-scope prompt is a template drawn from one of disjoint sets of its group
  (`Templates`): `train` (and `more`, for `wide` training only) is what the model is trained on, `dev` chooses
  between training runs, `heldout` measures the model that ships. No held-out template shares four words in a
  row (lower case, punctuation stripped, the thing told or asked masked) with a trained (`train` or `more`) or dev
  one of its group, and no `more` one with a held-out or dev one (`tests/test_dialogues.py` checks both; a few dev
  templates do share four words with `train` ones), so held-out phrasings test whether the model understood what
  people write, not whether it memorised our sentences. Held-out chats also have their own small talk
  (`_FILLER_HELDOUT`) and their own join of two questions (`_TWO_QUESTIONS_HELDOUT`), neither sharing four words in
  a row with the trained ones; trained and dev chats share the trained small talk and join. Named things
  (`_NOUNS_*`) and request topics (`_TOPICS*`) are split by phrasing too.

Users write the way people do: "remember that ...", "X is called Y", several facts in one message, questions with
and without a question mark, in lower case, with a one-letter typo, "what did I say my ... was?", corrections
("actually, it's ..."). What the model cannot do gets a short polite reply (POLITE_REPLIES): greetings, thanks,
requests to write, explain or compute, and questions about something never told.

An option, `mix="copy"` (issue 45), makes a share of the facts told ones whose values must be copied whatever they
look like: random strings and codes, dates, times, phone numbers and amounts, several attributes of one named thing,
facts told in passing, other spellings and slips (the section "the copy mix" below: its values and templates are
split the same way). Without it every chat is the one the same arguments always gave.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from kvchat.engine.data import open_facts
from kvchat.engine.data.small_talk import everyday_request, everyday_sentence
from kvchat.engine.text.chat_format import Round

SYSTEM_PROMPT = "You are kvchat, a helpful assistant that remembers what the user tells you."

_FIRST = """Alice Aaron Abel Ada Adrian Agnes Aiden Alan Albert Alma Amara Amber Amelia Amos Ana Andre Angela Anita
Anton Ari Arlo Arthur Asha Astrid Aurora Axel Beatrix Ben Bianca Boris Bruno Caleb Camila Carl Carmen Cecil Celia
Chloe Clara Conrad Cora Cyrus Dalia Damon Dana Daria David Delia Derek Diana Dimitri Dora Edgar Edith Elena Eli
Elias Elin Elsa Emil Emma Enzo Erik Esme Ethan Eva Ezra Farah Felix Fiona Flora Frida Gabriel Gemma George Gideon
Gina Greta Hana Hans Harriet Hector Helena Henry Hugo Ida Ilse Imani Ines Ingrid Ira Iris Isaac Ivan Ivy Jada
Jakob Jana Jasper Jonas Josef Julia Juno Kai Karim Karla Kasper Kenji Kira Klaus Lara Lars Lea Leon Levi Lila Linus
Livia Lola Lorenzo Luca Lucia Luna Lydia Magnus Maia Malik Marco Mari Marta Mateo Maya Milan Mila Milo Mira Nadia
Nala Nico Nina Noah Nora Oda Olaf Olga Oliver Omar Oscar Otto Paloma Pavel Petra Pia Quinn Rafael Rania Raul Rhea
Rosa Ruben Ruth Sami Sara Selma Silas Simon Sofia Stefan Stella Sven Tala Tariq Tessa Theo Tilda Tomas Uma Ursula
Vera Victor Viola Wanda Wilma Xavier Yara Yusuf Zara Zeno Zoe""".split()
_CITIES = """Aarhus Accra Adelaide Algiers Amman Ankara Antwerp Athens Austin Baku Bangkok Barcelona Basel Beirut
Belfast Bergen Berlin Bern Bilbao Bologna Bordeaux Boston Bremen Brno Bruges Brussels Budapest Cairo Calgary
Cardiff Chicago Cologne Cork Dakar Dallas Delft Denver Dijon Dublin Dundee Durban Edinburgh Florence Geneva Genoa
Ghent Glasgow Granada Graz Hamburg Hanoi Havana Helsinki Hobart Houston Innsbruck Istanbul Jakarta Kyoto Lagos Leeds
Leipzig Lille Lima Lisbon Ljubljana Lyon Madrid Malmo Manila Marseille Melbourne Milan Montreal Mumbai Munich Nairobi
Nantes Naples Oslo Osaka Ottawa Oxford Padua Palermo Paris Perth Porto Prague Quebec Riga Rome Rotterdam
Salzburg Santiago Seattle Seoul Seville Sofia Split Stockholm Sydney Tallinn Tampere Tokyo Toronto Toulouse Turin
Utrecht Valencia Venice Verona Vienna Vilnius Warsaw Zagreb Zurich""".split()
_COLORS = "amber azure beige black blue bronze coral crimson cyan gold gray green indigo ivory lavender lilac magenta maroon mint navy olive orange pink plum purple red rose ruby salmon silver teal turquoise violet white yellow".split()
_FOODS = "apples bagels burritos cheesecake cherries chili couscous curry dumplings falafel figs granola gnocchi hummus lasagna lentils mangoes noodles oatmeal olives omelettes pancakes pasta peaches pears pizza pretzels quiche ramen risotto salmon sushi tacos tofu waffles".split()
_ANIMALS = "badgers bats bears beavers camels cats cheetahs crows deer dolphins donkeys eagles ferrets foxes frogs geckos goats hedgehogs horses koalas lemurs lions llamas lynxes moles otters owls pandas parrots penguins rabbits ravens seals sloths swans tigers turtles wolves zebras".split()
_MONTHS = "January February March April May June July August September October November December".split()
_WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
# The value kinds training and held-out chats share (birthdays: a month and a day of 1-28; meeting days: weekdays):
# the trained model has seen every one of them, so questions about them are reported apart
# (Question.values_seen_in_training).
SHARED_VALUE_FIELDS = frozenset({"birthdays", "weekdays"})
_RELATIONS = ["sister", "brother", "best friend", "boss", "neighbor", "cousin", "dentist", "teacher"]
_TOPICS = ["the ocean", "volcanoes", "bread baking", "chess openings", "the moon", "jazz", "bicycles", "rain forests",
           "ancient ruins", "honey bees", "glaciers", "origami", "lighthouses", "coffee", "the desert", "kites",
           "trains", "mushrooms", "tea", "deep sea fish", "windmills", "the northern lights", "sourdough", "tulips"]
_FILLER = [
    "I had a long day at work and the weather was grey all afternoon.",
    "My train was late again, so I read a few pages of my book on the platform.",
    "We are planning a small dinner for the weekend and I still need to buy groceries.",
    "The neighbors are renovating their kitchen and it has been noisy all week.",
    "I finally cleaned the garage and found a box of old letters and photos.",
    "Yesterday I tried a new recipe, but I think it needed more salt.",
    "The park near my home has new benches and a small fountain.",
    "I am thinking about learning to play the piano this winter.",
    "My phone battery keeps dying faster than it used to.",
    "There was a street market in town with music and lots of people.",
]
# Held-out chats have their own small talk (as many sentences, so their chats draw the same numbers), none sharing
# four words in a row with the training small talk; trained and dev chats keep _FILLER.
_FILLER_HELDOUT = [
    "The bus driver waved at everyone this morning, and it put me in a good mood.",
    "Our heating broke last night, so we wore thick sweaters until bedtime.",
    "A coworker lent me a puzzle and we worked on it until midnight.",
    "The supermarket ran out of bread, so breakfast was a bit boring.",
    "I have been trying to drink more water and go to bed earlier.",
    "It rained so hard this afternoon that the roads turned into little rivers.",
    "Someone left an umbrella by the front door and nobody knows whose it is.",
    "The laundry took forever to dry because the air was so damp.",
    "I fixed the squeaky door hinge with a few drops of oil.",
    "We watched the sunset from the hill and stayed out until it got cold.",
]


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_ONSETS = list("bcdfghjklmnpqrstvwxyz") + "br ch cl dr fl gr kl pr sh sk st th tr".split() + [""] * 6
_VOWELS = list("aeiouy") + "ai ea ee io oa ou".split()
_CODAS = [""] * 6 + list("bcdfgklmnpqrstxz") + "ck ng nd rt sh th".split()
_REAL_WORDS = {w.lower() for w in _FIRST + _CITIES + _COLORS + _FOODS + _ANIMALS}


def pseudo_word(rng: random.Random) -> str:
    """A made-up word (never one of the real held-out words). Mostly syllables, which may start with a vowel and use
    every letter; sometimes plain random letters, so that copying, not guessing, is what answers a question."""
    while True:
        if rng.random() < 0.2:
            word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 9)))
        else:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                           for _ in range(rng.choice((1, 2, 2, 3))))
        if word not in _REAL_WORDS and 3 <= len(word) <= 12:
            return word


@dataclass(frozen=True)
class Pools:
    """Where values come from. Training chats use made-up words, so the model can only answer by copying from the
    chat; held-out chats use real names, cities, colors, foods and animals that training never shows, and numbers
    from a disjoint residue class."""

    synthetic: bool
    names: tuple[str, ...] = ()
    cities: tuple[str, ...] = ()
    colors: tuple[str, ...] = ()
    foods: tuple[str, ...] = ()
    animals: tuple[str, ...] = ()
    numbers: tuple[int, ...] = ()

    def pick(self, field: str, rng: random.Random) -> str:
        if field == "numbers":
            return str(rng.choice(self.numbers))
        if self.synthetic:
            word = pseudo_word(rng)
            return word.capitalize() if field in ("names", "cities") else word
        return rng.choice(getattr(self, field))


def pools(split: str) -> Pools:
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r} (accepted: train, heldout)")
    held = split == "heldout"
    numbers = tuple(n for n in range(10, 1000) if (n % 7 == 3) == held)
    if not held:
        return Pools(True, numbers=numbers)
    return Pools(False, tuple(_FIRST), tuple(_CITIES), tuple(_COLORS), tuple(_FOODS), tuple(_ANIMALS), numbers)


# Things the user names ("the boat is called Wavelet"): held-out chats name things training never names.
_NOUNS_TRAIN = """boat dog cat car bike house project band company horse plant robot laptop team ship podcast blog
garden goldfish parrot hamster startup novel painting song village street cafe restaurant puppy kitten tortoise
rabbit pony cow goat van truck tractor printer router server app game website shop bakery bar club choir
orchestra school class course boardgame drone camera guitar piano violin apartment cabin tent yacht canoe""".split()
_NOUNS_HELDOUT = """sailboat lizard snake bicycle scooter motorbike kayak spaceship newsletter bookshop bistro
museum theater studio farm vineyard greenhouse spreadsheet chatbot telescope trumpet cello cottage castle
bridge tortoiseshell dinghy helicopter""".split()
_NOUNS_DEV = """submarine glider wagon trailer moped workshop library lighthouse windmill barge raft hammock
caravan scarecrow""".split()
_TOPICS_DEV = ["tidal waves", "jellyfish", "the printing press", "solar panels", "knitting", "the silk road"]
_TOPICS_HELDOUT = ["black holes", "the roman empire", "photosynthesis", "earthquakes", "the stock market",
                   "vaccines", "electric cars", "the pyramids", "quantum computers", "coral reefs"]

# Level-5 noise puts everyday words in a sentence's frame: the words of the small talk, less those that could say
# what is told (a named thing's noun, "home", "neighbors"), so the noise never turns a sentence into another fact.
_FILLER_WORDS = tuple(sorted({w.strip(".,").lower() for f in _FILLER for w in f.split()}
                             - {"i", "my", "home", "neighbors", "we", "it", "the", "a", "and", "to", "of", "so",
                                "than", "but"} - set(_NOUNS_TRAIN + _NOUNS_HELDOUT + _NOUNS_DEV)))

PHRASINGS = ("train", "heldout", "dev")
_SPARE_WORDS = "really just please actually so um like quite maybe still ok oh hmm".split()
QUESTION_KINDS = ("single", "corrected", "multi")
POSITIONS = ("alone", "begin", "middle", "end")
# How a fact was told, and how the question about it was asked: `kvchat eval` reports recall per family.
STATED_FAMILIES = ("plain", "remember", "called", "list", "correction")
ASKED_FAMILIES = ("plain", "what_did_i_say", "no_question_mark", "lower_case", "typo")
OUT_OF_SCOPE_KINDS = ("greeting", "thanks", "request", "unknown")
# The copy mix (issue 45; `mix="copy"`): facts whose values must be copied whatever they look like. Its own
# families beside the ones above: a fact told in passing inside a longer sentence, a question typed with the other
# English spelling, a dropped apostrophe or a slip (`respell`).
MIXES = ("copy",)
COPY_SHARE = 0.5  # the share of facts told that are the copy mix's, by default
# With the copy mix, the share of the generator's own statements (its slots and templates) told with random strings
# for values (`random_code`): what a value looks like no longer tells where it stands in a sentence the generator
# writes ("my trailer is known as Damon"), so the model learns to find it by the sentence. Without them, three runs
# of the mix alone copied random strings in the mix's own sentences but lost 8 points of recall on the generator's
# dev phrasings, answering with a word of the frame ("Your neighbor's name is First.", from "First, ..."; "is set
# to" gave "set"): docs/embedded-model.md, "Training on the copy mix".
GENERATOR_RANDOM_SHARE = 0.3
COPY_STATED_FAMILIES = ("in_passing",)
COPY_ASKED_FAMILIES = ("respelled",)

GREETING_REPLY = "Hello! Tell me something to remember, and ask me about it later."
THANKS_REPLY = "You're welcome."
DEMO_REPLY = "I'm a small demo model: I can only remember what you tell me. Use --model for a real model."
UNKNOWN_REPLY = "You haven't told me that yet."
CHATTER_REPLY = "I see. Tell me anything you want me to remember."
LIST_ACK = "Noted, I will remember all of that."
POLITE_REPLIES = frozenset({GREETING_REPLY, THANKS_REPLY, DEMO_REPLY, UNKNOWN_REPLY, CHATTER_REPLY})


@dataclass(frozen=True)
class Templates:
    """One thing said several ways, in three disjoint sets: the training chats use `train`; `dev` chats choose
    between training runs (recipes, sizes); `heldout` chats measure the model that ships, and nothing is tuned on
    them."""

    train: tuple[str, ...]
    heldout: tuple[str, ...]
    dev: tuple[str, ...]
    # Training only, with `wide` phrasings (TrainConfig.wide): more of the same, so that the model sees many ways
    # of saying a thing. The trained-phrasing eval and benchmarks keep to `train`, so their chats do not change.
    more: tuple[str, ...] = ()

    def pick(self, phrasing: str, rng: random.Random, wide: bool = False) -> str:
        if wide and phrasing == "train" and self.more:
            return rng.choice(self.train + self.more)
        return rng.choice(getattr(self, phrasing))


def _t(train: list[str], heldout: list[str], dev: list[str], more: list[str] = ()) -> Templates:
    return Templates(tuple(train), tuple(heldout), tuple(dev), tuple(more))


@dataclass(frozen=True)
class Slot:
    """One thing the user can tell: how it is stated (a clause with {v}, no capital, no full stop), asked, recalled
    ("what did I say ...") and answered. `field` names the pool its values come from."""

    key: str
    field: str
    states: Templates
    asks: Templates
    recalls: Templates
    answer: str
    keywords: tuple[str, ...] = ()  # the words that say what is told or asked: training noise leaves them alone

    @property
    def canonical_ask(self) -> str:
        return self.asks.train[0]

    def reply(self, value: str) -> str:
        return self.answer.format(v=value)

    def ack(self, value: str) -> str:
        text = self.reply(value)
        return f"Noted: {text[0].lower()}{text[1:]}"


def _attribute(key: str, x: str, field: str, plural: bool = False, extra_states=((), (), (), ()),
               extra_asks=((), (), (), ())) -> Slot:
    """A fact of the form "my {x} is {v}"."""
    be, was, it = ("are", "were", "they") if plural else ("is", "was", "it")
    return Slot(
        key, field,
        _t([f"my {x} {be} {{v}}", f"{{v}} {be} my {x}", f"my {x}: {{v}}", f"my {x} {be} now {{v}}",
            f"the answer for my {x} is {{v}}", f"my {x} has always been {{v}}", f"{{v}}, that {be} my {x}",
            *extra_states[0]],
           [f"my {x} {'happen' if plural else 'happens'} to be {{v}}", f"as for my {x}: {{v}}",
            f"my {x}? {{v}}", *extra_states[1]],
           [f"my {x} {be} set to {{v}}", f"for my {x}, the answer is {{v}}", f"write down my {x} as {{v}}",
            *extra_states[2]],
           [f"my {x} would be {{v}}", f"I have {{v}} as my {x}", f"my {x} = {{v}}",
            f"these days my {x} {be} {{v}}", f"I'd say my {x} {be} {{v}}", *extra_states[3]]),
        _t([f"What {be} my {x}?", f"Can you tell me my {x}?", f"Do you remember my {x}?", f"Tell me my {x}.",
            f"Which {'ones' if plural else 'one'} {be} my {x}?", f"And my {x}?", f"Do you know my {x}?",
            f"What was my {x}?", f"Could you tell me what my {x} {be}?"]
           + ([f"What's my {x}?"] if not plural else []) + list(extra_asks[0]),
           [f"Do you happen to know my {x}?", f"I forgot my {x}. What {be} {it}?", f"Any clue about my {x}?",
            f"My {x}, what {be} {it}?", *extra_asks[1]],
           [f"Can you recall my {x}?", f"Please tell me what my {x} {be}.", f"Would you remind me of my {x}?",
            *extra_asks[2]],
           [f"Say my {x}.", f"Give me my {x}.", f"How about my {x}?", f"What about my {x}?",
            f"Do you still know my {x}?", f"You know my {x}, right?", f"What {be} my {x}, do you remember?",
            f"So what {be} my {x}?", f"I need my {x}.", *extra_asks[3]]),
        _t([f"What did I say my {x} {was}?", f"What did I tell you my {x} {was}?",
            f"What did I say about my {x}?", f"Remember my {x}? What {was} {it}?"],
           [f"Remind me, which {was} my {x} again?",
            f"I mentioned my {x} earlier. Can you repeat {'them' if plural else 'it'}?",
            f"What had I told you about my {x}?"],
           [f"Do you recall what I said my {x} {was}?", f"Back then, what did I give as my {x}?"],
           [f"Which {x} did I tell you?", f"What {x} did I say?", f"What did you note as my {x}?",
            f"What did I type as my {x}?"]),
        f"Your {x} {be} {{v}}.", tuple(x.replace("'s", "").split()))


def _slots() -> list[Slot]:
    slots = [
        _attribute("name", "name", "names", extra_states=(["call me {v}"], ["people call me {v}"],
                                                               ["everyone knows me as {v}"],
                                                               ["I'm called {v}", "the name's {v}"])),
        Slot("city", "cities",
             _t(["I live in {v}", "my home is in {v}", "I am living in {v}", "I moved to {v}", "my city is {v}",
                 "I'm from {v}", "I stay in {v}"],
                ["I'm based in {v}", "home for me is {v}", "I reside in {v}"],
                ["I've settled in {v}", "my place is in {v}"],
                ["my town is {v}", "{v} is where I live", "I've lived in {v} for years", "my address is in {v}",
                 "I live over in {v}", "these days I live in {v}"]),
             _t(["Where do I live?", "What city do I live in?", "Do you know where I live?", "Where is my home?",
                 "What is my city?", "Where am I from?", "Tell me where I live."],
                ["Which city is my home?", "What's the city I live in?", "Where am I based?"],
                ["Where's my home?", "Which place do I live in?"],
                ["Where do I stay?", "What town am I in?", "Which city am I in?",
                 "Where's my city?", "Where is it that I live?"]),
             _t(["Where did I say I live?", "What did I tell you about where I live?",
                 "What city did I say I live in?"],
                ["Remind me where I said home was.", "Which city did I mention as home?"],
                ["Where did I tell you I live?", "What place did I say is home?"],
                ["Where did I say my home was?", "What town did I say I live in?"]),
             "You live in {v}."),
        _attribute("color", "favorite color", "colors"),
        Slot("food", "foods",
             _t(["I really love {v}", "my favorite food is {v}", "I love eating {v}", "I love {v}",
                 "my favourite food is {v}", "I could eat {v} every day", "nothing beats {v}"],
                ["I can't get enough of {v}", "I adore {v}", "the food I like best is {v}"],
                ["I'm crazy about {v}", "my top food is {v}"],
                ["I enjoy {v} the most", "I'm a big fan of {v}", "I'd eat {v} any day",
                 "I like {v} more than anything"]),
             _t(["What food do I love?", "What is my favorite food?", "What do I love to eat?",
                 "What's my favourite food?", "Which food do I love?", "What do I like to eat?"],
                ["Which dish do I like best?", "What should you cook for me?", "What dish do I adore?"],
                ["What food do I like most?", "What's the food I love?"],
                ["What do I enjoy eating?", "What food am I a fan of?",
                 "What would I eat every day?", "What food is my favorite?"]),
             _t(["What did I say I love to eat?", "What did I tell you my favorite food was?",
                 "What food did I say I love?"],
                ["Remind me what food I love.", "Which dish did I mention loving?"],
                ["What did I tell you I love eating?", "Which food did I say I liked?"],
                ["What did I say my favorite food was?", "What food was it that I love?"]),
             "You love {v}."),
        _attribute("animal", "favorite animals", "animals", plural=True),
        _attribute("birthday", "birthday", "birthdays", extra_states=(["I was born on {v}"], ["I celebrate on {v}"],
                                                                             ["my birthday comes on {v}"],
                                                                             ["my big day is {v}"])),
        _attribute("locker", "locker number", "numbers"),
        _attribute("meeting", "meeting day", "weekdays", extra_states=(["my meeting is on {v}"], ["I meet them on {v}"],
                                                                        ["the meeting takes place on {v}"],
                                                                        ["the meeting is every {v}"])),
    ]
    slots += [_attribute(f"rel:{rel}", f"{rel}'s name", "names") for rel in _RELATIONS]
    return slots


SLOTS = _slots()
_FIXED_SLOTS = {s.key: s for s in SLOTS}


@lru_cache(maxsize=None)
def called_slot(det: str, noun: str) -> Slot:
    """Something the user names: "the boat is called Wavelet"."""
    d = f"{det} {noun}"
    answer_det = {"my": "Your", "our": "Your"}.get(det, det.capitalize())
    return Slot(
        f"called:{d}", "names",
        _t([f"{d} is called {{v}}", f"{d}'s name is {{v}}", f"{d} is named {{v}}", f"I call {d} {{v}}",
            f"I named {d} {{v}}", f"{d} has the name {{v}}", f"{{v}} is the name of {d}", f"we call {d} {{v}}",
            f"{d}, it is called {{v}}"],
           [f"we named {d} {{v}}", f"{d} bears the name {{v}}", f"{d} goes by {{v}}", f"{d} got the name {{v}}"],
           [f"{d} is known as {{v}}", f"we gave {d} the name {{v}}"],
           [f"{d}'s called {{v}}", f"{d} answers to {{v}}", f"{d} was named {{v}}", f"{{v}}, that's {d}",
            f"they call {d} {{v}}", f"{d} is {{v}} by name", f"{d} has {{v}} as its name"]),
        _t([f"What is {d} called?", f"What's {d}'s name?", f"What is the name of {d}?", f"What do I call {d}?",
            f"How is {d} named?", f"Tell me the name of {d}.", f"Do you remember {d}'s name?",
            f"What was {d} called?"],
           [f"What do we call {d}?", f"What name does {d} have?", f"Do you know what we call {d}?",
            f"Which name did {d} get?"],
           [f"What is {d} known as?", f"Tell me what {d} is called."],
           [f"What's {d} called?", f"Name of {d}?", f"Which name is {d}'s?", f"How do I call {d}?",
            f"What's the name for {d}?", f"Remember {d}'s name?"]),
        _t([f"What did I say {d} was called?", f"What did I name {d}?", f"What name did I give {d}?",
            f"What did I tell you {d} is called?"],
           [f"Remind me of the name I gave {d}.", f"What was {d}'s name again?"],
           [f"What did I tell you {d}'s name was?", f"Which name did I say {d} has?"],
           [f"What did I call {d}?", f"How did I name {d}?", f"What name did I use for {d}?"]),
        f"{answer_det} {noun} is called {{v}}.", (noun,))


def slot_for(key: str) -> Slot:
    if key.startswith("called:"):
        det, noun = key.removeprefix("called:").split(" ", 1)
        return called_slot(det, noun)
    if key.startswith("attr:"):  # an attribute of a named thing (the copy mix): "attr:age:my dog"
        _, attribute, thing = key.split(":", 2)
        det, noun = thing.split(" ", 1)
        return entity_slot(attribute, det, noun)
    if key in _COPY_SLOTS:
        return _COPY_SLOTS[key]
    if key.startswith("open:"):  # a fact about anything (training only): "open:codes:my kennel tally"
        _, field_name, thing = key.split(":", 2)
        det, subject = thing.split(" ", 1)
        return open_slot(det, subject, field_name)
    return _FIXED_SLOTS[key]


@lru_cache(maxsize=4096)
def open_slot(det: str, subject: str, field_name: str) -> Slot:
    """A fact about anything (engine.data.open_facts): "{det} {subject}" told with a value of `field_name`'s kind,
    in training chats only (its templates are training ones in every phrasing's place)."""
    d = f"{det} {subject}"
    states = tuple(t.format(d=d, v="{v}") for t in open_facts.STATES)
    asks = tuple(t.format(d=d, v="{v}") for t in open_facts.ASKS)
    recalls = tuple(t.format(d=d, s=subject) for t in open_facts.RECALLS)
    answer = open_facts.ANSWER.format(A=f"{open_facts.answer_determiner(det)} {subject}", v="{v}")
    return Slot(f"open:{field_name}:{d}", field_name, Templates(states, states, states), Templates(asks, asks, asks),
                Templates(recalls, recalls, recalls), answer, tuple(subject.split()))



_REMEMBER = _t(["Remember that {c}.", "Please remember that {c}.", "Don't forget: {c}.", "Keep in mind that {c}.",
                "Remember: {c}.", "Please note that {c}.", "I want you to remember that {c}.", "Note this: {c}.",
                "For the record, {c}.", "Remember this, {c}.", "Don't forget that {c}."],
               ["Can you remember that {c}?", "Note that {c}.", "Just so you know, {c}.", "Make a note that {c}."],
               ["Please keep track: {c}.", "Store this: {c}.", "Don't lose this: {c}."],
               ["Be sure to remember that {c}.", "You should know that {c}.", "Important: {c}.", "Heads up: {c}.",
                "Here's a fact: {c}.", "Remember for later that {c}.", "I'd like you to know that {c}.",
                "Keep this in your memory: {c}."])
# Openers and closers dress a sentence the way people type it; "" (none) is the commonest.
_OPENERS = _t(["", "", "", "", "Hey, ", "Oh, and ", "By the way, ", "So, ", "OK, ", "Also, ", "Well, ", "Hi! ",
               "Okay so ", "And "],
              ["", "", "", "", "Btw, ", "Listen, ", "Alright, ", "Anyway, "],
              ["", "", "", "", "Right, ", "Look, ", "Quick note: "],
              ["Okay, ", "Now, ", "Oh, ", "Hey so ", "Ah, ", "Hello, ", "Then, ", "Hmm, ", "Ok so "])
_CLOSERS = _t(["", "", "", "", " by the way", " :)", " ok", " thanks", " haha", " now"],
              ["", "", "", "", " btw", " if that helps", " fyi"], ["", "", "", "", " just saying", " lol", " fwiw"],
              [" :D", " for now", " these days", " thank you", " you know", " ;)", " then", " hehe"])
_ASK_OPENERS = _t(["", "", "", "", "Hey, ", "Quick question: ", "So, ", "OK, ", "Sorry, ", "Um, ", "Hmm, ", "Hi! ",
                   "And "],
                  ["", "", "", "", "Tell me, ", "Wait, ", "Question: ", "Hey there, "],
                  ["", "", "", "", "Say, ", "Honestly, ", "Real quick, "],
                  ["Okay, ", "Now, ", "Hello, ", "Excuse me, ", "Just wondering, ", "Quick one: ", "Ah, ", "Oh, ",
                   "Hey so ", "Hmm ok, "])
_ASK_CLOSERS = _t(["", "", "", "", " please", " again", " now", " :)"], ["", "", "", "", " if you know",
                                                                         " by any chance"],
                   ["", "", "", "", " if you can", " for me"],
                   [" thanks", " thank you", " haha", " pls", " quickly", " right now", " exactly",
                    " do you remember", " ;)", " for real"])
_LIST = _t(["{a}, and {b}.", "{a}. {B}.", "{a}, {b} and {c}.", "{a}. {B}. {C}."],
           ["A few things: {a}; {b}.", "{a}. Also, {b}.", "{a}; {b}; and lastly {c}."],
           ["{a} - {b}.", "First, {a}. Second, {b}.", "{a}, {b}, and also {c}."],
           ["{a} and {b}.", "{a}, plus {b}.", "{a}. And {b}.", "{a}, {b}.", "{a}, {b}, {c}.",
            "{a} and {b}, and {c}.", "{a}! {B}!", "{a}, then {b}.", "Two facts: {a}, and {b}."])
_CORRECT_FULL = _t(["Correction: {c}, not {old}.", "Actually, {c}, not {old}.", "I changed my mind, {c}."],
                   ["Sorry, I was wrong: {c}.", "Let me correct that: {c}.", "Update: {c} now."],
                   ["Wait, {c}, not {old}.", "I got that wrong, {c}.", "Fix that: {c}."],
                   ["No, {c}, not {old}.", "Correction, {c}.", "Not {old}: {c}.", "Small fix: {c}.",
                    "Change of plan, {c}.", "Actually no, {c}.", "It's not {old}: {c}."])
_CORRECT_SHORT = _t(["Actually, it's {v}.", "Sorry, I meant {v}.", "No wait, it's {v}."],
                    ["Oops, it's {v}, not {old}.", "My mistake, it's {v}.", "Make that {v}."],
                    ["Oh no, it's {v}.", "Scratch that, {v}.", "Change it to {v}."],
                    ["No, {v}.", "It's {v} actually.", "I mean {v}.", "Wrong, it's {v}.", "Sorry, {v}.", "Nope, {v}.",
                     "Not {old}, {v}."])
_GREETINGS = _t(["Hi!", "Hello.", "Hey there!", "Good morning!", "Hello, how are you?", "Hi, nice to meet you."],
                ["Good evening!", "Howdy!", "Hey, what's up?", "Greetings.", "Hiya"],
                ["Yo!", "Hello there.", "Good afternoon!", "Hey hey"],
                ["Hey!", "Morning!", "Hi, how's it going?", "Hey, good to see you.", "Hello again!", "Good day!"])
_THANKS = _t(["Thanks!", "Thank you.", "Thanks a lot!", "Thank you so much.", "Great, thanks."],
             ["Cheers!", "Much appreciated.", "Thanks for remembering!", "Thx"],
             ["Thanks so much!", "Many thanks.", "Appreciate it!", "ty"],
             ["Thanks.", "Thank you!", "Nice, thank you.", "Perfect, thanks!", "Awesome, thanks.",
              "Thanks, that helps.", "Thank you very much."])
_REQUESTS = _t(["Write a poem about {t}.", "Explain {t} to me.", "What is {a} times {b}?", "Tell me a joke.",
                "Tell me something interesting about {t}.", "Can you summarize the history of {t}?",
                "Translate good morning into French.", "Write an email to my {r}.", "What do you know about {t}?"],
               ["Compose a short story about {t}.", "How does {t} work?", "Calculate {a} plus {b}.",
                "Could you describe {t} in detail?", "What's {a} divided by {b}?",
                "Write some code that sorts a list.", "Give me three facts about {t}."],
               ["Summarize {t} for me.", "Draft a letter to my {r}.", "What's {a} minus {b}?",
                "Sing me a song about {t}."],
               ["Write a haiku about {t}.", "Teach me about {t}.", "Multiply {a} by {b}.", "Why is {t} important?",
                "Make a list of ideas about {t}.", "Help me plan a trip.", "Recommend a good book.",
                "List the pros and cons of {t}.", "Search the web for {t}.", "Fix my code."])


# How a question for two facts joins them; the trained and dev chats use the first, `wide` all; held-out chats
# their own, whose joining word no training join uses.
_TWO_QUESTIONS = ("{a}, and {b}", "{a}{a_end} {B}", "{a} and {b}", "{a}, plus {b}")
_TWO_QUESTIONS_HELDOUT = ("{a}{a_end} Also, {b}",)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


_KEYBOARD_NEIGHBORS = dict(zip("qwertyuiopasdfghjklzxcvbnm", "wqrtyuiopoadsfghjkklxzcvbnbm"))


def typo(text: str, rng: random.Random, protect: tuple[str, ...] = ()) -> str:
    """One one-letter slip in one word of 4+ letters (a neighbor key, a dropped, doubled or swapped letter); words
    in `protect` (values, named things) are left alone. Text without such a word comes back unchanged."""
    words = text.split(" ")
    spots = [i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 4
             and w.strip(".,?!:;'").lower() not in {p.lower() for p in protect}]
    if not spots:
        return text
    i = rng.choice(spots)
    w = words[i]
    letters = [j for j, c in enumerate(w) if c.isalpha()]
    j = rng.choice(letters[1:-1] or letters)
    how = rng.randrange(4)
    if how == 0 and w[j].lower() in _KEYBOARD_NEIGHBORS:
        w = w[:j] + _KEYBOARD_NEIGHBORS[w[j].lower()] + w[j + 1:]
    elif how == 1:
        w = w[:j] + w[j + 1:]
    elif how == 2:
        w = w[:j] + w[j] + w[j:]
    elif j + 1 < len(w) and w[j + 1].isalpha():
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    else:
        w = w[:j] + w[j] + w[j:]
    words[i] = w
    return " ".join(words)


# ---- the copy mix (issue 45): values to copy whatever they look like ----
#
# `mix="copy"` (dialogues, make_dialogue) makes a share of the facts told these: random strings as names, codes and
# the like; dates, times, years, phone numbers and amounts in their common written forms; several attributes of one
# named thing, asked one at a time; facts told in passing; and facts and questions typed with the other English
# spelling, a dropped apostrophe or a slip. Its values are split like the pools': a string the generator makes is
# held out when the CRC-32 of its bytes is 3 mod 7 (`held_out_value`), so held-out chats never tell one a training
# chat could; breeds are made up in training and real in held-out chats, like names. Its templates keep the
# module's rule: no held-out one shares four words in a row (the thing told or asked masked) with a trained or dev
# one of its group (`copy_mix_slots`, `COPY_WRAPPERS`).

_PLACEHOLDERS = ("\x11", "\x12", "\x13", "\x14")  # stand for the values while the words around them change

# Facts of the form "my {x} is {v}" (`_attribute`) and their own ways of telling and asking: (key, the thing, the
# value field, states (train, held-out, dev), asks (train, held-out, dev)).
_COPY_ATTRIBUTES = [
    ("code:wifi", "wifi password", "codes",
     (["the wifi password is {v}", "the password for our wifi is {v}"], ["to get online here you type {v}"],
      ["the router's key is {v}"]),
     (["What is the wifi password?"], ["How do I get online here?"], ["What's the router's key?"])),
    ("code:door", "door code", "codes",
     (["the code for the front door is {v}", "the door opens with {v}"], ["the keypad by the door wants {v}"],
      ["to open the door I type {v}"]),
     (["What opens the front door?"], ["What does the keypad by the door want?"], ["How do I open the door?"])),
    ("code:booking", "booking code", "codes",
     (["my booking is under {v}", "the booking code is {v}"], ["they confirmed the reservation as {v}"],
      ["the reservation code is {v}"]),
     (["What is the booking code?"], ["Under what did they confirm the reservation?"],
      ["What's the reservation code?"])),
    ("code:username", "username", "codes",
     (["I log in as {v}", "my login is {v}"], ["online I go by {v}"], ["I sign in as {v}"]),
     (["What do I log in as?"], ["What name do I go by online?"], ["What do I sign in as?"])),
    ("code:bike lock", "bike lock code", "codes",
     (["my bike lock opens with {v}", "the lock on my bike is {v}"], ["the combination for the bike is {v}"],
      ["I unlock my bike with {v}"]),
     (["What opens my bike lock?"], ["What's the combination for the bike?"], ["How do I unlock my bike?"])),
    ("code:parcel", "tracking number", "codes",
     (["the parcel's tracking number is {v}", "my parcel can be tracked with {v}"],
      ["the courier gave me {v} to follow the parcel"], ["the parcel's code is {v}"]),
     (["How do I track my parcel?"], ["What did the courier give me to follow the parcel?"],
      ["What's the parcel's code?"])),
    ("code:member", "member ID", "codes",
     (["my member ID is {v}", "at the club I'm member {v}"], ["the club knows me by {v}"], ["my club number is {v}"]),
     (["What is my member ID?"], ["By what does the club know me?"], ["What's my club number?"])),
    ("date:flight", "flight date", "dates",
     (["my flight is on {v}", "my plane takes off on {v}"], ["I'm flying out on {v}"], ["the plane leaves on {v}"]),
     (["When is my flight?", "What day do I fly?"], ["On which date am I flying?"], ["When do I fly out?"])),
    ("date:dentist", "dentist appointment", "dates",
     (["I see the dentist on {v}", "my dentist appointment is on {v}"], ["the dentist expects me on {v}"],
      ["I have the dentist on {v}"]),
     (["When do I see the dentist?"], ["What date is the dentist expecting me?"], ["When is the dentist?"])),
    ("date:wedding", "wedding anniversary", "dates",
     (["we were married on {v}", "our anniversary is on {v}"], ["our wedding took place on {v}"],
      ["we married on {v}"]),
     (["When is our anniversary?", "What's our wedding date?"], ["On what date was our wedding?"],
      ["When did we marry?"])),
    ("date:deadline", "project deadline", "dates",
     (["the project must be in on {v}", "my deadline is {v}"], ["I have to hand the project in by {v}"],
      ["the project has to be done by {v}"]),
     (["When is the project due?"], ["By when must I hand the project in?"],
      ["When does the project have to be done?"])),
    ("time:train", "train time", "times",
     (["my train is at {v}", "I catch the train at {v}"], ["the train I take departs at {v}"],
      ["my train goes at {v}"]),
     (["When does my train leave?", "What time is my train?"], ["At what hour does the train I take depart?"],
      ["What time does my train go?"])),
    ("time:alarm", "alarm time", "times",
     (["my alarm clock is on {v}", "I get up at {v} when the alarm rings"], ["I'm woken by the alarm at {v}"],
      ["my alarm rings at {v}"]),
     (["When does my alarm go off?"], ["At what hour am I woken?"], ["What time will my alarm ring?"])),
    ("time:dinner", "dinner reservation", "times",
     (["dinner's reserved for {v}", "we have a table at {v}"], ["the restaurant expects us at {v}"],
      ["our table is at {v}"]),
     (["When is dinner booked for?"], ["When does the restaurant expect us?"], ["What time is our table?"])),
    ("year:graduation", "graduation year", "years",
     (["I graduated in {v}"], ["I finished university in {v}"], ["I got my degree in {v}"]),
     (["When did I graduate?", "What year did I graduate?"], ["University ended for me in what year?"],
      ["When did I get my degree?"])),
    ("year:job", "starting year", "years",
     (["I started at my job in {v}", "I joined the company in {v}"], ["the company hired me in {v}"],
      ["I've worked there since {v}"]),
     (["When did my job begin?", "What year did I join the company?"], ["In what year was I hired?"],
      ["From what year have I worked there?"])),
    ("phone:mine", "phone number", "phones",
     (["I can be called on {v}", "my number is {v}"], ["ring me on {v}"], ["my mobile is {v}"]),
     (["How can I be reached?", "What number am I on?"], ["Which number rings me?"], ["What's my mobile?"])),
    ("phone:mum", "mother's phone number", "phones",
     (["you can call my mum on {v}", "mum's phone is {v}"], ["mum picks up on {v}"], ["my mom's phone is {v}"]),
     (["How do I call my mum?"], ["On which number does mum pick up?"], ["What's my mom's phone?"])),
    ("phone:work", "work number", "phones",
     (["at the office my extension is {v}", "the number of my desk phone is {v}"], ["the office line is {v}"],
      ["the work phone is {v}"]),
     (["Which extension do I have at the office?"], ["What's the office line?"], ["Which is the work phone?"])),
    ("phone:vet", "vet's number", "phones",
     (["the vet's phone is {v}", "you call the vet on {v}"], ["the animal clinic answers on {v}"],
      ["the vet can be called on {v}"]),
     (["How do I call the vet?"], ["What number does the animal clinic answer on?"], ["What's the vet's phone?"])),
    ("amount:rent", "rent", "money",
     (["I pay {v} in rent", "the rent is {v}"], ["each month the landlord gets {v}"], ["rent costs me {v}"]),
     (["How much is my rent?", "How much rent do I pay?"], ["What does the landlord get each month?"],
      ["What does my rent cost?"])),
    ("amount:gym", "gym fee", "money",
     (["the gym costs me {v}", "I pay {v} for the gym"], ["the gym takes {v} from my account"],
      ["gym membership is {v}"]),
     (["How much does the gym cost me?"], ["What does the gym take from my account?"],
      ["What's the gym membership?"])),
    ("amount:suitcase", "suitcase weight", "weights",
     (["my suitcase weighs {v}"], ["the scale says my luggage is {v}"], ["my bag weighs {v}"]),
     (["How heavy is my suitcase?", "How much does my suitcase weigh?"], ["What did the scale say for my luggage?"],
      ["What does my bag weigh?"])),
    ("amount:commute", "commute", "distances",
     (["I live {v} from work", "it is {v} to my office"], ["the office is about {v} away from home"],
      ["work is {v} from my place"]),
     (["What distance is my commute?", "How far do I live from work?"],
      ["What distance separates home and the office?"],
      ["How far away is work?"])),
    ("amount:height", "height", "heights",
     (["I am {v} tall"], ["I measure {v}"], ["I stand {v} tall"]),
     (["How tall am I?"], ["What do I measure?"], ["How tall do I stand?"])),
]
_COPY_SLOTS = {key: _attribute(key, x, field, extra_states=(*states, ()), extra_asks=(*asks, ()))
               for key, x, field, states, asks in _COPY_ATTRIBUTES}

# Named things with several attributes: the kinds, their attributes (besides a name, which is `called_slot`'s), and
# their nouns in each phrasing, split like _NOUNS_* (the training ones are training nouns, the held-out ones held-out
# nouns, or nouns no other phrasing names).
_ENTITY_ATTRIBUTES = {"pets": ("age", "color", "breed", "weight"), "vehicles": ("color", "plate", "year")}
_ENTITY_NOUNS = {
    "train": {"pets": ("dog", "cat", "horse", "rabbit", "pony", "goat", "parrot", "hamster", "puppy", "kitten",
                       "tortoise", "cow"),
              "vehicles": ("car", "van", "truck", "tractor", "bike", "boat", "yacht", "canoe")},
    "dev": {"pets": ("gerbil", "budgie", "canary", "chinchilla"),
            "vehicles": ("moped", "caravan", "trailer", "wagon", "barge", "glider")},
    "heldout": {"pets": ("lizard", "snake", "cockatoo", "iguana"),
                "vehicles": ("scooter", "motorbike", "bicycle", "kayak", "sailboat", "dinghy")},
}
_PRONOUNS = {"pets": (("he", "his"), ("she", "her"), ("it", "its")), "vehicles": (("it", "its"), ("she", "her"))}
_BREEDS = ("beagle", "poodle", "labrador", "collie", "terrier", "husky", "dachshund", "spaniel", "bulldog",
           "greyhound", "siamese", "persian", "bengal", "sphynx", "arabian", "shetland", "mustang", "appaloosa")
_HELD_OUT_WORDS = frozenset(_REAL_WORDS | set(_BREEDS))  # the held-out values of words: never in a training chat
# words no subject about anything (engine.data.open_facts) has: held-out and dev nouns and held-out values
_OPEN_AVOID = frozenset({*_NOUNS_HELDOUT, *_NOUNS_DEV, *_HELD_OUT_WORDS,
                         *(n for phrasing in ("heldout", "dev") for nouns in _ENTITY_NOUNS[phrasing].values()
                           for n in nouns)})


def _entity_templates(attribute: str, d: str) -> tuple[Templates, Templates, Templates, str, tuple[str, ...]]:
    """How an attribute of `d` ("my dog") is told, asked and recalled; its answer (with {A}, the answer's
    determiner and noun) and its keywords."""
    if attribute == "age":
        return (_t([f"{d} is {{v}} old", f"{d} is now {{v}} old", f"{d} turned {{v}} old", f"{d}'s age is {{v}}"],
                   [f"{d} has been around for {{v}}", f"{d} celebrated being {{v}} old"],
                   [f"{d} is aged {{v}}", f"{d} has lived {{v}} so far"]),
                _t([f"What's the age of {d}?", f"What age is {d}?", f"What is {d}'s age?", f"How old's {d}?"],
                   [f"For how long has {d} been around?", f"Can you say how long {d} has been alive?"],
                   [f"Tell me {d}'s age.", f"Any idea how old {d} is?"]),
                _t([f"How old did I say {d} was?", f"What age did I give for {d}?"],
                   [f"Earlier I gave an age for {d}; which was it?"], [f"What did I tell you {d}'s age was?"]),
                "{A} is {v} old.", ("old", "age"))
    if attribute == "color":
        return (_t([f"{d} is {{v}} in color", f"{d}'s color is {{v}}", f"the color of {d} is {{v}}"],
                   [f"{d} comes in {{v}}", f"you'd spot {d} by its {{v}} shade"],
                   [f"{d} is colored {{v}}", f"{d} has a {{v}} look"]),
                _t([f"What color is {d}?", f"What is the color of {d}?", f"Which color is {d}?",
                    f"What's {d}'s color?"],
                   [f"What shade does {d} come in?"], [f"Remind me which color {d} is."]),
                _t([f"What color did I say {d} was?"], [f"Which shade had I given for {d}?"],
                   [f"Which color did I tell you {d} is?"]),
                "{A}'s color is {v}.", ("color", "shade"))
    if attribute == "breed":
        return (_t([f"{d} is a {{v}}", f"{d}'s breed is {{v}}", f"the breed of {d} is {{v}}"],
                   [f"{d} belongs to the {{v}} breed", f"breed-wise, {d} counts as a {{v}}"],
                   [f"{d} is a purebred {{v}}", f"{d} is of {{v}} stock"]),
                _t([f"What is {d}'s breed?", f"Which breed is {d}?"],
                   [f"Do you know the breed {d} belongs to?"], [f"Tell me {d}'s breed."]),
                _t([f"What breed did I say {d} was?"], [f"Which breed had I mentioned for {d}?"],
                   [f"What did I tell you {d}'s breed was?"]),
                "{A}'s breed is {v}.", ("breed",))
    if attribute == "weight":
        return (_t([f"{d} weighs {{v}}", f"{d}'s weight is {{v}}", f"{d} weighs about {{v}}"],
                   [f"on the scale {d} came out at {{v}}"], [f"{d} tips the scale at {{v}}"]),
                _t([f"How much does {d} weigh?", f"How heavy is {d}?", f"What is {d}'s weight?"],
                   [f"What did {d} come out at on the scale?"], [f"What does {d} weigh?"]),
                _t([f"What weight did I give for {d}?"], [f"What had the scale shown for {d}, as I said?"],
                   [f"How heavy did I say {d} was?"]),
                "{A} weighs {v}.", ("weighs", "weigh", "weight", "heavy"))
    if attribute == "plate":
        return (_t([f"{d}'s plate is {{v}}", f"{d} has the plate {{v}}", f"the licence plate of {d} is {{v}}"],
                   [f"{d} is registered as {{v}}"], [f"{d}'s registration is {{v}}"]),
                _t([f"What is {d}'s plate?", f"What plate does {d} have?", f"What's the licence plate of {d}?"],
                   [f"Under what registration is {d}?"], [f"Which plate is on {d}?"]),
                _t([f"What plate did I say {d} has?"], [f"Which registration had I given for {d}?"],
                   [f"What did I tell you {d}'s plate was?"]),
                "{A}'s plate is {v}.", ("plate", "registration", "licence"))
    if attribute == "year":
        return (_t([f"{d} is from {{v}}", f"{d} was manufactured in {{v}}", f"{d} was made in {{v}}"],
                   [f"{d} rolled out of the factory in {{v}}"], [f"{d} dates from {{v}}"]),
                _t([f"Which year is {d} from?", f"When was {d} manufactured?", f"When was {d} made?"],
                   [f"In which year did {d} leave the factory?"], [f"Which model year is {d}?"]),
                _t([f"What year did I say {d} was from?"], [f"Which year had I named for {d}?"],
                   [f"When did I say {d} was built?"]),
                "{A} is from {v}.", ("year", "built", "made"))
    raise ValueError(f"unknown attribute {attribute!r}")


_ATTRIBUTE_FIELDS = {"age": "ages", "color": "colors", "breed": "breeds", "weight": "weights", "plate": "plates",
                     "year": "years"}


@lru_cache(maxsize=None)
def entity_slot(attribute: str, det: str, noun: str) -> Slot:
    """One attribute of a named thing that has several ("how old is my dog?" is answered with its age only); its
    name is `called_slot(det, noun)`."""
    d = f"{det} {noun}"
    states, asks, recalls, answer, keywords = _entity_templates(attribute, d)
    answer_det = {"my": "Your", "our": "Your"}.get(det, det.capitalize())
    return Slot(f"attr:{attribute}:{d}", _ATTRIBUTE_FIELDS[attribute], states, asks, recalls,
                answer.replace("{A}", f"{answer_det} {noun}"), (noun, *keywords))


def copy_mix_slots() -> list[Slot]:
    """Every slot the copy mix tells or asks about, with every determiner and noun it uses: for the checks that
    keep its phrasings apart (held-out, dev and trained ones; the hand-written set)."""
    slots = list(_COPY_SLOTS.values())
    for kinds in _ENTITY_NOUNS.values():
        for kind, nouns in kinds.items():
            for noun in nouns:
                for det in ("my", "our", "the"):
                    slots.append(called_slot(det, noun))
                    slots += [entity_slot(a, det, noun) for a in _ENTITY_ATTRIBUTES[kind]]
    return slots


def pronoun_clause(template: str, d: str, pronoun: tuple[str, str]) -> str | None:
    """A template that starts with `d` ("my dog is {v} old") said of it again in the same message ("he is {v}
    old", "his breed is {v}"); None for one that cannot be ("{v} is the name of my dog", "my dog, it is ...")."""
    if not template.startswith(d + " ") and not template.startswith(d + "'s "):
        return None
    rest = template[len(d):]
    if rest.startswith("'s ") and rest[3:].split(" ")[0] not in ("called", "a", "named", "now"):
        if rest[3:].startswith("name "):
            return None  # "his name is {v}" is a phrase of the hand-written set (tests/test_written_eval.py)
        return pronoun[1] + rest[2:]  # possessive: "my dog's age" -> "his age"
    return pronoun[0] + rest


# Facts told in passing, inside a longer sentence about something else: {c} the fact, {p} a place that is no value.
_IN_PASSING = _t(["we drove to the vet in {p} yesterday, and by the way {c}",
                  "I spent the whole morning in {p} sorting out paperwork; anyway, {c}",
                  "the kids were at their grandparents' place all weekend and the house was so quiet, oh and {c}",
                  "{c}, which came up when we were talking over lunch today",
                  "my cousin visited from {p} and we talked for hours; before I forget, {c}",
                  "after work I went for a long walk along the river, and I should mention that {c}"],
                 ["sorry for the slow reply, the plumber only left an hour ago; incidentally, {c}",
                  "we are back from a week in {p} with a suitcase full of laundry, and while I think of it, {c}",
                  "{c}, though honestly my head is still full of the exam I sat this morning"],
                 ["the car needed new tyres so I spent ages at the garage in {p}; side note, {c}",
                  "{c}, I only thought of it while cooking dinner just now",
                  "it snowed in {p} overnight and the trains stopped, but also {c}"])
COPY_WRAPPERS = (_IN_PASSING,)  # the copy mix's template groups beside its slots' (`copy_mix_slots`)

# British and American spellings (British first): the copy mix writes either, in facts and questions alike.
SPELLINGS = (("favourite", "favorite"), ("colour", "color"), ("neighbour", "neighbor"), ("theatre", "theater"),
             ("grey", "gray"), ("licence", "license"), ("mum", "mom"), ("tyre", "tire"), ("kilometre", "kilometer"))
_OTHER_SPELLING = {**dict(SPELLINGS), **{american: british for british, american in SPELLINGS}}
_SPELLING_RE = re.compile(r"\b(" + "|".join(_OTHER_SPELLING) + r")(s|'s)?\b", re.IGNORECASE)


def _other_spelling(m: re.Match) -> str:
    word = m.group(1)
    other = _OTHER_SPELLING[word.lower()]
    other = other.upper() if word.isupper() and len(word) > 1 else other.capitalize() if word[0].isupper() else other
    return other + (m.group(2) or "")


def _words_of(text: str) -> set[str]:
    return {w.strip(".,?!:;()-").lower() for w in text.split()}


def respell(text: str, rng: random.Random, avoid: frozenset[str] = frozenset()) -> str:
    """`text` as people type it: British and American spellings swapped (SPELLINGS), apostrophes left out
    ("whats", "dogs name"), a one-letter slip in a word of 4+ letters (`typo`); at least one of them where the text
    has a place for it, and no word of `avoid` that it did not have (a training chat gains no held-out value word:
    "our cat's name" does not become "cats", "grey" not "gray"). Values must be masked (`_PLACEHOLDERS`): a
    placeholder has no letters to change."""
    had = _words_of(text) & avoid
    for _ in range(8):
        out = _SPELLING_RE.sub(lambda m: _other_spelling(m) if rng.random() < 0.7 else m.group(0), text)
        words = out.split(" ")
        apostrophes = [i for i, w in enumerate(words) if "'" in w.strip("'")]
        if apostrophes and rng.random() < 0.5:
            for i in apostrophes if rng.random() < 0.3 else rng.sample(apostrophes, 1):
                words[i] = words[i][:1] + words[i][1:].replace("'", "", 1)
            out = " ".join(words)
        if rng.random() < 0.4:
            out = typo(out, rng)
        if out != text and not (_words_of(out) & avoid) - had:
            return out
    return text


def _mask(text: str, values: list[str]) -> str:
    for value, mark in sorted(zip(values, _PLACEHOLDERS), key=lambda vm: -len(vm[0])):
        text = text.replace(value, mark)
    return text


def _unmask(text: str, values: list[str]) -> str:
    for value, mark in zip(values, _PLACEHOLDERS):
        text = text.replace(mark, value)
    return text


# -- the copy mix's values --

_ALNUM = {"lower": "abcdefghijklmnopqrstuvwxyz", "upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "digits": "0123456789"}
_ALNUM["mixed"] = _ALNUM["lower"] + _ALNUM["upper"] + _ALNUM["digits"]
_CODE_STYLES = ("lower", "capitalised", "upper", "digits", "mixed", "code", "several words")
_CODE_WEIGHTS = (12, 12, 8, 10, 30, 18, 10)
# What `words` (training only) draws a share of the copy mix's random strings from: the kinds G copied least on the
# development set of random values, lower case 9 of 21 and several words 12 of 21, where a value looks like any word
# of the sentence around it (docs/embedded-model.md, "What G misses")
_WORD_STYLES = ("lower", "several words")
_NUMBER_WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
_DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
# The value fields the copy mix draws its own way (`copy_value`), beside the pools' and breeds.
COPY_VALUE_FIELDS = ("codes", "dates", "times", "years", "phones", "money", "weights", "distances", "heights",
                     "ages", "plates")


def held_out_value(value: str) -> bool:
    """Whether a value the copy mix makes belongs to held-out chats (one in seven, by the CRC-32 of its bytes):
    training chats never tell one, as numbers keep to their residue classes."""
    return zlib.crc32(value.encode()) % 7 == 3


@lru_cache(maxsize=1)
def _chat_words() -> frozenset[str]:
    """Every word of the generator's sentences, the copy mix's included: a random string is never one, so that it is
    found in a chat only where it was told."""
    texts = [*_FILLER, *_FILLER_HELDOUT, *POLITE_REPLIES, LIST_ACK, *_TOPICS, *_TOPICS_HELDOUT, *_TOPICS_DEV,
             *_NOUNS_TRAIN, *_NOUNS_HELDOUT, *_NOUNS_DEV, *_RELATIONS, *_SPARE_WORDS, *_MONTHS, *_WEEKDAYS,
             *_NUMBER_WORDS, *_OTHER_SPELLING]
    groups = [v for v in globals().values() if isinstance(v, Templates)]
    for slot in [*SLOTS, *copy_mix_slots()]:
        groups += [slot.states, slot.asks, slot.recalls]
        texts.append(slot.answer)
    for g in groups:
        texts += [*g.train, *g.heldout, *g.dev, *g.more]
    return frozenset(w.strip(".,?!:;()-'\"").lower() for t in texts for w in t.replace("{", " ").split())


def _random_word(rng: random.Random, style: str, length: int) -> str:
    if style == "capitalised":
        return rng.choice(_ALNUM["upper"]) + "".join(rng.choices(_ALNUM["lower"], k=length - 1))
    return "".join(rng.choices(_ALNUM[style], k=length))


def _cuts(rng: random.Random, length: int, parts: int, gap: int) -> list[int]:
    """Lengths of `parts` pieces (each 2+ characters) of `length` characters with `gap` between each two."""
    room = length - gap * (parts - 1)
    cuts = sorted(rng.sample(range(2, room - 1), parts - 1))
    while any(b - a < 2 for a, b in zip([0, *cuts], [*cuts, room])):
        cuts = sorted(rng.sample(range(2, room - 1), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, room])]


def random_code(rng: random.Random, held: bool = False, styles: tuple[str, ...] | None = None) -> str:
    """A random string of 2-16 characters: lower case, a capitalised word, capitals, digits, letters of both cases
    and digits mixed, a code of such pieces joined by '-' or '_' ("X7k-22Qa", "bq9_T"), or two or three words;
    no word of it a word of the generator's sentences or a held-out value (`_HELD_OUT_WORDS`); of `held`'s split
    (`held_out_value`). `styles` (of _CODE_STYLES): drawn from those alone, each as often."""
    while True:
        style = rng.choices(_CODE_STYLES, weights=_CODE_WEIGHTS)[0] if styles is None else rng.choice(styles)
        length = rng.randint(2, 16)
        if style == "code" and length >= 5:
            parts = rng.choice((2, 2, 3)) if length >= 8 else 2
            sep = rng.choice("-_")
            value = sep.join(_random_word(rng, rng.choice(("mixed", "mixed", "upper", "digits", "lower")), n)
                             for n in _cuts(rng, length, parts, 1))
        elif style == "several words" and length >= 5:
            parts = rng.choice((2, 2, 3)) if length >= 8 else 2
            word_style = rng.choice(("lower", "capitalised", "mixed"))
            value = " ".join(_random_word(rng, word_style, n) for n in _cuts(rng, length, parts, 1))
        else:
            value = _random_word(rng, style if style in _ALNUM or style == "capitalised" else "mixed", length)
        words = re.split(r"[ _-]", value)
        if any(w.lower() in _chat_words() or w.lower() in _HELD_OUT_WORDS for w in words):
            continue
        if held_out_value(value) == held:
            return value


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _date(rng: random.Random) -> str:
    """A date as people write it: "14 June", "June 14th", "the 14th of June", "14/06", "2024-06-14", ..."""
    month = rng.randrange(12)
    day, year, name = 1 + rng.randrange(_DAYS_IN_MONTH[month]), rng.randint(2019, 2031), _MONTHS[month]
    return rng.choice((f"{day} {name}", f"{name} {_ordinal(day)}", f"{_ordinal(day)} of {name}",
                       f"{day:02}/{month + 1:02}", f"{year}-{month + 1:02}-{day:02}", f"{day} {name} {year}",
                       f"{name[:3]} {day}", f"{name} {day}, {year}", f"{month + 1}/{day}/{year}",
                       f"{day}.{month + 1}.{year}"))


def _time(rng: random.Random) -> str:
    """A time as people write it: "3:45 pm", "3:45pm", "15:45", "9 am", "quarter past three", ..."""
    hour, minute = rng.randrange(24), rng.choice((0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, rng.randrange(60)))
    twelve, half = (hour + 11) % 12 + 1, "am" if hour < 12 else "pm"
    roll = rng.random()
    if roll < 0.15:
        return rng.choice((f"quarter past {_NUMBER_WORDS[twelve - 1]}", f"half past {_NUMBER_WORDS[twelve - 1]}",
                           f"quarter to {_NUMBER_WORDS[twelve % 12]}", f"{_NUMBER_WORDS[twelve - 1]} o'clock"))
    if roll < 0.3:
        return rng.choice((f"{twelve} {half}", f"{twelve}{half}", f"{twelve} {half.upper()}"))
    return rng.choice((f"{twelve}:{minute:02} {half}", f"{twelve}:{minute:02}{half}", f"{hour:02}:{minute:02}",
                       f"{hour}:{minute:02}", f"{twelve}:{minute:02} {half.upper()}", f"{hour}h{minute:02}"))


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(_ALNUM["digits"], k=n))


def _phone(rng: random.Random) -> str:
    """A phone-like number: "+44 20 7946 0958", "555-0143", "020 7946 0958", "(555) 014-3321", ..."""
    return rng.choice((f"+{rng.randint(1, 99)} {_digits(rng, 2)} {_digits(rng, 4)} {_digits(rng, 4)}",
                       f"555-{_digits(rng, 4)}", f"0{_digits(rng, 2)} {_digits(rng, 4)} {_digits(rng, 4)}",
                       f"({_digits(rng, 3)}) {_digits(rng, 3)}-{_digits(rng, 4)}",
                       f"{_digits(rng, 3)}-{_digits(rng, 3)}-{_digits(rng, 4)}",
                       f"+{rng.randint(1, 99)} {_digits(rng, 3)} {_digits(rng, 3)} {_digits(rng, 3)}",
                       f"0{_digits(rng, 3)} {_digits(rng, 6)}", _digits(rng, rng.randint(7, 11))))


def _number(rng: random.Random, low: float, high: float, decimals: int) -> str:
    """A number in [low, high], with `decimals` decimals at most (a trailing zero or a whole number at times)."""
    value = rng.uniform(low, high)
    places = rng.randint(0, decimals)
    text = f"{value:.{places}f}"
    return f"{int(value):,}" if places == 0 and value >= 1000 and rng.random() < 0.5 else text


def _amount(rng: random.Random, field: str) -> str:
    """An amount with its unit: "$40", "€12.50", "12.5 kg", "3 km", "1.82 m", ..."""
    if field == "money":
        n = _number(rng, 1, 3000, 2)
        return rng.choice((f"${n}", f"€{n}", f"£{n}", f"{n} euros", f"{n} dollars", f"{n} pounds", f"{n} EUR"))
    if field == "weights":
        return rng.choice((f"{_number(rng, 0.2, 60, 1)} kg", f"{_number(rng, 0.2, 60, 1)}kg",
                           f"{_number(rng, 50, 950, 0)} g", f"{_number(rng, 1, 120, 1)} lbs",
                           f"{_number(rng, 1, 60, 1)} kilos"))
    if field == "distances":
        return rng.choice((f"{_number(rng, 0.3, 90, 1)} km", f"{_number(rng, 0.3, 90, 1)}km",
                           f"{_number(rng, 1, 60, 1)} miles", f"{_number(rng, 100, 950, 0)} m",
                           f"{_number(rng, 1, 90, 1)} kilometres", f"{_number(rng, 1, 90, 1)} kilometers"))
    if field == "heights":
        feet, inches, cm = rng.randint(4, 6), rng.randint(0, 11), rng.randint(140, 205)
        return rng.choice((f"1.{rng.randint(40, 99)} m", f"{cm} cm", f"{cm}cm", f"{feet} ft {inches}",
                           f"{feet} feet {inches}"))
    raise ValueError(f"unknown amount field {field!r}")


def _plate(rng: random.Random) -> str:
    """A licence plate: "AB12 CDE", "KX-482-B", "7ABC123", ..."""
    def letters(n):
        return _random_word(rng, "upper", n)
    return rng.choice((f"{letters(2)}{_digits(rng, 2)} {letters(3)}", f"{letters(2)}-{_digits(rng, 3)}-{letters(1)}",
                       f"{_digits(rng, 1)}{letters(3)}{_digits(rng, 3)}",
                       f"{letters(1)} {_digits(rng, 4)} {letters(2)}", f"{letters(3)} {_digits(rng, 4)}"))


def copy_value(field: str, rng: random.Random, held: bool = False) -> str:
    """A value of one of COPY_VALUE_FIELDS in one of its common written forms, of `held`'s split
    (`held_out_value`); none spells a held-out value's word ("BEN 2103" is no plate: Ben is a held-out name)."""
    if field == "codes":
        return random_code(rng, held)
    while True:
        if field == "dates":
            value = _date(rng)
        elif field == "times":
            value = _time(rng)
        elif field == "years":
            value = str(rng.randint(1950, 2035))
        elif field == "phones":
            value = _phone(rng)
        elif field == "ages":
            value = rng.choice((f"{rng.randint(2, 19)} years", f"{rng.randint(2, 11)} months",
                                f"{rng.randint(3, 12)} weeks", f"{rng.randint(2, 19)} and a half years"))
        elif field == "plates":
            value = _plate(rng)
        else:
            value = _amount(rng, field)
        if any(w.lower() in _HELD_OUT_WORDS for w in re.split(r"[ _/.,:-]", value)):
            continue
        if held_out_value(value) == held:
            return value


@dataclass
class Question:
    round_index: int  # the round whose user message asks it
    kind: str  # single | corrected | multi
    position: str  # where the question sits in the user message: alone | begin | middle | end
    distance: int  # rounds between the question and the oldest round it needs
    keys: tuple[str, ...]
    values: tuple[str, ...]  # the latest value of each key: what the answer must contain
    stated: str = "plain"  # how the (first) fact was told: STATED_FAMILIES
    asked: str = "plain"  # how the question is asked: ASKED_FAMILIES

    @property
    def values_seen_in_training(self) -> bool:
        """Whether an answer is of a kind training chats use too: a birthday (a month and a day) or a meeting day (a
        weekday), the only values the two splits share (SHARED_VALUE_FIELDS); the evaluation can report them apart."""
        return any(slot_for(k).field in SHARED_VALUE_FIELDS for k in self.keys)

    @property
    def distance_bucket(self) -> str:
        low = 1
        for top in (4, 8, 16, 32):
            if self.distance <= top:
                return f"{low}-{top}"
            low = top + 1
        return "33+"


@dataclass
class OutOfScope:
    round_index: int
    kind: str  # OUT_OF_SCOPE_KINDS


@dataclass
class Dialogue:
    system: str | None
    phrasing: str = "train"
    rounds: list[Round] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    out_of_scope: list[OutOfScope] = field(default_factory=list)
    # What the user has told so far (key -> latest value) as each round begins: lets a benchmark cut the chat at any
    # round and ask about everything known there.
    known_before: list[dict[str, str]] = field(default_factory=list)

    def recall_rounds(self, upto: int) -> list[Round]:
        """One question per fact known before round `upto`, with the expected reply: asked at the end of the chat
        rounds[:upto], the way a user comes back to an old chat and asks about it."""
        return [Round(slot_for(k).canonical_ask, slot_for(k).reply(v))
                for k, v in sorted(self.known_before[upto].items())]


@dataclass
class _Known:
    value: str
    first: int  # round that first told it
    last: int  # round that last told or corrected it
    corrected: bool
    stated: str
    copy: bool = False  # told by the copy mix (a value to copy whatever it looks like): corrected the same way


class _Writer:
    """Writes one chat round by round; `known` is what the user has told so far."""

    def __init__(self, rng: random.Random, p: Pools, phrasing: str, dlg: Dialogue, noise: int = 0,
                 never_told: int = 25, wide: bool = False, mix: str | None = None, mix_share: float = 0.0,
                 talk: float = 0.0, requests: float = 0.0, subjects: float = 0.0, words: float = 0.0):
        self.rng, self.p, self.phrasing, self.dlg, self.noise = rng, p, phrasing, dlg, noise
        self.mix, self.mix_share = mix, mix_share  # the copy mix (issue 45): see `copy_statement`
        self.entities: dict[str, tuple[str, tuple[str, str]]] = {}  # the copy mix's things: "my dog": kind, he/his
        self.never_told = never_told  # the weight of questions about something never told among out-of-scope prompts
        self.wide = wide and phrasing == "train"  # training chats draw on every group's `more` phrasings too
        self.filler = _FILLER_HELDOUT if phrasing == "heldout" else _FILLER  # small talk
        # training chats only: the share of small-talk sentences written by engine/data/small_talk.py's grammar
        self.talk = talk if phrasing == "train" else 0.0
        # training chats only: the share of requests written by engine/data/small_talk.py's request grammar
        self.requests = requests if phrasing == "train" else 0.0
        # training chats with the copy mix only: the share of its facts about anything (`open_fact`)
        self.subjects = subjects if phrasing == "train" and mix and p.synthetic else 0.0
        # training chats with the copy mix only: the share of its random strings that look like words (_WORD_STYLES)
        self.words = words if phrasing == "train" and mix and p.synthetic else 0.0
        self.known: dict[str, _Known] = {}
        self.last_single: str | None = None  # the key the previous round told alone (for "actually, it's ...")

    def pick(self, templates: Templates) -> str:
        return templates.pick(self.phrasing, self.rng, self.wide)

    def small_talk(self, n: int) -> list[str]:
        """`n` sentences of small talk: from the chat's fixed ones, or (training with `talk`) that share of them
        written by the grammar. Without `talk` the draws are exactly those of before."""
        if not self.talk:
            return self.rng.sample(self.filler, n)
        return [everyday_sentence(self.rng) if self.rng.random() < self.talk else self.rng.choice(self.filler)
                for _ in range(n)]

    # -- values and slots --
    def value(self, slot: Slot) -> str:
        rng = self.rng
        if slot.field == "birthdays":
            return f"{rng.choice(_MONTHS)} {1 + rng.randrange(28)}"
        if slot.field == "weekdays":
            return rng.choice(_WEEKDAYS)
        return self.p.pick(slot.field, rng)

    def fresh_slot(self) -> Slot | None:
        rng = self.rng
        if rng.random() < 0.35:
            for _ in range(8):
                det = rng.choice(("my", "my", "our", "the"))
                slot = called_slot(det, self.noun())
                if not any(k.endswith(" " + slot.key.split(" ", 1)[1]) for k in self.known):
                    return slot
        free = [s for s in SLOTS if s.key not in self.known]
        return rng.choice(free) if free else None

    def noun(self) -> str:
        if self.phrasing != "train":
            return self.rng.choice(_NOUNS_HELDOUT if self.phrasing == "heldout" else _NOUNS_DEV)
        made_up = 0.5 if self.noise >= 2 else 0.25  # a made-up noun teaches copying the noun, not knowing it
        return pseudo_word(self.rng) if self.rng.random() < made_up else self.rng.choice(_NOUNS_TRAIN)

    def clause(self, slot: Slot, value: str, random_value: bool = False) -> str:
        template = self.pick(slot.states)
        while template.startswith("{v}") and (random_value or slot.field in ("colors", "foods", "animals")):
            template = self.pick(slot.states)  # "Crows are ..." would recase it ("xk9 is ..." too)
        if self.rng.random() < 0.15:
            template = template.lower()  # typed in lower case; the value stays as typed
        return template.replace("{v}", value)

    def with_spare_words(self, text: str, value: str = "") -> str:
        """Training noise: a word or two that changes nothing ("really", "just") put somewhere, so that the model
        keys on what is asked, not on the exact sentence."""
        if not self.noise or self.rng.random() > 0.3:
            return text
        words = (text.replace(value, "\0") if value else text).split(" ")  # a value of two words stays whole
        for _ in range(self.rng.choice((1, 1, 2))):
            words.insert(self.rng.randrange(1, len(words) + 1), self.rng.choice(_SPARE_WORDS))
        return " ".join(words).replace("\0", value)

    def with_frame_noise(self, text: str, protect: tuple[str, ...]) -> str:
        """Training noise, levels 2 (one edit) and 3-5 (two): a word of the sentence's frame (not a word of
        `protect`: the value and the words that say what is told or asked) replaced by a made-up one, a made-up
        word put in, a word left out, or a punctuation mark typed differently; so that a sentence built around
        words the model never saw ("I reside in X", "Any clue about my ...") is still read by what it is about
        and where the value stands."""
        for _ in range(min(self.noise, 3) - 1):
            text = self._frame_edit(text, protect)
        return text

    def _frame_edit(self, text: str, protect: tuple[str, ...]) -> str:
        rng = self.rng
        keep = {w.lower() for p in protect for w in p.split()}
        words = text.split(" ")
        free = [i for i, w in enumerate(words) if _bare(w) not in keep and not any(c.isdigit() for c in w)]
        roll = rng.random()
        if free and roll < 0.2:
            i = rng.choice(free)
            word = self.odd_word()
            words[i] = (word.capitalize() if words[i][:1].isupper() else word) + _trailing_marks(words[i])
        elif roll < 0.3:  # never next to a protected word: "my giltryroa podcast" would not say which is the noun
            spots = [j for j in range(len(words) + 1)
                     if all(_bare(w) not in keep for w in words[max(0, j - 1): j + 1])]
            if spots:
                j, word = rng.choice(spots), self.odd_word()
                if self.noise >= 4 and j == 0:  # "Btw, what is ...": an unknown first word is capitalised too
                    word = word.capitalize()
                    if words[0] != "I" and not words[0].startswith("I'"):
                        words[0] = words[0][:1].lower() + words[0][1:]
                words.insert(j, word)
        elif free and roll < 0.38 and len(words) > 3:
            i = rng.choice(free)
            marks = _trailing_marks(words.pop(i))
            if marks and i > 0:
                words[i - 1] = words[i - 1].rstrip(".,?!:;") + marks
        text = " ".join(words)
        marks = [j for j, c in enumerate(text) if c in ".,?!:;"]
        if marks and rng.random() < 0.1:
            j = rng.choice(marks)
            text = text[:j] + rng.choice(("", ",", ".", ";", ":", " -", "!", "?")) + text[j + 1:]
        return text

    def odd_word(self) -> str:
        """A word that says nothing about what is told or asked: made up, or at level 5 half the time an everyday
        one ("park", "yesterday"), since the sentences people write are built of real words."""
        if self.noise >= 5 and self.rng.random() < 0.5:
            return self.rng.choice(_FILLER_WORDS)
        return pseudo_word(self.rng)

    def with_tail(self, text: str) -> str:
        """Training noise, level 4: a closer of two or three words the model does not know (made-up and spare
        words) before the question's last mark, the answer unchanged ("What is my name blorf so?"): a question that
        ends in a phrase never seen ("... if you know?") asks one thing, not two. Level 6: four questions in ten,
        and the words made up or everyday ones ("What is my name park yesterday?")."""
        rng = self.rng
        end = text[len(text.rstrip("?.!")):]
        unknown = self.odd_word if self.noise >= 6 else lambda: pseudo_word(rng)
        words = [unknown() if rng.random() < 0.6 else rng.choice(_SPARE_WORDS)
                 for _ in range(rng.choice((2, 2, 3)))]
        return text[: len(text) - len(end)] + rng.choice((" ", ", ")) + " ".join(words) + end

    def with_made_up_word(self, text: str) -> str:
        """Training noise, levels 2-4, for prompts that state nothing: a made-up word put in, capitalised at times
        ("Blorf thanks!"), so that the frame noise of facts does not teach that any sentence with a word the model
        never saw tells a fact."""
        rng = self.rng
        words = text.split(" ")
        i = rng.randrange(len(words) + 1)
        word = self.odd_word()
        if i == 0 and words[0] != "I":
            words[0] = words[0][:1].lower() + words[0][1:]
        words.insert(i, word.capitalize() if i == 0 or rng.random() < 0.3 else word)
        return " ".join(words)

    def with_unknown_words(self, text: str) -> str:
        """Training noise for prompts that state nothing: a word or two replaced by made-up ones, so that a word the
        model has never seen is not taken for a name to remember."""
        words = text.split(" ")
        if not self.noise or self.rng.random() > 0.5 or len(words) < 3:  # a short prompt is all signal
            return text
        for _ in range(self.rng.choice((1, 1, 2))):
            i = self.rng.randrange(len(words))
            word = self.odd_word()
            words[i] = (word.capitalize() if i == 0 or self.rng.random() < 0.3 else word) + \
                "".join(c for c in words[i][-1:] if c in ".,?!")
        return " ".join(words)

    def styled(self, text: str) -> str:
        """Out-of-scope prompts are typed carelessly too."""
        text = self.with_unknown_words(text)
        if self.noise >= 2 and self.rng.random() < 0.3:
            text = self.with_made_up_word(text)
        roll = self.rng.random()
        if roll < 0.1:
            return text.lower()
        if roll < 0.2:
            typed = typo(text, self.rng)
            # a slip that makes a held-out word ("been" -> "Ben") is not typed in a training chat
            return text if _words_of(typed) & self.unseen_words() - _words_of(text) else typed
        return text

    def dressed(self, text: str, openers: Templates, closers: Templates) -> str:
        """`text` (a sentence ending in . ? or !) with an opener before it and a closer before its last mark."""
        end = text[-1] if text[-1:] in ".?!" else ""
        body = text[: len(text) - len(end)]
        opener = self.pick(openers)
        if opener and body[:2] not in ("I ", "I'") and body[1:2].islower():
            body = body[0].lower() + body[1:]
        return opener + body + self.pick(closers) + end

    # -- rounds --
    def statement(self, i: int) -> Round:
        rng = self.rng
        slots = []
        for _ in range(rng.choice((2, 2, 3)) if rng.random() < 0.2 else 1):
            slot = self.fresh_slot()
            if slot is not None and slot.key not in [s.key for s in slots]:
                slots.append(slot)
        if not slots:
            return self.chatter()
        random_values = bool(self.mix) and rng.random() < GENERATOR_RANDOM_SHARE
        values = [random_code(rng, not self.p.synthetic) if random_values and s.field not in SHARED_VALUE_FIELDS
                  else self.value(s) for s in slots]
        clauses = [self.clause(s, v, random_values) for s, v in zip(slots, values)]
        if len(slots) > 1:
            clauses = [self.with_frame_noise(c, (*s.keywords, v)) for c, s, v in zip(clauses, slots, values)]
        if len(slots) > 1:
            template = self.pick(_LIST)
            while ("{c}" in template or "{C}" in template) != (len(slots) == 3):
                template = self.pick(_LIST)
            parts = dict(zip("abc", clauses))
            text = template.format(a=_cap(parts["a"]), b=parts["b"], c=parts.get("c", ""), B=_cap(parts["b"]),
                                   C=_cap(parts.get("c", "")))
            family, reply = "list", LIST_ACK
        elif rng.random() < 0.4:
            text = self.pick(_REMEMBER).format(c=clauses[0])
            family, reply = "remember", slots[0].ack(values[0])
        else:
            text, family, reply = _cap(clauses[0]) + ".", "plain", slots[0].ack(values[0])
        if len(slots) == 1 and not text.startswith(values[0]):
            text = _cap(self.dressed(text, _OPENERS, _CLOSERS))
        if len(slots) == 1:
            text = self.with_frame_noise(self.with_spare_words(text, values[0]), (*slots[0].keywords, values[0]))
        if self.mix:
            text = self.respelled(text, values)
        for s, v in zip(slots, values):
            self.known[s.key] = _Known(v, i, i, False, "called" if s.key.startswith("called:") else family,
                                       copy=random_values)  # corrected with another random string
        self.last_single = slots[0].key if len(slots) == 1 else None
        return Round(text, reply)

    def correction(self, i: int) -> Round:
        rng = self.rng
        short = self.last_single is not None and rng.random() < 0.5
        key = self.last_single if short else rng.choice(list(self.known))
        if self.mix and self.known[key].copy:
            return self.copy_correction(i, key, short)
        slot, old = slot_for(key), self.known[key].value
        new = self.value(slot)
        if new == old:
            return self.chatter()
        if short:
            text = self.pick(_CORRECT_SHORT).format(v=new, old=old)
        else:
            text = self.pick(_CORRECT_FULL).format(c=self.clause(slot, new), old=old)
        text = self.with_frame_noise(text, (*slot.keywords, new, old))
        known = self.known[key]
        self.known[key] = _Known(new, known.first, i, True, "correction")
        self.last_single = None
        return Round(_cap(text), slot.ack(new))

    def question_text(self, slot: Slot, asked: str) -> str:
        rng = self.rng
        text = self.pick(slot.recalls if asked == "what_did_i_say" else slot.asks)
        text = self.with_spare_words(_cap(self.dressed(text, _ASK_OPENERS, _ASK_CLOSERS)))
        text = self.with_frame_noise(text, slot.keywords)
        if self.noise >= 4 and rng.random() < (0.4 if self.noise >= 6 else 0.25):
            text = self.with_tail(text)
        if asked == "no_question_mark":
            text = text.rstrip("?.")
        elif asked == "lower_case":
            text = text.lower()
        elif asked == "typo":
            text = typo(text, rng, protect=tuple(slot.key.split(" ")[1:]))
        return text

    def asked_family(self) -> str:
        return self.rng.choices(ASKED_FAMILIES, weights=(35, 20, 15, 15, 15))[0]

    def question(self, i: int, askable: list[str]) -> Round:
        rng = self.rng
        corrected = [k for k in askable if self.known[k].corrected]
        if len(askable) >= 2 and rng.random() < 0.2:
            keys, kind = tuple(rng.sample(askable, 2)), "multi"
        elif corrected and rng.random() < 0.5:
            keys, kind = (rng.choice(corrected),), "corrected"
        else:
            keys = (rng.choice(askable),)
            kind = "corrected" if self.known[keys[0]].corrected else "single"
        asked = "plain" if kind == "multi" else self.asked_family()
        slots = [slot_for(k) for k in keys]
        answers = [s.reply(self.known[k].value) for s, k in zip(slots, keys)]
        if kind == "multi":
            asks = [self.pick(s.asks).removeprefix("And ") for s in slots]
            if self.phrasing == "heldout":
                join = _TWO_QUESTIONS_HELDOUT[0]
            else:
                join = rng.choice(_TWO_QUESTIONS) if self.wide else _TWO_QUESTIONS[0]
            question = self.with_frame_noise(join.format(a=asks[0][:-1], a_end=asks[0][-1], B=asks[1],
                                                         b=f"{asks[1][0].lower()}{asks[1][1:]}"),
                                             (*slots[0].keywords, *slots[1].keywords))
            reply = f"{answers[0][:-1]}, and {answers[1][0].lower()}{answers[1][1:]}"
        else:
            question, reply = self.question_text(slots[0], asked), answers[0]
        if self.mix:
            question, asked = self.respelled_question(question, asked)
        position = rng.choice(POSITIONS)
        distance = i - min(self.known[k].last if kind == "corrected" else self.known[k].first for k in keys)
        self.dlg.questions.append(Question(i, kind, position, distance, keys,
                                           tuple(self.known[k].value for k in keys),
                                           self.known[keys[0]].stated, asked))
        self.last_single = None
        return Round(_ask(question, position, self.small_talk), reply)

    def out_of_scope(self, i: int) -> Round:
        rng = self.rng
        kind = rng.choices(OUT_OF_SCOPE_KINDS, weights=(20, 20, 35, self.never_told))[0]
        if kind == "unknown":
            slot = (self.mix and rng.random() < 0.5 and self.unknown_copy_slot()) or self.unknown_slot()
            text, reply = self.question_text(slot, self.asked_family()), UNKNOWN_REPLY
            if self.mix:
                text = self.respelled_question(text, "plain")[0]
        elif kind == "request":
            topics = {"train": _TOPICS, "heldout": _TOPICS_HELDOUT, "dev": _TOPICS_DEV}[self.phrasing]
            if self.requests and rng.random() < self.requests:
                text = everyday_request(rng, topics)
            else:
                text = self.pick(_REQUESTS).format(
                    t=rng.choice(topics), a=rng.randint(2, 99), b=rng.randint(2, 99), r=rng.choice(_RELATIONS))
            text, reply = self.styled(text), DEMO_REPLY
        else:
            text = self.pick(_GREETINGS if kind == "greeting" else _THANKS)
            text, reply = self.styled(text), GREETING_REPLY if kind == "greeting" else THANKS_REPLY
        self.dlg.out_of_scope.append(OutOfScope(i, kind))
        self.last_single = None
        return Round(text, reply)

    def unknown_slot(self) -> Slot:
        free = [s for s in SLOTS if s.key not in self.known]
        if free and self.rng.random() < 0.6:
            return self.rng.choice(free)
        while True:
            slot = called_slot(self.rng.choice(("my", "our", "the")), self.noun())
            if slot.key not in self.known:
                return slot

    def chatter(self) -> Round:
        self.last_single = None
        if self.noise and self.rng.random() < 0.15:  # a word the model never saw, said alone: not a fact
            words = [pseudo_word(self.rng) for _ in range(self.rng.choice((1, 1, 2)))]
            return Round(_cap(" ".join(words)) + self.rng.choice(("!", ".", "", " :)")), CHATTER_REPLY)
        text = " ".join(self.small_talk(self.rng.choice((1, 2))))
        return Round(self.with_unknown_words(text), CHATTER_REPLY)

    # -- the copy mix (issue 45) --
    def copy_statement(self, i: int) -> Round:
        """A fact of the copy mix: a random string told as a name, city, code and the like (`random_code`); a date,
        time, year, phone number or amount in one of its written forms (`copy_value`); or one to three attributes
        of a named thing ("My dog is called Bq9-Tt, he is 7 years old and a beagle."), each asked on its own later.
        Told plainly, wrapped ("remember that ..."), as a list, or in passing inside a longer sentence
        (`_IN_PASSING`); the values are masked while the words around them change (noise, `respell`), so that
        they stay byte for byte what the replies copy."""
        rng = self.rng
        if self.subjects and rng.random() < self.subjects:
            facts = self.open_fact()
        else:
            kind = rng.choices(("random", "forms", "entity"), weights=(35, 30, 35))[0]
            facts = self.entity_facts() if kind == "entity" else self.copy_fact(kind)
        if not facts:
            return self.chatter()
        values = [v for _, v in facts]
        marks = list(_PLACEHOLDERS[:len(facts)])
        d = _thing(facts[0][0].key)
        pronoun = self.entities[d][1] if d in self.entities and len(facts) > 1 else None
        clauses = [self.copy_clause(slot, mark, pronoun if j and rng.random() < 0.8 else None)
                   for j, ((slot, _), mark) in enumerate(zip(facts, marks))]
        if len(facts) > 1:
            clauses = [self.with_frame_noise(c, (*s.keywords, m)) for c, (s, _), m in zip(clauses, facts, marks)]
            template = self.pick(_LIST)
            while ("{c}" in template or "{C}" in template) != (len(facts) == 3):
                template = self.pick(_LIST)
            parts = dict(zip("abc", clauses))
            text = template.format(a=_cap(parts["a"]), b=parts["b"], c=parts.get("c", ""), B=_cap(parts["b"]),
                                   C=_cap(parts.get("c", "")))
            family, reply = "list", LIST_ACK
        else:
            slot = facts[0][0]
            roll = rng.random()
            if roll < 0.3:
                text = _cap(self.pick(_IN_PASSING).format(c=clauses[0], p=self.place(values))) + "."
                family = "in_passing"
            elif roll < 0.58:
                text, family = self.pick(_REMEMBER).format(c=clauses[0]), "remember"
            else:
                text, family = _cap(clauses[0]) + ".", "plain"
            if family != "in_passing":
                text = _cap(self.dressed(text, _OPENERS, _CLOSERS))
            text = self.with_frame_noise(self.with_spare_words(text), (*slot.keywords, marks[0]))
            reply = slot.ack(values[0])
        if rng.random() < 0.35:
            text = respell(text, rng, self.unseen_words())
        for slot, value in facts:
            stated = "called" if slot.key.startswith("called:") and family != "in_passing" else family
            self.known[slot.key] = _Known(value, i, i, False, stated, copy=True)
        self.last_single = facts[0][0].key if len(facts) == 1 else None
        return Round(_unmask(text, values), reply)

    def copy_clause(self, slot: Slot, mark: str, pronoun: tuple[str, str] | None = None) -> str:
        """A clause telling `slot`'s value (`mark` standing for it); with `pronoun`, of a thing the same message
        named already ("he is {v} old")."""
        template = self.pick(slot.states)
        if pronoun is not None:
            d = _thing(slot.key)
            for _ in range(20):
                said_again = pronoun_clause(template, d, pronoun)
                if said_again is not None:
                    template = said_again
                    break
                template = self.pick(slot.states)
        if self.rng.random() < 0.15:
            template = template.lower()  # typed in lower case; the value stays as typed
        return template.replace("{v}", mark)

    def place(self, values: list[str]) -> str:
        """A place a fact in passing mentions: a made-up or held-out city, as the split's pools give, that is no
        value of the chat."""
        taken = set(values) | {k.value for k in self.known.values()}
        while True:
            place = self.p.pick("cities", self.rng)
            if place not in taken:
                return place

    def copy_fact(self, kind: str) -> list[tuple[Slot, str]]:
        """One fact: with `kind` "random" a random string in a slot of the generator's (a name, a city, a named
        thing ...) or a code's; "forms" a date, time, year, phone number or amount."""
        rng = self.rng
        if kind == "forms":
            free = [s for s in _COPY_SLOTS.values() if s.field != "codes" and s.key not in self.known]
        elif rng.random() < 0.3:
            slot = self.free_called_slot()
            free = [slot] if slot is not None else []
        elif rng.random() < 0.5:
            free = [s for s in SLOTS if s.field not in SHARED_VALUE_FIELDS and s.key not in self.known]
        else:
            free = [s for s in _COPY_SLOTS.values() if s.field == "codes" and s.key not in self.known]
        if not free:
            return []
        slot = rng.choice(free)
        return [(slot, self.copy_value_of(slot, kind == "random"))]

    _OPEN_FIELDS = ("codes", "dates", "times", "phones", "money", "years")
    _OPEN_WEIGHTS = (60, 10, 8, 8, 8, 6)

    def open_subject(self) -> tuple[str, str]:
        """A determiner and a subject about anything (engine.data.open_facts) that no fact of the chat shares a
        word of its subject with (so that a question about one never fits two)."""
        told = {w for k in self.known if k.startswith("open:") for w in slot_for(k).keywords}
        while True:
            subject = open_facts.subject(self.rng, pseudo_word, _OPEN_AVOID)
            if not told & set(subject.split()):
                return self.rng.choice(open_facts.DETERMINERS), subject

    def open_fact(self) -> list[tuple[Slot, str]]:
        """A fact about anything: an open subject (`open_subject`) with a value of one of the copy mix's kinds,
        a random string most often."""
        det, subject = self.open_subject()
        field_name = self.rng.choices(self._OPEN_FIELDS, weights=self._OPEN_WEIGHTS)[0]
        slot = open_slot(det, subject, field_name)
        return [(slot, self.copy_value_of(slot, True))]

    def free_called_slot(self) -> Slot | None:
        """A named thing whose noun no fact of the chat names yet (as `fresh_slot` picks one)."""
        for _ in range(8):
            slot = called_slot(self.rng.choice(("my", "my", "our", "the")), self.noun())
            noun = slot.key.split(" ", 1)[1]
            if not any(k.endswith(" " + noun) for k in self.known) and not any(
                    e.endswith(" " + noun) for e in self.entities):
                return slot
        return None

    def entity_facts(self) -> list[tuple[Slot, str]]:
        """One more attribute of a named thing the chat told some of, or a new thing with one to three of its
        attributes (a name among them at times): the first said of "my dog", the others of "he" most times."""
        rng = self.rng
        untold = {d: [a for a in ("name", *_ENTITY_ATTRIBUTES[kind]) if _entity_key(a, d) not in self.known]
                  for d, (kind, _) in self.entities.items()}
        untold = {d: attrs for d, attrs in untold.items() if attrs}
        if untold and rng.random() < 0.35:
            d = rng.choice(list(untold))
            attributes = [rng.choice(untold[d])]
        else:
            kind = rng.choice(("pets", "vehicles"))
            noun = self.entity_noun(kind)
            if noun is None:
                return self.copy_fact("forms")
            d = f"{rng.choice(('my', 'my', 'our', 'the'))} {noun}"
            self.entities[d] = (kind, rng.choice(_PRONOUNS[kind]))
            attributes = rng.sample(("name", *_ENTITY_ATTRIBUTES[kind]), rng.choices((1, 2, 3), (35, 35, 30))[0])
        facts: list[tuple[Slot, str]] = []
        for attribute in attributes:
            slot = slot_for(_entity_key(attribute, d))
            value = self.copy_value_of(slot, False, [v for _, v in facts])
            facts.append((slot, value))
        return facts

    def entity_noun(self, kind: str) -> str | None:
        """A noun for a new named thing of `kind` that no fact of the chat names yet: the phrasing's (_ENTITY_NOUNS),
        or in training at times a made-up one, which teaches reading the attribute, not knowing the noun."""
        rng = self.rng
        for _ in range(8):
            made_up = self.phrasing == "train" and rng.random() < (0.5 if self.noise >= 2 else 0.25)
            noun = pseudo_word(rng) if made_up else rng.choice(_ENTITY_NOUNS[self.phrasing][kind])
            if not any(k.endswith(" " + noun) for k in self.known) and not any(
                    e.endswith(" " + noun) for e in self.entities):
                return noun
        return None

    def copy_value_of(self, slot: Slot, random_string: bool, taken: list[str] = ()) -> str:
        """A value for `slot` no fact of the chat has: its field's written forms (COPY_VALUE_FIELDS), a breed, a
        named thing's color from the pools; else a random string (`random_string`, or half the time) or the
        pools' value."""
        rng, held = self.rng, not self.p.synthetic
        taken = {*taken, *(k.value for k in self.known.values())}
        for _ in range(50):
            if slot.field in COPY_VALUE_FIELDS:
                value = copy_value(slot.field, rng, held)
            elif slot.field == "breeds":
                value = rng.choice(_BREEDS) if held else pseudo_word(rng)
                if not held and value in _BREEDS:
                    continue
            elif slot.key.startswith("attr:") or not (random_string or rng.random() < 0.5):
                value = self.p.pick(slot.field, rng)
            elif self.words and rng.random() < self.words:  # (drawn only where there is a share: without one,
                value = random_code(rng, held, _WORD_STYLES)    # the chats of before byte for byte)
            else:
                value = random_code(rng, held)
            if value not in taken:
                break
        return value

    def copy_correction(self, i: int, key: str, short: bool) -> Round:
        """A correction of a copy-mix fact: a new value of its kind, the values masked while the words change."""
        rng = self.rng
        slot, old = slot_for(key), self.known[key].value
        new = self.copy_value_of(slot, slot.field not in COPY_VALUE_FIELDS and not key.startswith("attr:"))
        if new == old:
            return self.chatter()
        marks = list(_PLACEHOLDERS[:2])
        if short:
            text = self.pick(_CORRECT_SHORT).format(v=marks[0], old=marks[1])
        else:
            text = self.pick(_CORRECT_FULL).format(c=self.copy_clause(slot, marks[0]), old=marks[1])
        text = _cap(self.with_frame_noise(text, (*slot.keywords, *marks)))
        if rng.random() < 0.35:
            text = respell(text, rng, self.unseen_words())
        known = self.known[key]
        self.known[key] = _Known(new, known.first, i, True, "correction", copy=True)
        self.last_single = None
        return Round(_unmask(text, [new, old]), slot.ack(new))

    def unknown_copy_slot(self) -> Slot | None:
        """Something never told, asked in a copy-mix chat: most often an attribute of a named thing the chat told
        others of ("How old is my dog?" when only its name was told), else a fact of the copy mix's."""
        if self.subjects and self.rng.random() < 0.4:  # a subject about anything, never told
            det, subject = self.open_subject()
            return open_slot(det, subject, "codes")
        untold = [_entity_key(a, d) for d, (kind, _) in self.entities.items()
                  for a in ("name", *_ENTITY_ATTRIBUTES[kind]) if _entity_key(a, d) not in self.known]
        if untold and self.rng.random() < 0.7:
            return slot_for(self.rng.choice(untold))
        free = [s for s in _COPY_SLOTS.values() if s.key not in self.known]
        return self.rng.choice(free) if free else None

    def respelled(self, text: str, values: list[str]) -> str:
        """A fact of the copy mix's chats typed with the other spelling, an apostrophe left out or a slip, a third
        of the time; never inside a value."""
        if self.rng.random() >= 0.35:
            return text
        return _unmask(respell(_mask(text, values), self.rng, self.unseen_words()), values)

    def respelled_question(self, text: str, asked: str) -> tuple[str, str]:
        """A question of the copy mix's chats typed the same way, a third of the time: its family "respelled"."""
        if self.rng.random() >= 0.35:
            return text, asked
        typed = respell(text, self.rng, self.unseen_words())
        return typed, "respelled" if typed != text else asked

    def unseen_words(self) -> frozenset[str]:
        """The words a chat of this split must never gain: a training chat, the held-out values (and breeds)."""
        return _HELD_OUT_WORDS if self.p.synthetic else frozenset()


def _entity_key(attribute: str, d: str) -> str:
    return f"called:{d}" if attribute == "name" else f"attr:{attribute}:{d}"


def _thing(key: str) -> str:
    """The named thing a key is about ("my dog" for "attr:age:my dog" and "called:my dog"), else ""."""
    if key.startswith("called:"):
        return key.removeprefix("called:")
    if key.startswith("attr:"):
        return key.split(":", 2)[2]
    return ""


def _bare(word: str) -> str:
    return word.strip(".,?!:;()-").removesuffix("'s").lower()


def _trailing_marks(word: str) -> str:
    return word[len(word.rstrip(".,?!:;")):]


def _ask(question: str, position: str, small_talk: Callable[[int], list[str]]) -> str:
    """The question with small talk before, after or around it (`position`; two sentences a side)."""
    if position == "alone":
        return question
    before, after = " ".join(small_talk(2)), " ".join(small_talk(2))
    if position == "begin":
        return f"{question} {before} {after}"
    if position == "end":
        return f"{before} {after} {question}"
    return f"{before} {question} {after}"


def make_dialogue(rng: random.Random, p: Pools, n_rounds: int, with_system: bool = True,
                  phrasing: str = "train", noise: int = 0, never_told: int = 25, wide: bool = False,
                  mix: str | None = None, mix_share: float = COPY_SHARE, talk: float = 0.0,
                  requests: float = 0.0, subjects: float = 0.0, words: float = 0.0) -> Dialogue:
    """A chat of n_rounds: facts, corrections, questions placed after what they ask about, out-of-scope prompts and
    small talk. `noise` (training only): 1 adds spare words to facts and questions and made-up words to the rest;
    2 also puts made-up words into, and leaves words out of, the frames of facts and questions (`with_frame_noise`)
    and makes half the named things made-up nouns; 3 makes two such edits; 4 also ends a quarter of the questions
    in words the model does not know (`with_tail`) and capitalises a made-up first word; 5 makes half of the words
    put in everyday ones (`odd_word`); 6 also ends four questions in ten in such words. `never_told` weighs
    questions about something never told among the out-of-scope prompts (greetings 20, thanks 20, requests 35).
    `wide` (training only) adds every template group's `more` phrasings to the trained ones. `mix` "copy" makes a
    `mix_share` of the facts told the copy mix's (`_Writer.copy_statement`); None leaves the chat as it always was.
    `talk` (training only) is the share of small-talk sentences written by engine/data/small_talk.py's grammar,
    `requests` (training only) the share of requests written by its request grammar, `subjects` (training with the
    copy mix only) the share of the mix's facts that are about anything (engine.data.open_facts), `words` (the
    same) the share of its random strings drawn as lower-case words or several words (_WORD_STYLES)."""
    dlg = Dialogue(SYSTEM_PROMPT if with_system else None, phrasing)
    w = _Writer(rng, p, phrasing, dlg, noise, never_told, wide, mix, mix_share, talk, requests, subjects, words)
    for i in range(n_rounds):
        dlg.known_before.append({k: v.value for k, v in w.known.items()})
        roll = rng.random()
        askable = [k for k, v in w.known.items() if i - v.first >= 1]
        if askable and (roll < 0.25 or i >= n_rounds - 2):
            rnd = w.question(i, askable)
        elif w.known and roll < 0.36:
            rnd = w.correction(i)
        elif roll < 0.64:
            rnd = w.copy_statement(i) if mix and rng.random() < mix_share else w.statement(i)
        elif roll < 0.86:
            rnd = w.out_of_scope(i)
        else:
            rnd = w.chatter()
        dlg.rounds.append(rnd)
    dlg.known_before.append({k: v.value for k, v in w.known.items()})
    return dlg


def dialogues(split: str, count: int, seed: int, min_rounds: int, max_rounds: int,
              phrasing: str = "train", noise: int = 0, never_told: int = 25, wide: bool = False,
              mix: str | None = None, mix_share: float = COPY_SHARE, talk: float = 0.0,
              requests: float = 0.0, subjects: float = 0.0, words: float = 0.0) -> list[Dialogue]:
    """`count` chats: values from `split`'s pools ("train" or "heldout"), sentences from `phrasing`'s templates
    (PHRASINGS). The benchmarks and calibrations use held-out values in trained phrasings; `kvchat eval` any.
    `mix` (MIXES; None: none) adds a mix of other facts (`make_dialogue`), drawn from a stream of its own for each
    split and phrasing; without it the chats are the ones these arguments always gave."""
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r} (accepted: {', '.join(PHRASINGS)})")
    if mix is not None and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (accepted: {', '.join(MIXES)})")
    if mix is not None and not 0 <= mix_share <= 1:
        raise ValueError(f"mix_share must be within 0-1, not {mix_share}")
    for share, what in ((talk, "talk"), (requests, "requests"), (subjects, "subjects"), (words, "words")):
        if not 0 <= share <= 1:
            raise ValueError(f"{what} must be within 0-1, not {share}")
    if mix is None:
        rng = random.Random(f"{split}:{seed}" if phrasing == "train" else f"{split}:{phrasing}:{seed}")
    else:
        rng = random.Random(f"{split}:{phrasing}:{mix}:{seed}")
    p = pools(split)
    return [make_dialogue(rng, p, rng.randint(min_rounds, max_rounds), rng.random() < 0.8, phrasing, noise,
                          never_told, wide, mix, mix_share, talk, requests, subjects, words) for _ in range(count)]
