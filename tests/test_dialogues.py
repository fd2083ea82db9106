"""The memory dialogues: deterministic, disjoint splits, questions that really need earlier rounds."""

from __future__ import annotations

import random

import pytest

from kvchat.engine.text.chat_format import ChatFormat, Conversation
from kvchat.engine.data.dialogues import POSITIONS, QUESTION_KINDS, dialogues, pools
from kvchat.engine.train.trainer import CHAT_TEMPLATE, round_text


def test_deterministic_from_the_seed():
    a = dialogues("train", 5, 3, 10, 20)
    b = dialogues("train", 5, 3, 10, 20)
    assert [[(r.user, r.assistant) for r in d.rounds] for d in a] == [[(r.user, r.assistant) for r in d.rounds] for d in b]
    c = dialogues("train", 5, 4, 10, 20)
    assert [d.rounds[0].user for d in a] != [d.rounds[0].user for d in c]


def test_training_and_heldout_values_are_disjoint():
    train, held = pools("train"), pools("heldout")
    assert not set(train.numbers) & set(held.numbers)
    rng = random.Random(0)
    real = {w.lower() for f in ("names", "cities", "colors", "foods", "animals") for w in getattr(held, f)}
    made_up = {train.pick(f, rng).lower() for f in ("names", "cities", "colors", "foods", "animals") for _ in range(3000)}
    assert real and not made_up & real
    # and the chats themselves: no held-out value ever appears in a training chat
    text = " ".join(r.user + " " + r.assistant for d in dialogues("train", 300, 0, 10, 30) for r in d.rounds).lower()
    words = {w.strip(".,?!:;()").removesuffix("'s") for w in text.split()}
    assert not {w for w in real if w in words}


def test_every_question_is_answered_by_earlier_rounds():
    seen_kinds, seen_positions = set(), set()
    for dlg in dialogues("heldout", 60, 0, 20, 40):
        assert len(dlg.rounds) >= 20
        for q in dlg.questions:
            seen_kinds.add(q.kind)
            seen_positions.add(q.position)
            assert q.distance >= 1
            answer = dlg.rounds[q.round_index].assistant
            for value in q.values:
                assert value in answer
                told = [i for i, r in enumerate(dlg.rounds[: q.round_index]) if value in r.user]
                assert told and q.round_index - min(told) >= 1
                assert value not in dlg.rounds[q.round_index].user  # the question does not give it away
    assert seen_kinds == set(QUESTION_KINDS)
    assert seen_positions == set(POSITIONS)


def test_corrected_questions_expect_the_latest_value():
    for dlg in dialogues("heldout", 80, 1, 30, 40):
        for q in dlg.questions:
            if q.kind != "corrected":
                continue
            value = dlg.rounds[q.round_index].assistant.rstrip(".").split()[-1]
            corrections = [r.user for r in dlg.rounds[: q.round_index] if ", not " in r.user and value in r.user]
            assert corrections, dlg.rounds[q.round_index]
            return
    raise AssertionError("no corrected question found")


def test_round_text_matches_the_shipped_template(models):
    from kvchat.engine.text.tokenizer import Tokenizer

    fmt = ChatFormat(Tokenizer(models.get(style="chatml", arch="qwen2")), CHAT_TEMPLATE)
    dlg = dialogues("train", 1, 0, 6, 6)[0]
    texts = fmt.round_texts(Conversation(dlg.rounds, dlg.system))
    assert texts == [round_text(r.user, r.assistant, dlg.system if i == 0 else None) for i, r in enumerate(dlg.rounds)]


def _all_templates():
    from kvchat.engine.data import dialogues as d

    groups = [d._REMEMBER, d._LIST, d._CORRECT_FULL, d._CORRECT_SHORT, d._GREETINGS, d._THANKS, d._REQUESTS,
              *d.COPY_WRAPPERS]
    for slot in [*d.SLOTS, d.called_slot("my", "boat"), d.called_slot("the", "sailboat"), *d.copy_mix_slots()]:
        groups += [slot.states, slot.asks, slot.recalls]
    return groups


def test_held_out_and_dev_phrasings_are_new_templates_not_new_values():
    from kvchat.engine.data import dialogues as d

    for templates in _all_templates():
        sets = [{t.lower() for t in getattr(templates, p)} for p in d.PHRASINGS]
        sets[0] |= {t.lower() for t in templates.more}  # the wide training phrasings are training phrasings
        assert all(sets), templates
        assert not sets[0] & sets[1] and not sets[0] & sets[2] and not sets[1] & sets[2], templates
    nouns = [set(d._NOUNS_TRAIN), set(d._NOUNS_HELDOUT), set(d._NOUNS_DEV)]
    topics = [set(d._TOPICS), set(d._TOPICS_HELDOUT), set(d._TOPICS_DEV)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not nouns[a] & nouns[b] and not topics[a] & topics[b]


def test_every_phrasing_family_and_out_of_scope_kind_occurs_with_its_polite_reply():
    from kvchat.engine.data.dialogues import (ASKED_FAMILIES, OUT_OF_SCOPE_KINDS, POLITE_REPLIES, STATED_FAMILIES,
                                         UNKNOWN_REPLY)

    for phrasing in ("train", "heldout", "dev"):
        stated, asked, kinds = set(), set(), set()
        for dlg in dialogues("heldout", 40, 2, 30, 40, phrasing):
            assert dlg.phrasing == phrasing
            stated |= {q.stated for q in dlg.questions}
            asked |= {q.asked for q in dlg.questions}
            for o in dlg.out_of_scope:
                kinds.add(o.kind)
                assert dlg.rounds[o.round_index].assistant in POLITE_REPLIES
                if o.kind == "unknown":
                    assert dlg.rounds[o.round_index].assistant == UNKNOWN_REPLY
        assert stated == set(STATED_FAMILIES) and asked == set(ASKED_FAMILIES) and kinds == set(OUT_OF_SCOPE_KINDS)


def test_a_typo_changes_one_letter_of_one_word_and_spares_protected_words():
    from kvchat.engine.data.dialogues import typo

    rng = random.Random(0)
    for _ in range(200):
        text = "What is the boat called?"
        slipped = typo(text, rng, protect=("boat",))
        changed = [(a, b) for a, b in zip(text.split(), slipped.split()) if a != b]
        assert len(changed) <= 1 and "boat" in slipped
        if changed:
            a, b = changed[0]
            assert abs(len(a) - len(b)) <= 1


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5, 6])
def test_training_noise_changes_the_messages_never_the_facts(level):
    plain = dialogues("train", 20, 5, 20, 30)
    noisy = dialogues("train", 20, 5, 20, 30, noise=level)
    assert [r.user for d in plain for r in d.rounds] != [r.user for d in noisy for r in d.rounds]
    for dlg in noisy:
        for q in dlg.questions:
            for value in q.values:
                assert value in dlg.rounds[q.round_index].assistant
                assert any(value in r.user for r in dlg.rounds[: q.round_index])


def test_frame_noise_keeps_the_value_and_the_words_that_say_what_is_told():
    from kvchat.engine.data.dialogues import Dialogue, _Writer, pools

    writer = _Writer(random.Random(0), pools("train"), "train", Dialogue(None), noise=3)
    text = "Please remember that my locker number is 417 by the way."
    changed = 0
    for _ in range(500):
        noisy = writer.with_frame_noise(text, ("locker", "number", "417"))
        changed += noisy != text
        words = [w.strip(".,?!:;-") for w in noisy.split()]
        assert "417" in words and "locker" in words and "number" in words
        i = words.index("locker")
        assert words[i + 1] == "number"  # nothing made up is put between (or next to) the protected words
    assert 250 < changed < 500  # most messages get an edit; some stay as typed
    quiet = _Writer(random.Random(0), pools("train"), "train", Dialogue(None), noise=1)
    assert all(quiet.with_frame_noise(text, ("417",)) == text for _ in range(50))


def test_level_5_puts_everyday_words_in_and_never_ones_that_tell_something():
    from kvchat.engine.data.dialogues import _FILLER_WORDS, Dialogue, _Writer, pools

    writer = _Writer(random.Random(2), pools("train"), "train", Dialogue(None), noise=5)
    words = [writer.odd_word() for _ in range(400)]
    everyday = sum(w in _FILLER_WORDS for w in words)
    assert 140 < everyday < 260  # about half; the rest made up
    assert not {"home", "name", "neighbors", "piano", "my"} & set(_FILLER_WORDS)
    quiet = _Writer(random.Random(2), pools("train"), "train", Dialogue(None), noise=4)
    assert not any(quiet.odd_word() in _FILLER_WORDS for _ in range(200))


def test_never_told_weighs_questions_about_what_was_never_said():
    def share(weight):
        chats = dialogues("train", 30, 3, 30, 40, noise=3, never_told=weight)
        kinds = [o.kind for d in chats for o in d.out_of_scope]
        return kinds.count("unknown") / len(kinds)

    assert 0.15 < share(25) < 0.35 and 0.4 < share(75) < 0.65


def test_level_4_ends_questions_in_unknown_words_and_keeps_what_is_asked():
    from kvchat.engine.data.dialogues import Dialogue, _Writer, pools, slot_for

    writer = _Writer(random.Random(1), pools("train"), "train", Dialogue(None), noise=4)
    tails = []
    writer.with_tail = lambda text: tails.append(_Writer.with_tail(writer, text)) or tails[-1]
    slot = slot_for("locker")
    for _ in range(400):
        words = [w.strip(".,?!:;-") for w in writer.question_text(slot, "plain").split()]
        assert "locker" in words and "number" in words
    assert 60 < len(tails) < 140  # a quarter of the questions
    for _ in range(50):
        tail = _Writer.with_tail(writer, "What is my locker number?")
        assert tail.startswith("What is my locker number") and tail.endswith("?") and len(tail.split()) in (7, 8)
    # levels 1-3 never call it
    quiet = _Writer(random.Random(1), pools("train"), "train", Dialogue(None), noise=3)
    quiet.with_tail = lambda text: pytest.fail("a tail at level 3")
    for _ in range(100):
        quiet.question_text(slot, "plain")


def _words(text: str, subject: str) -> list[str]:
    text = text.lower().replace(subject, " X ") if subject else text.lower()
    return [w for w in (w.strip(".,?!:;()-") for w in text.split()) if w]


def _grams(text: str, subject: str = "") -> set[tuple[str, ...]]:
    """The four-word sequences of a template: words lower-cased, punctuation stripped, the thing told or asked
    masked as X (the rule that keeps two sets of phrasings from being near copies)."""
    w = _words(text, subject)
    return {tuple(w[i:i + 4]) for i in range(len(w) - 3)}


def _phrasing_groups():
    """(template groups, the subject they mask): the groups a phrasing is compared within, one per kind of sentence
    (a fact's states, asks and recalls together, the wrappers together)."""
    from kvchat.engine.data import dialogues as d

    groups = [([g], "") for g in (d._REMEMBER, d._LIST, d._CORRECT_FULL, d._CORRECT_SHORT, d._GREETINGS, d._THANKS,
                                   d._REQUESTS, *d.COPY_WRAPPERS)]
    groups.append(([d._OPENERS, d._CLOSERS, d._ASK_OPENERS, d._ASK_CLOSERS], ""))
    for slot in [*d.SLOTS, d.called_slot("my", "boat"), d.called_slot("the", "sailboat"), *d.copy_mix_slots()]:
        subject = slot.key.removeprefix("called:") if slot.key.startswith("called:") else \
            slot.answer.removeprefix("Your ").split(" is ")[0].split(" are ")[0].lower()
        groups.append(([slot.states, slot.asks, slot.recalls], subject))
    return groups


def test_wide_phrasings_share_no_four_words_with_held_out_or_dev_ones():
    """The extra training phrasings must not be near copies of what measures or chooses the model: no four words
    in a row (the thing told or asked masked) in common with a held-out or dev template of the same group."""
    n_more = 0
    for members, subject in _phrasing_groups():
        others = [t for g in members for t in g.heldout + g.dev]
        other_grams = set().union(*(_grams(t, subject) for t in others))
        for g in members:
            n_more += len(g.more)
            for t in g.more:
                assert t.lower() not in {o.lower() for o in others}, t
                assert not _grams(t, subject) & other_grams, t
    assert n_more > 300


def test_held_out_templates_share_no_four_words_with_trained_ones():
    """Held-out means held out: no held-out template shares four words in a row (the thing told or asked masked)
    with a template of its group that the model was trained on (`train` or `more`), nor with a dev one; and held-out
    chats have their own small talk and their own join of two questions."""
    from kvchat.engine.data import dialogues as d

    n_held = 0
    for members, subject in _phrasing_groups():
        trained = set().union(*(_grams(t, subject) for g in members for t in g.train + g.more))
        dev = set().union(*(_grams(t, subject) for g in members for t in g.dev))
        for g in members:
            n_held += len(g.heldout)
            for t in g.heldout:
                assert not _grams(t, subject) & trained, t
                assert not _grams(t, subject) & dev, t
    assert n_held > 200
    # small talk: as many sentences as the trained one (so held-out chats draw the same numbers), none in common
    assert len(d._FILLER_HELDOUT) == len(d._FILLER)
    trained_filler = set().union(*(_grams(f) for f in d._FILLER))
    assert not any(_grams(f) & trained_filler for f in d._FILLER_HELDOUT)
    # the join of two questions: three-word questions, so that every four words in a row cross the join
    def joined(join):
        return _grams(join.format(a="q1 q2 q3", a_end="?", b="r1 r2 r3", B="R1 r2 r3"))

    trained_joins = set().union(*(joined(j) for j in d._TWO_QUESTIONS))
    assert d._TWO_QUESTIONS_HELDOUT and not any(joined(j) & trained_joins for j in d._TWO_QUESTIONS_HELDOUT)


def test_held_out_chats_use_their_own_small_talk_and_join_the_others_never_do():
    from kvchat.engine.data import dialogues as d

    def users(phrasing, **kw):
        chats = dialogues("heldout", 30, 4, 30, 40, phrasing=phrasing, **kw)
        two = [dlg.rounds[q.round_index].user for dlg in chats for q in dlg.questions if q.kind == "multi"]
        return " ".join(r.user for dlg in chats for r in dlg.rounds), sum(". Also, " in t or "? Also, " in t
                                                                          for t in two) / len(two)

    held, joined = users("heldout")
    assert sum(f in held for f in d._FILLER_HELDOUT) >= 8 and not any(f in held for f in d._FILLER)
    assert joined == 1
    for text, joined in (users("train"), users("dev"), users("train", noise=1, wide=True)):
        assert sum(f in text for f in d._FILLER) >= 8 and not any(f in text for f in d._FILLER_HELDOUT)
        assert joined == 0


def test_questions_say_whether_training_saw_their_values():
    """Weekdays and months (meeting days, birthdays) are the only values training and held-out chats share: a
    question about one is marked, so that the evaluation can report it apart."""
    from kvchat.engine.data import dialogues as d

    months, weekdays = set(d._MONTHS), set(d._WEEKDAYS)
    counts = {True: 0, False: 0}
    for split in ("heldout", "train"):
        for phrasing in d.PHRASINGS:
            for dlg in dialogues(split, 30, 6, 30, 40, phrasing=phrasing):
                for q in dlg.questions:
                    shared = any(v in weekdays or v.split(" ")[0] in months for v in q.values)
                    assert q.values_seen_in_training == shared, q
                    counts[shared] += 1
    assert counts[True] > 20 and counts[False] > 5 * counts[True]
    # every other value kind is split: numbers by residue, the rest real words held out, made-up ones in training
    train, held = d.pools("train"), d.pools("heldout")
    assert not set(train.numbers) & set(held.numbers) and train.synthetic and not held.synthetic
    assert {s.field for s in d.SLOTS} - d.SHARED_VALUE_FIELDS <= {"names", "cities", "colors", "foods", "animals",
                                                                   "numbers"}


def test_wide_chats_use_the_more_phrasings_and_the_others_never_do():
    plain = " ".join(r.user for dlg in dialogues("train", 60, 0, 30, 40, noise=1) for r in dlg.rounds)
    wide = " ".join(r.user for dlg in dialogues("train", 60, 0, 30, 40, noise=1, wide=True) for r in dlg.rounds)
    for marker in ("Heads up:", "Nope,", " answers to ", "Multiply "):
        assert marker not in plain
    assert sum(m in wide for m in ("Heads up:", "Nope,", " answers to ", "Multiply ", "Give me my", "Morning!")) >= 4
    # held-out and dev chats ignore the flag: it is for training only
    def held_out(**kw):
        return [r.user for dlg in dialogues("heldout", 5, 0, 20, 30, phrasing="heldout", **kw) for r in dlg.rounds]

    assert held_out(wide=True) == held_out()
