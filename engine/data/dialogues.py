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
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

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


def _attribute(key: str, x: str, field: str, plural: bool = False, extra_states=((), (), (), ())) -> Slot:
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
           + ([f"What's my {x}?"] if not plural else []),
           [f"Do you happen to know my {x}?", f"I forgot my {x}. What {be} {it}?", f"Any clue about my {x}?",
            f"My {x}, what {be} {it}?"],
           [f"Can you recall my {x}?", f"Please tell me what my {x} {be}.", f"Would you remind me of my {x}?"],
           [f"Say my {x}.", f"Give me my {x}.", f"How about my {x}?", f"What about my {x}?",
            f"Do you still know my {x}?", f"You know my {x}, right?", f"What {be} my {x}, do you remember?",
            f"So what {be} my {x}?", f"I need my {x}."]),
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
    return _FIXED_SLOTS[key]



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


class _Writer:
    """Writes one chat round by round; `known` is what the user has told so far."""

    def __init__(self, rng: random.Random, p: Pools, phrasing: str, dlg: Dialogue, noise: int = 0,
                 never_told: int = 25, wide: bool = False):
        self.rng, self.p, self.phrasing, self.dlg, self.noise = rng, p, phrasing, dlg, noise
        self.never_told = never_told  # the weight of questions about something never told among out-of-scope prompts
        self.wide = wide and phrasing == "train"  # training chats draw on every group's `more` phrasings too
        self.filler = _FILLER_HELDOUT if phrasing == "heldout" else _FILLER  # small talk
        self.known: dict[str, _Known] = {}
        self.last_single: str | None = None  # the key the previous round told alone (for "actually, it's ...")

    def pick(self, templates: Templates) -> str:
        return templates.pick(self.phrasing, self.rng, self.wide)

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

    def clause(self, slot: Slot, value: str) -> str:
        template = self.pick(slot.states)
        while template.startswith("{v}") and slot.field in ("colors", "foods", "animals"):
            template = self.pick(slot.states)  # "Crows are ..." would recase it
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
            return typo(text, self.rng)
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
        values = [self.value(s) for s in slots]
        clauses = [self.clause(s, v) for s, v in zip(slots, values)]
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
        for s, v in zip(slots, values):
            self.known[s.key] = _Known(v, i, i, False, "called" if s.key.startswith("called:") else family)
        self.last_single = slots[0].key if len(slots) == 1 else None
        return Round(text, reply)

    def correction(self, i: int) -> Round:
        rng = self.rng
        short = self.last_single is not None and rng.random() < 0.5
        key = self.last_single if short else rng.choice(list(self.known))
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
        position = rng.choice(POSITIONS)
        distance = i - min(self.known[k].last if kind == "corrected" else self.known[k].first for k in keys)
        self.dlg.questions.append(Question(i, kind, position, distance, keys,
                                           tuple(self.known[k].value for k in keys),
                                           self.known[keys[0]].stated, asked))
        self.last_single = None
        return Round(_ask(question, position, rng, self.filler), reply)

    def out_of_scope(self, i: int) -> Round:
        rng = self.rng
        kind = rng.choices(OUT_OF_SCOPE_KINDS, weights=(20, 20, 35, self.never_told))[0]
        if kind == "unknown":
            slot = self.unknown_slot()
            text, reply = self.question_text(slot, self.asked_family()), UNKNOWN_REPLY
        elif kind == "request":
            topics = {"train": _TOPICS, "heldout": _TOPICS_HELDOUT, "dev": _TOPICS_DEV}[self.phrasing]
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
        text = " ".join(self.rng.sample(self.filler, self.rng.choice((1, 2))))
        return Round(self.with_unknown_words(text), CHATTER_REPLY)


def _bare(word: str) -> str:
    return word.strip(".,?!:;()-").removesuffix("'s").lower()


def _trailing_marks(word: str) -> str:
    return word[len(word.rstrip(".,?!:;")):]


def _ask(question: str, position: str, rng: random.Random, filler: list[str] = _FILLER) -> str:
    if position == "alone":
        return question
    before, after = " ".join(rng.sample(filler, 2)), " ".join(rng.sample(filler, 2))
    if position == "begin":
        return f"{question} {before} {after}"
    if position == "end":
        return f"{before} {after} {question}"
    return f"{before} {question} {after}"


def make_dialogue(rng: random.Random, p: Pools, n_rounds: int, with_system: bool = True,
                  phrasing: str = "train", noise: int = 0, never_told: int = 25, wide: bool = False) -> Dialogue:
    """A chat of n_rounds: facts, corrections, questions placed after what they ask about, out-of-scope prompts and
    small talk. `noise` (training only): 1 adds spare words to facts and questions and made-up words to the rest;
    2 also puts made-up words into, and leaves words out of, the frames of facts and questions (`with_frame_noise`)
    and makes half the named things made-up nouns; 3 makes two such edits; 4 also ends a quarter of the questions
    in words the model does not know (`with_tail`) and capitalises a made-up first word; 5 makes half of the words
    put in everyday ones (`odd_word`); 6 also ends four questions in ten in such words. `never_told` weighs
    questions about something never told among the out-of-scope prompts (greetings 20, thanks 20, requests 35).
    `wide` (training only) adds every template group's `more` phrasings to the trained ones."""
    dlg = Dialogue(SYSTEM_PROMPT if with_system else None, phrasing)
    w = _Writer(rng, p, phrasing, dlg, noise, never_told, wide)
    for i in range(n_rounds):
        dlg.known_before.append({k: v.value for k, v in w.known.items()})
        roll = rng.random()
        askable = [k for k, v in w.known.items() if i - v.first >= 1]
        if askable and (roll < 0.25 or i >= n_rounds - 2):
            rnd = w.question(i, askable)
        elif w.known and roll < 0.36:
            rnd = w.correction(i)
        elif roll < 0.64:
            rnd = w.statement(i)
        elif roll < 0.86:
            rnd = w.out_of_scope(i)
        else:
            rnd = w.chatter()
        dlg.rounds.append(rnd)
    dlg.known_before.append({k: v.value for k, v in w.known.items()})
    return dlg


def dialogues(split: str, count: int, seed: int, min_rounds: int, max_rounds: int,
              phrasing: str = "train", noise: int = 0, never_told: int = 25, wide: bool = False) -> list[Dialogue]:
    """`count` chats: values from `split`'s pools ("train" or "heldout"), sentences from `phrasing`'s templates
    (PHRASINGS). The benchmarks and calibrations use held-out values in trained phrasings; `kvchat eval` any."""
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r} (accepted: {', '.join(PHRASINGS)})")
    rng = random.Random(f"{split}:{seed}" if phrasing == "train" else f"{split}:{phrasing}:{seed}")
    p = pools(split)
    return [make_dialogue(rng, p, rng.randint(min_rounds, max_rounds), rng.random() < 0.8, phrasing, noise,
                          never_told, wide) for _ in range(count)]
