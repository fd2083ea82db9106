"""The memory dialogues: deterministic, disjoint splits, questions that really need earlier rounds."""

from __future__ import annotations

import random

from kvchat.engine.chat_format import ChatFormat, Conversation
from kvchat.engine.dialogues import POSITIONS, QUESTION_KINDS, dialogues, pools
from kvchat.engine.train import CHAT_TEMPLATE, round_text


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
    words = {w.strip(".,?!'s") for w in text.split()}
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
    from kvchat.engine.tokenizer import Tokenizer

    fmt = ChatFormat(Tokenizer(models.get(style="chatml", arch="qwen2")), CHAT_TEMPLATE)
    dlg = dialogues("train", 1, 0, 6, 6)[0]
    texts = fmt.round_texts(Conversation(dlg.rounds, dlg.system))
    assert texts == [round_text(r.user, r.assistant, dlg.system if i == 0 else None) for i, r in enumerate(dlg.rounds)]
