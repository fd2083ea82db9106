"""Memory dialogues: multi-round chats where the user states facts (some later corrected) between distractor rounds
and later asks questions whose answers need one or several earlier rounds.

They train the embedded model (engine.train) and score every KV policy on the same held-out chats (`kvchat eval`).
Everything is deterministic from a seed. The training and held-out splits draw names and values from disjoint
pools, so a held-out answer can only come from reading the chat, never from memorised training data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvchat.engine.chat_format import Round

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


@dataclass(frozen=True)
class Slot:
    """One thing the user can tell: how it is stated, corrected, asked and answered."""

    key: str
    state: str  # user says it
    ack: str  # assistant acknowledges
    correct: str  # user corrects it ({old} is the previous value)
    ask: str  # user asks
    answer: str  # assistant answers

    def render(self, template: str, value: str, old: str = "") -> str:
        return template.format(v=value, old=old)


def _slots() -> list[Slot]:
    slots = [
        Slot("name", "My name is {v}.", "Nice to meet you, {v}.", "Actually, my name is {v}, not {old}.",
             "What is my name?", "Your name is {v}."),
        Slot("city", "I live in {v}.", "Noted: you live in {v}.", "Correction: I moved, I live in {v} now, not {old}.",
             "Where do I live?", "You live in {v}."),
        Slot("color", "My favorite color is {v}.", "Noted: your favorite color is {v}.",
             "I changed my mind, my favorite color is {v}, not {old}.", "What is my favorite color?",
             "Your favorite color is {v}."),
        Slot("food", "I really love {v}.", "Noted: you love {v}.", "Correction: I love {v} now, not {old}.",
             "What food do I love?", "You love {v}."),
        Slot("animal", "My favorite animals are {v}.", "Noted: your favorite animals are {v}.",
             "Actually, my favorite animals are {v}, not {old}.", "What are my favorite animals?",
             "Your favorite animals are {v}."),
        Slot("birthday", "My birthday is on {v}.", "Noted: your birthday is on {v}.",
             "Sorry, my birthday is on {v}, not {old}.", "When is my birthday?", "Your birthday is on {v}."),
        Slot("locker", "My locker number is {v}.", "Noted: your locker number is {v}.",
             "Correction: my locker number is {v}, not {old}.", "What is my locker number?",
             "Your locker number is {v}."),
        Slot("meeting", "My meeting is on {v}.", "Noted: your meeting is on {v}.",
             "The meeting moved, it is on {v} now, not {old}.", "When is my meeting?", "Your meeting is on {v}."),
    ]
    for rel in _RELATIONS:
        slots.append(Slot(
            f"rel:{rel}", f"My {rel}'s name is {{v}}.", f"Noted: your {rel}'s name is {{v}}.",
            f"Correction: my {rel}'s name is {{v}}, not {{old}}.", f"What is my {rel}'s name?",
            f"Your {rel}'s name is {{v}}."))
    return slots


SLOTS = _slots()
SLOT_BY_KEY = {s.key: s for s in SLOTS}
QUESTION_KINDS = ("single", "corrected", "multi")
POSITIONS = ("alone", "begin", "middle", "end")


def _value(slot: Slot, p: Pools, rng: random.Random) -> str:
    if slot.key == "birthday":
        return f"{rng.choice(_MONTHS)} {1 + rng.randrange(28)}"
    if slot.key == "locker":
        return p.pick("numbers", rng)
    if slot.key == "meeting":
        return rng.choice(_WEEKDAYS)
    field = {"city": "cities", "color": "colors", "food": "foods", "animal": "animals"}.get(slot.key, "names")
    return p.pick(field, rng)


@dataclass
class Question:
    round_index: int  # the round whose user message asks it
    kind: str  # single | corrected | multi
    position: str  # where the question sits in the user message: alone | begin | middle | end
    distance: int  # rounds between the question and the oldest round it needs
    keys: tuple[str, ...]
    values: tuple[str, ...]  # the latest value of each key: what the answer must contain

    @property
    def distance_bucket(self) -> str:
        low = 1
        for top in (4, 8, 16, 32):
            if self.distance <= top:
                return f"{low}-{top}"
            low = top + 1
        return "33+"


@dataclass
class Dialogue:
    system: str | None
    rounds: list[Round] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    # What the user has told so far (key -> latest value) as each round begins: lets a benchmark cut the chat at any
    # round and ask about everything known there.
    known_before: list[dict[str, str]] = field(default_factory=list)

    def recall_rounds(self, upto: int) -> list[Round]:
        """One question per fact known before round `upto`, with the expected reply: asked at the end of the chat
        rounds[:upto], the way a user comes back to an old chat and asks about it."""
        return [Round(SLOT_BY_KEY[k].ask, SLOT_BY_KEY[k].answer.format(v=v))
                for k, v in sorted(self.known_before[upto].items())]


def _distractor(rng: random.Random) -> Round:
    topic = rng.choice(_TOPICS)
    user = rng.choice([f"Tell me something interesting about {topic}.", f"Can you give me a short fact about {topic}?",
                       f"What do you know about {topic}?", f"I am curious about {topic}, any quick thoughts?"])
    if rng.random() < 0.4:
        user = " ".join(rng.sample(_FILLER, 2)) + " " + user
    reply = rng.choice([f"Here is a short note about {topic}: people have studied it for a long time.",
                        f"Sure. {topic[0].upper() + topic[1:]} is a topic with many surprising details.",
                        f"Happy to help. There is a lot to say about {topic}, and it is worth reading more."])
    return Round(user, reply)


def _ask(question: str, position: str, rng: random.Random) -> str:
    if position == "alone":
        return question
    before, after = " ".join(rng.sample(_FILLER, 2)), " ".join(rng.sample(_FILLER, 2))
    if position == "begin":
        return f"{question} {before} {after}"
    if position == "end":
        return f"{before} {after} {question}"
    return f"{before} {question} {after}"


def make_dialogue(rng: random.Random, p: Pools, n_rounds: int, with_system: bool = True) -> Dialogue:
    """A chat of n_rounds: facts, corrections, distractors, and questions placed after what they ask about."""
    dlg = Dialogue(SYSTEM_PROMPT if with_system else None)
    known: dict[str, tuple[str, int, int, bool]] = {}  # key -> (value, first round, last round, corrected)
    slots = {s.key: s for s in SLOTS}
    for i in range(n_rounds):
        dlg.known_before.append({k: v[0] for k, v in known.items()})
        roll = rng.random()
        askable = [k for k in known if i - known[k][1] >= 1]
        if askable and (roll < 0.3 or i >= n_rounds - 2):
            dlg.rounds.append(_question_round(rng, dlg, i, known, slots, askable))
        elif known and roll < 0.45:
            key = rng.choice(list(known))
            old = known[key][0]
            new = _value(slots[key], p, rng)
            if new == old:
                dlg.rounds.append(_distractor(rng))
                continue
            slot = slots[key]
            dlg.rounds.append(Round(slot.correct.format(v=new, old=old), slot.ack.format(v=new)))
            known[key] = (new, known[key][1], i, True)
        elif roll < 0.75:
            free = [s for s in SLOTS if s.key not in known]
            if not free:
                dlg.rounds.append(_distractor(rng))
                continue
            slot = rng.choice(free)
            value = _value(slot, p, rng)
            dlg.rounds.append(Round(slot.state.format(v=value), slot.ack.format(v=value)))
            known[slot.key] = (value, i, i, False)
        else:
            dlg.rounds.append(_distractor(rng))
    dlg.known_before.append({k: v[0] for k, v in known.items()})
    return dlg


def _question_round(rng, dlg, i, known, slots, askable) -> Round:
    corrected = [k for k in askable if known[k][3]]
    if len(askable) >= 2 and rng.random() < 0.25:
        keys, kind = tuple(rng.sample(askable, 2)), "multi"
    elif corrected and rng.random() < 0.5:
        keys, kind = (rng.choice(corrected),), "corrected"
    else:
        keys = (rng.choice(askable),)
        kind = "corrected" if known[keys[0]][3] else "single"
    asks = [slots[k].ask for k in keys]
    answers = [slots[k].answer.format(v=known[k][0]) for k in keys]
    question = asks[0] if len(asks) == 1 else f"{asks[0][:-1]}, and {asks[1][0].lower()}{asks[1][1:]}"
    reply = answers[0] if len(answers) == 1 else f"{answers[0][:-1]}, and {answers[1][0].lower()}{answers[1][1:]}"
    position = rng.choice(POSITIONS)
    distance = i - min(known[k][1] if kind != "corrected" else known[k][2] for k in keys)
    dlg.questions.append(Question(i, kind, position, distance, keys, tuple(known[k][0] for k in keys)))
    return Round(_ask(question, position, rng), reply)


def dialogues(split: str, count: int, seed: int, min_rounds: int, max_rounds: int) -> list[Dialogue]:
    rng = random.Random(f"{split}:{seed}")
    p = pools(split)
    return [make_dialogue(rng, p, rng.randint(min_rounds, max_rounds), with_system=rng.random() < 0.8)
            for _ in range(count)]
