"""Issue 45, item 1: the copy mix of training chats (`dialogues(..., mix="copy")`, the trainer's `--mix copy`).

Every chat generated without it is byte for byte what it was before the mix existed; the mix's values are copied
byte for byte by the replies and never touched by spelling variants or slips; a question about one attribute of a
named thing is answered with that attribute only; its values keep to their split; its templates keep the four-words
rule among themselves and against the hand-written set; and a tiny model trains on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from functools import lru_cache

import pytest
from test_dialogues import _grams

from kvchat.engine.data import dialogues as d
from kvchat.engine.data.dialogues import dialogues
from kvchat.engine.data.told_once import copies_value, random_value_chats

# sha256 of repr(chats), computed from the code as it was before the copy mix was added (2026-11-28): the mix is
# an option, and every call without it must keep giving these chats.
BEFORE_THE_MIX = {
    "train-default": "72b8ec1a93fec4f8",
    "train-noise3": "792cb017ca8e8016",
    "train-noise6-wide": "b4064acdaf16cd9d",
    "trainer-chunk": "25c1419323fc3df6",
    "heldout-heldout": "81d4646514564d8b",
    "heldout-dev": "505de794c3680b8f",
    "heldout-train-noise1": "1861c6caefccb56d",
    "train-dev-noise5": "0d69852b94cc4b97",
    "random-heldout": "e9355a2b715858e3",
    "random-dev": "0d820e26ab7e82df",
    "random-train": "81b9700676af7b72",
}
_CALLS = {
    "train-default": lambda: dialogues("train", 8, 0, 4, 52),
    "train-noise3": lambda: dialogues("train", 8, 1, 10, 30, noise=3),
    "train-noise6-wide": lambda: dialogues("train", 8, 2, 30, 40, noise=6, never_told=50, wide=True),
    # as the trainer draws a chunk of the long-chat stages (seed 1's first chunk, fewer chats)
    "trainer-chunk": lambda: dialogues("train", 6, 100_000, 32, 60, noise=6, never_told=50, wide=True),
    "heldout-heldout": lambda: dialogues("heldout", 8, 0, 44, 52, "heldout"),
    "heldout-dev": lambda: dialogues("heldout", 8, 3, 44, 52, "dev"),
    "heldout-train-noise1": lambda: dialogues("heldout", 8, 4, 20, 30, "train", noise=1),
    "train-dev-noise5": lambda: dialogues("train", 8, 5, 20, 30, "dev", noise=5),
    # the eval's told-once chats draw from the generator's templates and words too
    "random-heldout": lambda: random_value_chats(5, 0, 44, 52),
    "random-dev": lambda: random_value_chats(5, 1, 44, 52, phrasing="dev"),
    "random-train": lambda: random_value_chats(5, 2, 44, 52, phrasing="train"),
}


def _digest(chats) -> str:
    return hashlib.sha256(repr(chats).encode()).hexdigest()[:16]


@pytest.mark.parametrize("call", sorted(BEFORE_THE_MIX))
def test_chats_without_the_mix_are_byte_for_byte_the_ones_before_it(call):
    assert _digest(_CALLS[call]()) == BEFORE_THE_MIX[call]


def test_the_trainer_asks_for_no_mix_unless_told():
    from kvchat.engine.train.trainer import TrainConfig, corpus_chunks

    chunk = corpus_chunks(TrainConfig())[0]
    # `mix or None`, no grammar's small talk or requests, no facts about anything, no word-like random strings: as
    # every run before
    assert chunk[-6:] == ("", 0.5, 0.0, 0.0, 0.0, 0.0)
    assert corpus_chunks(TrainConfig(mix="copy", mix_share=0.3))[0][-6:-4] == ("copy", 0.3)
    assert corpus_chunks(TrainConfig(talk=0.7))[0][-4] == 0.7
    assert corpus_chunks(TrainConfig(mix="copy", subjects=0.4))[0][-2] == 0.4
    assert corpus_chunks(TrainConfig(requests=0.6))[0][-3] == 0.6
    assert corpus_chunks(TrainConfig(mix="copy", words=0.5))[0][-1] == 0.5
    with pytest.raises(ValueError, match="unknown mix"):
        dialogues("train", 1, 0, 4, 8, mix="paste")


# -- the mix's chats --

_MIXED = {  # (split, phrasing, noise, wide): what training (noise 3 and 6, wide) and choosing runs (dev) draw
    ("train", "train", 3, False): 14, ("train", "train", 6, True): 14, ("heldout", "dev", 0, False): 14,
    ("heldout", "heldout", 0, False): 8,
}


@lru_cache(maxsize=None)
def _mixed(split: str, phrasing: str, noise: int, wide: bool) -> list[d.Dialogue]:
    return dialogues(split, _MIXED[split, phrasing, noise, wide], 7, 24, 40, phrasing, noise, wide=wide, mix="copy",
                     mix_share=0.7)


def _all_mixed():
    return [(key, dlg) for key in _MIXED for dlg in _mixed(*key)]


def _told(dlg: d.Dialogue) -> list[tuple[int, str, str]]:
    """(round, key, value) of every fact told or corrected in the chat."""
    out = []
    for i in range(len(dlg.rounds)):
        before, after = dlg.known_before[i], dlg.known_before[i + 1]
        out += [(i, k, v) for k, v in after.items() if before.get(k) != v]
    return out


def test_the_mix_is_deterministic_and_each_split_and_phrasing_draws_from_its_own_stream():
    a = dialogues("train", 6, 0, 20, 30, mix="copy")
    assert repr(a) == repr(dialogues("train", 6, 0, 20, 30, mix="copy"))
    assert repr(a) != repr(dialogues("train", 6, 1, 20, 30, mix="copy"))
    assert repr(a) != repr(dialogues("train", 6, 0, 20, 30))
    # the chats' lengths are each stream's first draws: no two streams (nor the unmixed one) give the same
    lengths = {(split, phrasing, mix): tuple(len(c.rounds) for c in dialogues(split, 12, 0, 4, 60, phrasing, mix=mix))
               for split in ("train", "heldout") for phrasing in d.PHRASINGS for mix in (None, "copy")}
    assert len(set(lengths.values())) == len(lengths)


def test_every_value_told_is_copied_byte_for_byte_by_its_acknowledgement_and_every_answer():
    fields = set()
    for _, dlg in _all_mixed():
        for i, key, value in _told(dlg):
            rnd = dlg.rounds[i]
            assert copies_value(rnd.user, value), (rnd.user, value)  # told as it is remembered
            assert rnd.assistant == d.LIST_ACK or copies_value(rnd.assistant, value), (rnd, value)
            fields.add(d.slot_for(key).field)
        for q in dlg.questions:
            reply = dlg.rounds[q.round_index].assistant
            answers = [d.slot_for(k).reply(v) for k, v in zip(q.keys, q.values)]
            assert reply == (answers[0] if len(answers) == 1 else
                             f"{answers[0][:-1]}, and {answers[1][0].lower()}{answers[1][1:]}")
            for value in q.values:
                assert copies_value(reply, value), (reply, value)
                assert any(copies_value(r.user, value) for r in dlg.rounds[: q.round_index]), value
    assert set(d.COPY_VALUE_FIELDS) | {"breeds"} <= fields, set(d.COPY_VALUE_FIELDS) - fields



def test_the_generators_own_sentences_tell_random_strings_too(monkeypatch):
    """A share of the generator's own statements (`_Writer.statement`: its slots and templates, not the mix's) tell
    random strings (`GENERATOR_RANDOM_SHARE`), whole and none recased at the start of a message; without the mix
    none does."""
    drawn, told = [], []

    def random_code(rng, held=False):
        drawn.append(value := real_random_code(rng, held))
        return value

    def statement(self, i):
        start = len(drawn)
        rnd = real_statement(self, i)
        told.extend((rnd.user, value) for value in drawn[start:])
        return rnd

    real_random_code, real_statement = d.random_code, d._Writer.statement
    monkeypatch.setattr(d, "random_code", random_code)
    monkeypatch.setattr(d._Writer, "statement", statement)
    dialogues("train", 30, 0, 20, 30, mix="copy")
    assert len(told) >= 20 and all(copies_value(user, value) for user, value in told), told
    del told[:]
    dialogues("train", 30, 0, 20, 30)
    assert not told

_FORMS = {  # the written forms issue 45 names, each of which the mix tells
    "code with - or _": r"[A-Za-z0-9]+([-_][A-Za-z0-9]+)+",
    "mixed case and digits": r"(?=.*[a-z])(?=.*[A-Z])(?=.*\d)\S+",
    "several words": r"[A-Za-z0-9]+( [A-Za-z0-9]+)+", "14 June": r"\d{1,2} [A-Z][a-z]+",
    "June 14th": r"[A-Z][a-z]+ \d{1,2}(st|nd|rd|th)", "14/06": r"\d\d/\d\d", "2024-06-14": r"\d{4}-\d\d-\d\d",
    "3:45 pm": r"\d{1,2}:\d\d [ap]m", "15:45": r"\d\d:\d\d", "quarter past three": r"quarter past [a-z]+",
    "year": r"(19|20)\d\d", "+44 20 7946 0958": r"\+\d+( \d+)+", "555-0143": r"555-\d{4}", "12.5 kg": r"\d+\.\d kg",
    "$40": r"\$\d+", "3 km": r"\d+ km",
}


def test_values_come_in_the_written_forms_issue_45_names():
    rng = random.Random(3)
    for held in (False, True):
        values = [d.copy_value(field, rng, held) for field in d.COPY_VALUE_FIELDS for _ in range(400)]
        forms = {form for form, pattern in _FORMS.items() for v in values if re.fullmatch(pattern, v)}
        assert forms == set(_FORMS), set(_FORMS) - forms


def test_the_mix_tells_in_passing_in_lists_and_corrections_and_asks_respelled():
    stated, asked = [], []
    for _, dlg in _all_mixed():
        stated += [q.stated for q in dlg.questions]
        asked += [q.asked for q in dlg.questions]
    assert {"in_passing", "list", "correction", "called", "plain", "remember"} <= set(stated)
    assert stated.count("in_passing") >= 10 and asked.count("respelled") >= 20


def test_spelling_variants_and_slips_change_the_words_around_a_value_never_the_value():
    rng = random.Random(0)
    text = "Remember my favourite colour is X7k-22Qa, what's my neighbour's theatre? The grey one is Colour_9 tonight."
    values = ["X7k-22Qa", "Colour_9"]  # a value that looks like a word a variant would change stays as told
    seen = set()
    for _ in range(400):
        typed = d._unmask(d.respell(d._mask(text, values), rng), values)
        assert typed != text and all(copies_value(typed, v) for v in values), typed
        seen |= {w.strip(".,?!").lower() for w in typed.split()}
    assert {"favorite", "color", "neighbor's", "neighbors", "theater", "gray", "whats"} <= seen
    assert len(seen - {w.strip(".,?!").lower() for w in text.split()} - {"favorite", "color", "neighbor's",
                                                                         "neighbors", "theater", "gray", "whats",
                                                                         "neighbours", "neighbor"}) > 20  # slips
    # a training chat gains no held-out value word: "our cat's name" never becomes "cats" (a held-out animal)
    for _ in range(100):
        assert "cats" not in d.respell("What is our cat's name?", rng, d._HELD_OUT_WORDS).lower()
    # and in the chats: both spellings of the same question, the values as told
    questions = [dlg.rounds[q.round_index].user.lower() for _, dlg in _all_mixed() for q in dlg.questions]
    assert any("colour" in q for q in questions) and any("color" in q for q in questions)


def test_an_attribute_question_is_answered_with_that_attribute_only():
    asked = together = 0
    for _, dlg in _all_mixed():
        by_round: dict[int, list[str]] = {}
        for i, key, _ in _told(dlg):
            by_round.setdefault(i, []).append(key)
        together += sum(len(keys) >= 2 and len({d._thing(k) for k in keys}) == 1 and d._thing(keys[0]) != ""
                        for keys in by_round.values())
        for q in dlg.questions:
            reply = dlg.rounds[q.round_index].assistant
            for key in q.keys:
                if not key.startswith("attr:"):
                    continue
                thing = d._thing(key)
                others = {v for k, v in dlg.known_before[q.round_index].items()
                          if d._thing(k) == thing and k not in q.keys}
                assert not any(copies_value(reply, v) for v in others - set(q.values)), (reply, others)
                assert thing.split(" ", 1)[1] in reply.lower()
                asked += bool(others)
    assert asked >= 20 and together >= 10  # attributes asked of things with several, several told in one message


def test_an_untold_attribute_of_a_named_thing_is_never_told_back():
    from kvchat.engine.data.dialogues import UNKNOWN_REPLY

    unknown = 0
    for _, dlg in _all_mixed():
        for o in dlg.out_of_scope:
            if o.kind == "unknown":
                assert dlg.rounds[o.round_index].assistant == UNKNOWN_REPLY
                unknown += 1
    assert unknown > 10


def test_the_mix_keeps_its_values_to_their_split():
    for held in (False, True):
        rng = random.Random(int(held))
        for field in d.COPY_VALUE_FIELDS:
            assert all(d.held_out_value(d.copy_value(field, rng, held)) == held for _ in range(50)), field
    real = d._HELD_OUT_WORDS
    for (split, _, _, _), dlg in _all_mixed():
        for i, key, value in _told(dlg):
            if d.slot_for(key).field in d.COPY_VALUE_FIELDS:
                assert d.held_out_value(value) == (split == "heldout"), value
        if split == "train":  # no held-out value (a real name, city, color, food, animal or breed) in training
            words = {w.strip(".,?!:;()-'").removesuffix("'s").lower() for r in dlg.rounds for w in
                     (r.user + " " + r.assistant).split()}
            assert not words & real, words & real
    rng = random.Random(5)
    codes = [d.random_code(rng) for _ in range(3000)]
    assert set(map(len, codes)) == set(range(2, 17))
    assert not {w.lower() for c in codes for w in re.split(r"[ _-]", c)} & (d._chat_words() | real)


# -- templates: the four-words rule --

def _subject(slot: d.Slot) -> str:
    """The thing a template tells or asks about, masked as the module's checks mask it (tests/test_dialogues.py):
    a named thing with its determiner, else the answer's subject."""
    if slot.key.startswith(("called:", "attr:")):
        return d._thing(slot.key)
    return slot.answer.removeprefix("Your ").split(" is ")[0].split(" are ")[0].lower()


def _answer_subject(slot: d.Slot) -> str:
    return slot.key.removeprefix("called:") if slot.key.startswith("called:") else \
        slot.answer.removeprefix("Your ").split(" is ")[0].split(" are ")[0].lower()


@pytest.mark.parametrize("subject_of", [_subject, _answer_subject], ids=["named-thing", "answer"])
def test_held_out_copy_templates_share_no_four_words_with_trained_or_dev_ones(subject_of):
    """As tests/test_dialogues.py checks the generator's other groups, whichever way the subject is masked: each
    set non-empty and disjoint, and no held-out template sharing four words in a row with a trained or dev one of
    its group."""
    groups = [([g], "") for g in d.COPY_WRAPPERS]
    groups += [([s.states, s.asks, s.recalls], subject_of(s)) for s in d.copy_mix_slots()]
    n_held = 0
    for members, subject in groups:
        for g in members:
            sets = [{t.lower() for t in getattr(g, p)} for p in d.PHRASINGS]
            assert all(sets) and not sets[0] & sets[1] and not sets[0] & sets[2] and not sets[1] & sets[2], g
        trained = set().union(*(_grams(t, subject) for g in members for t in g.train + g.more))
        dev = set().union(*(_grams(t, subject) for g in members for t in g.dev))
        for g in members:
            n_held += len(g.heldout)
            for t in g.heldout:
                assert not _grams(t, subject) & (trained | dev), t
    assert n_held > 1000


def test_named_things_of_the_mix_are_split_by_phrasing():
    nouns = {p: {n for kind in d._ENTITY_NOUNS[p].values() for n in kind} for p in d.PHRASINGS}
    named = {"train": set(d._NOUNS_TRAIN), "heldout": set(d._NOUNS_HELDOUT), "dev": set(d._NOUNS_DEV)}
    assert nouns["train"] <= named["train"]
    for a in d.PHRASINGS:
        for b in d.PHRASINGS:
            if a != b:
                assert not nouns[a] & (nouns[b] | named[b]), (a, b)


def _copy_sentences() -> set[str]:
    """Every sentence the copy mix can build from its templates: each set, every named thing and determiner, and
    the clauses said again of a pronoun ("he is {v} old")."""
    texts = {t for g in d.COPY_WRAPPERS for t in (*g.train, *g.heldout, *g.dev, *g.more)}
    for slot in d.copy_mix_slots():
        thing = d._thing(slot.key)
        for g in (slot.states, slot.asks, slot.recalls):
            for t in (*g.train, *g.heldout, *g.dev, *g.more):
                texts.add(t)
                texts |= {d.pronoun_clause(t, thing, p) for kind in d._PRONOUNS.values() for p in kind} - {None}
    return texts


def test_no_copy_template_shares_four_words_in_a_row_with_the_written_set():
    """tests/test_written_eval.py keeps the hand-written set apart from the generator's templates; the mix's are
    the generator's too (read here to compare, never by training code)."""
    from kvchat.app.bench.written_eval import written_triples

    written = set()
    for t in written_triples():
        written |= _grams(t["fact"], t["answer"].lower()) | _grams(t["question"])
    texts = _copy_sentences()
    assert len(texts) > 3000
    shared = sorted((" ".join(g), t) for t in texts for g in _grams(t, "{v}") if g in written)
    assert not shared, shared[:10]


# -- training on it --

def test_a_tiny_model_trains_on_the_copy_mix(tmp_path, monkeypatch):
    """The trainer's own loop, a few steps on CPU, on chats of the mix drawn as its workers draw them (one chunk's
    arguments, 8 chats instead of 500): the loss is finite and the run's config keeps the mix."""
    from kvchat.engine.train import trainer

    cfg = trainer.TrainConfig(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128, n_merges=100, steps=4,
                              batch=4, max_tokens=384, min_rounds=6, max_rounds=10, warmup=2, mix="copy",
                              mix_share=0.8)
    drawn = []

    def encode_corpus(gguf_path, cfg, workers):
        trainer._init_worker(str(gguf_path))
        try:
            chunk = (*trainer.corpus_chunks(cfg)[0][:1], 8, *trainer.corpus_chunks(cfg)[0][2:])
            drawn.extend(dialogues(*chunk[:5], noise=chunk[5], never_told=chunk[7], wide=bool(chunk[8]),
                                   mix=chunk[9], mix_share=chunk[10]))
            return trainer._encode_chunk(chunk)
        finally:
            trainer._worker_tok = None

    monkeypatch.setattr(trainer, "encode_corpus", encode_corpus)
    log = []
    path = trainer.train(cfg, tmp_path, None, cfg.steps, 1, log=log.append, device="cpu")
    assert path.exists() and any(q.keys[0].startswith(("attr:", "code:", "date:", "time:", "phone:", "amount:"))
                                 for dlg in drawn for q in dlg.questions)
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and state["config"]["mix"] == "copy" and state["config"]["mix_share"] == 0.8
    losses = [h["loss"] for h in state["history"]]
    assert losses and all(math.isfinite(x) for x in losses) and losses[0] > 0
    assert any("loss" in line for line in log)


def test_word_like_random_strings_are_drawn_for_training_chats_alone_and_only_when_asked(monkeypatch):
    """`words` (issue 45's next run): a share of the copy mix's random strings drawn as lower-case words or several
    words, the kinds G copied least. Without it the chats are the ones before (the digests above); held-out and
    dev chats never have it."""
    from kvchat.engine.data import dialogues as d

    real_random_code = d.random_code
    drawn = []  # (drawn as words, the value)

    def random_code(rng, held=False, styles=None):
        drawn.append((styles is not None, value := real_random_code(rng, held, styles)))
        return value

    monkeypatch.setattr(d, "random_code", random_code)

    def chats(phrasing, words, seed=5):
        drawn.clear()
        split = "train" if phrasing == "train" else "heldout"
        return d.dialogues(split, 12, seed, 30, 40, phrasing=phrasing, mix="copy", mix_share=0.5, words=words)

    chats("train", 0.0)
    assert drawn and not any(as_words for as_words, _ in drawn)
    chats("train", 0.5)
    as_words = [v for w, v in drawn if w]
    # (the copy mix's codes and attributes draw random strings of every kind too: a part of the draws is asked for)
    assert 0.1 < len(as_words) / len(drawn) < 0.5
    assert all(re.fullmatch(r"[a-z]{2,16}", v) or re.fullmatch(r"\S{2,}( \S{2,}){1,2}", v) for v in as_words)
    assert 0.2 < sum(" " in v for v in as_words) / len(as_words) < 0.8  # both kinds
    for phrasing in ("heldout", "dev"):
        assert chats(phrasing, 1.0) == chats(phrasing, 0.0)
    with pytest.raises(ValueError, match="words"):
        d.dialogues("train", 1, 0, 4, 8, mix="copy", words=1.5)
