"""Issue 45's measurement: the hand-written evaluation set, the told-once chats built from it and from random values,
and the exact-copy metric `kvchat eval` reports."""

from __future__ import annotations

import json
import random
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from cli_run import kvchat
from test_dialogues import _grams

from kvchat.app.bench.evaluate import evaluate
from kvchat.app.bench.written_eval import WRITTEN_KINDS, WRITTEN_SET, written_chats, written_triples
from kvchat.engine.data import dialogues as d
from kvchat.engine.data import small_talk
from kvchat.engine.data.told_once import ToldOnce, copies_value, random_value, random_value_chats, told_once_chats

ROOT = Path(__file__).resolve().parents[1]


def test_the_written_set_is_large_covers_every_kind_and_its_answers_are_in_its_facts():
    triples = written_triples()
    assert len(triples) >= 320
    kinds = Counter(t["kind"] for t in triples)
    assert set(kinds) == set(WRITTEN_KINDS) and min(kinds.values()) >= 15, kinds
    assert len({(t["fact"], t["question"]) for t in triples}) == len(triples)
    for t in triples:
        # the answer is told byte for byte, and copied byte for byte by the expected reply; the question does not
        # give it away
        assert copies_value(t["fact"], t["answer"]) and copies_value(t["reply"], t["answer"]), t
        assert not copies_value(t["question"], t["answer"]), t
        assert t["answer"] == t["answer"].strip() and t["subject"], t
    answers = {t["answer"] for t in triples}
    # values of the forms issue 45 names, which the generator never uses
    assert {"X7k-22Qa", "bq9", "14 June", "3:45 pm", "1987", "+44 20 7946 0958", "12.5 kg"} <= answers
    assert sum(" " in a for a in answers) > 80  # multi-word names, dates, numbers with units
    pools = {w.lower() for w in d._FIRST + d._CITIES + d._COLORS + d._FOODS + d._ANIMALS + d._WEEKDAYS}
    birthday = re.compile(rf"^({'|'.join(d._MONTHS)}) ([1-9]|1\d|2[0-8])$")  # the generator's: a day of 1-28
    assert not [a for a in answers if a.lower() in pools or birthday.match(a)]
    # British and American spellings, each in facts and in questions
    texts = [(t["fact"].lower(), t["question"].lower()) for t in triples]
    for british, american in (("colour", "color"), ("favourite", "favorite"), ("neighbour", "neighbor")):
        assert any(british in f for f, _ in texts) or any(british in q for _, q in texts)
        assert any(american in f or american in q for f, q in texts)
    # and the file is package data
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert WRITTEN_SET.parent == ROOT / "app" / "bench" and "*.json" in package_data["kvchat.app.bench"]


def _generator_grams() -> dict[tuple[str, ...], str]:
    """Every four words in a row of the generator's sentences (the value masked): each template of every group, in
    every set (train, more, dev, held-out), named things with every noun the generator names, and its small talk
    (the fixed sentences and every one the training grammar can write)."""
    dets = ("my", "our", "the")
    nouns = sorted(set(d._NOUNS_TRAIN + d._NOUNS_HELDOUT + d._NOUNS_DEV))
    groups = [v for v in vars(d).values() if isinstance(v, d.Templates)]
    for slot in [*d.SLOTS, *(d.called_slot(det, noun) for det in dets for noun in nouns), *d.copy_mix_slots()]:
        groups += [slot.states, slot.asks, slot.recalls]
    texts = [t for g in groups for t in (*g.train, *g.more, *g.dev, *g.heldout)] + d._FILLER + d._FILLER_HELDOUT
    found: dict[tuple[str, ...], str] = {}
    for text in texts:
        for gram in _grams(text, "{v}"):
            found.setdefault(gram, text)
    for gram in small_talk.four_word_sequences():  # training chats' small talk: every sentence its grammar makes
        found.setdefault(gram, "engine/data/small_talk.py")
    return found


def test_no_written_sentence_shares_four_words_in_a_row_with_a_generator_template():
    """Written differently means no near copies: no fact or question of the set shares four words in a row (lower
    case, punctuation stripped, the value masked) with any sentence the generator writes, trained or not."""
    generator = _generator_grams()
    assert len(generator) > 10_000
    shared = []
    for t in written_triples():
        for text, value in ((t["fact"], t["answer"].lower()), (t["question"], "")):
            shared += [(text, " ".join(g), generator[g]) for g in _grams(text, value) if g in generator]
    assert not shared, shared[:10]
    # the check does catch a sentence the generator could have written
    assert _grams("Hey, what is my sister's name?") & set(generator)
    assert _grams("I named our kayak Bq9.", "bq9") & set(generator)


def _told_at(dlg, value: str) -> list[int]:
    return [i for i, r in enumerate(dlg.rounds) if copies_value(r.user, value)]


def test_written_chats_ask_every_triple_once_long_after_it_is_told_and_are_deterministic():
    chats = written_chats(0, 44, 52)
    again = written_chats(0, 44, 52)
    assert [[(r.user, r.assistant) for r in c.rounds] for c in chats] == \
        [[(r.user, r.assistant) for r in c.rounds] for c in again]
    assert [c.rounds for c in written_chats(1, 44, 52)] != [c.rounds for c in chats]
    assert [c.rounds for c in written_chats(0, 44, 52, chats=3)] == [c.rounds for c in chats[:3]]
    triples = {(t["fact"], t["question"]): t for t in written_triples()}
    asked = []
    for dlg in chats:
        assert dlg.phrasing == "written" and 44 <= len(dlg.rounds) <= 52 and len(dlg.questions) <= 8
        assert {o.kind for o in dlg.out_of_scope} <= {"greeting", "thanks", "request"}
        subjects = []
        for q in dlg.questions:
            question = dlg.rounds[q.round_index]
            fact_at = q.round_index - q.distance
            t = triples[(dlg.rounds[fact_at].user, question.user)]
            asked.append((t["fact"], t["question"]))
            subjects.append(t["subject"])
            assert q.distance >= 20 and q.values == (t["answer"],) and q.value_kind == t["kind"]
            assert question.assistant == t["reply"] and not q.values_seen_in_training
            # told once, in its fact, and nowhere else before the question
            assert _told_at(dlg, t["answer"])[:1] == [fact_at]
            assert all(not copies_value(r.user, t["answer"]) for r in dlg.rounds[fact_at + 1: q.round_index + 1])
        assert len(set(subjects)) == len(subjects)
    assert sorted(asked) == sorted(triples)


def test_random_value_chats_tell_each_random_string_once_and_ask_it_20_rounds_later():
    chats = random_value_chats(6, 0, 44, 52)
    assert [c.rounds for c in chats] == [c.rounds for c in random_value_chats(6, 0, 44, 52)]
    assert [c.rounds for c in chats] != [c.rounds for c in random_value_chats(6, 1, 44, 52)]
    kinds = Counter()
    for dlg in chats:
        assert dlg.phrasing == "heldout" and len(dlg.questions) == 8
        assert not any(f in r.user for r in dlg.rounds for f in d._FILLER)  # the held-out small talk only
        for q in dlg.questions:
            (value,) = q.values
            kinds[q.value_kind] += 1
            assert 2 <= len(value) <= 16 and re.fullmatch(r"[A-Za-z0-9]+( [A-Za-z0-9]+)*", value), value
            assert q.distance >= 20 and copies_value(dlg.rounds[q.round_index].assistant, value)
            assert _told_at(dlg, value) == [q.round_index - q.distance]
            assert copies_value(dlg.rounds[q.round_index - q.distance].assistant, value)  # acknowledged as told
    assert set(kinds) == {"lower", "capitalised", "upper", "digits", "mixed", "several words"}, kinds
    rng = random.Random(3)
    lengths = Counter(len(random_value(rng)[0]) for _ in range(2000))
    assert set(lengths) == set(range(2, 17))


def test_told_once_chats_refuse_chats_too_short_for_the_distance():
    item = ToldOnce("The code is Zq4.", "Noted.", "Which code?", "Zq4.", "Zq4", "random-code", "code")
    with pytest.raises(ValueError, match="cannot ask 2 facts"):
        told_once_chats([[item, ToldOnce(*("x",) * 6, subject="other")]], random.Random(0), 10, 10, 20)


@pytest.mark.parametrize("reply, value, copied", [
    ("Your wifi key is X7k-22Qa.", "X7k-22Qa", True),
    ("X7k-22Qa", "X7k-22Qa", True),
    ("Your wifi key is X7k-22Qb.", "X7k-22Qa", False),  # one letter altered
    ("Your wifi key is x7k-22Qa.", "X7k-22Qa", False),  # its case
    ("Your wifi key is X7k22Qa.", "X7k-22Qa", False),
    ("Your bike lock is bq9x.", "bq9", False),  # part of a longer word
    ("Locker 4170.", "417", False),
    ("It was 2.417 kg.", "417", False),
    ("Your dog is 7.", "7", True),
    ("Your dog is 7.5 now.", "7", False),
    ("Call +44 20 7946 0958 now", "+44 20 7946 0958", True),
    ("Call +44 20 7946 0959 now", "+44 20 7946 0958", False),
    ("Your parents married in '78.", "'78", True),
])
def test_exact_copy_is_the_value_byte_for_byte_and_whole(reply, value, copied):
    assert copies_value(reply, value) is copied


def test_eval_counts_an_altered_value_as_a_miss_and_an_exact_one_as_a_hit(monkeypatch):
    """Scripted replies through the real evaluation loop: the embedded model's first token, then the reply text
    replaced; one question answered with its value, one with a letter changed, one in other words around it."""
    from kvchat.app.bench import evaluate as evaluate_module
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.engine import Engine
    from kvchat.engine.policies import make_policy

    items = [ToldOnce(f"Note: the {what} code is {code}.", "Noted.", f"Which {what} code?", f"It is {code}.", code,
                      kind, what) for what, code, kind in (("gate", "Qx7-2b", "random-code"),
                                                           ("shed", "4471", "random-code"),
                                                           ("loft", "Ab 9z", "several words"))]
    dlg = told_once_chats([items], random.Random(0), 8, 8, 3)[0]
    engine = Engine(DEFAULT_MODEL, device="cpu")
    scripted = {"gate": "Your gate code is Qx7-2b.", "shed": "The shed code is 4472.", "loft": "Ab 9z, I think."}
    real_generate = evaluate_module.generate

    def generate(model, cache, prompt, **kw):
        out = real_generate(model, cache, prompt, **{**kw, "max_tokens": 1})
        asked = engine.tokenizer.decode(prompt)
        out.text = next((reply for what, reply in scripted.items() if f"Which {what} code?" in asked), "Hello.")
        return out

    monkeypatch.setattr(evaluate_module, "generate", generate)
    for mode in ("compare", "app"):
        result = evaluate(engine, make_policy("full"), [dlg], mode=mode)
        assert (result.exact_copy.questions, result.exact_copy.correct) == (3, 2)
        assert (result.overall.questions, result.overall.correct) == (3, 0)  # no reply is the expected one whole
        copy = result.as_dict()["exact_copy"]
        assert copy["by_kind"]["random-code"] == {"questions": 2, "correct": 1, "accuracy": 0.5}
        assert copy["by_kind"]["several words"]["correct"] == 1 and set(copy["by_length"]) == {"1-4 chars",
                                                                                               "5-8 chars"}
        assert [f["got"] for f in result.failures if "question" in f] == ["The shed code is 4472."]


@pytest.mark.parametrize("extra, chats, questions", [(["--phrasing", "written"], 1, 8),
                                                     (["--values", "random", "--chats", "1"], 1, 8)])
def test_eval_runs_the_written_set_and_random_values_with_exact_copy_in_its_json(extra, chats, questions):
    proc = kvchat("eval", "--chats", "1", "--min-rounds", "16", "--max-rounds", "16", "--min-distance", "8",
                  "--mode", "compare", "--device", "cpu", "--json", *extra, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["chats"] == chats and out["questions"] == questions and out["min_distance"] == 8
    copy = out["exact_copy"]
    assert copy["questions"] == questions and 0 <= copy["correct"] <= questions
    assert sum(v["questions"] for v in copy["by_length"].values()) >= questions
    if "written" in extra:
        assert out["values"] == out["phrasing"] == "written" and set(copy["by_kind"]) <= set(WRITTEN_KINDS)
    else:
        assert out["values"] == "random" and out["phrasing"] == "heldout"


def test_eval_refuses_random_values_for_the_written_set_and_chats_too_short_in_one_line():
    for args, says in ((["--phrasing", "written", "--values", "random"], "has its own values"),
                       (["--values", "random", "--min-rounds", "12", "--max-rounds", "12"], "--min-distance")):
        proc = kvchat("eval", "--chats", "1", "--device", "cpu", *args, check=False)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, \
            proc.stderr


def test_generator_values_are_scored_on_exact_copy_too():
    """In the generator's chats the value is each asked fact's latest (Question.values); a reply that equals the
    expected one copies every value."""
    from kvchat.app.bench.evaluate import value_kinds

    for dlg in d.dialogues("heldout", 20, 0, 20, 30, "heldout"):
        for q in dlg.questions:
            assert all(copies_value(dlg.rounds[q.round_index].assistant, v) for v in q.values)
            assert len(value_kinds(q)) == len(q.values) and set(value_kinds(q)) <= {
                "names", "cities", "colors", "foods", "animals", "numbers", "birthdays", "weekdays"}
