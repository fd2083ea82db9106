"""Facts about anything (engine/data/open_facts.py, `TrainConfig.subjects`): what its subjects may not contain,
that it reaches training chats alone, that its replies copy what was told, and that nothing it can write is a near
copy of a held-out or dev template or of the hand-written set."""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest

from test_dialogues import _grams, _words
from test_small_talk import _held_out_and_dev_grams

from kvchat.engine.data import dialogues as d
from kvchat.engine.data import open_facts

DET, WORD, VALUE = object(), object(), "x"  # a determiner, a vocabulary word, the value (masked as x)


def _patterns() -> set[tuple]:
    """Every four tokens in a row an open fact's sentences (its states, asks and recalls) can have: fixed words,
    DET (one of the determiners), WORD (one of the vocabulary's), the value masked as x. A made-up word (a quarter
    of the subjects have one) never is a word of another sentence, so it is left out."""
    slot = d.open_slot("my", "S", "codes")
    templates = [t.replace("{v}", "x") for g in (slot.states, slot.asks, slot.recalls) for t in g.train]
    out = set()
    for template, n in itertools.product(templates, (1, 2, 3)):
        tokens = []
        for w in _words(template, ""):
            if w == "my":
                tokens.append(DET)
            elif w in ("s", "s's"):
                tokens += [WORD] * n
            else:
                tokens.append(w)
        out |= {tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)}
    return out


def _writable(gram: tuple[str, ...], patterns: set[tuple]) -> bool:
    """Whether an open fact can write the four words `gram`."""
    dets, vocabulary = set(open_facts.DETERMINERS), set(open_facts.HEADS) | set(open_facts.MODIFIERS)
    for pattern in patterns:
        if all(p == g or (p is DET and g in dets) or (p is WORD and g in vocabulary) for p, g in zip(pattern, gram)):
            return True
    return False


def test_its_subjects_are_no_held_out_or_dev_noun_or_value():
    vocabulary = set(open_facts.HEADS) | set(open_facts.MODIFIERS)
    assert len(open_facts.HEADS) > 40 and len(open_facts.MODIFIERS) > 80
    assert not vocabulary & d._OPEN_AVOID
    rng = random.Random(0)
    subjects = [open_facts.subject(rng, d.pseudo_word, d._OPEN_AVOID) for _ in range(3000)]
    assert len(set(subjects)) > 2000  # (a head alone repeats: 78 of them)
    assert all(1 <= len(s.split()) <= 3 and not set(s.split()) & d._OPEN_AVOID for s in subjects)
    made_up = [s for s in subjects if set(s.split()) - vocabulary]
    assert 0.15 < len(made_up) / len(subjects) < 0.35  # a quarter with a made-up word


def test_it_shares_no_four_words_with_held_out_or_dev_templates():
    patterns = _patterns()
    others = _held_out_and_dev_grams()
    assert len(patterns) > 100 and len(others) > 1000
    shared = sorted(" ".join(g) for g in others if _writable(g, patterns))
    assert not shared, shared[:10]
    # the check does catch a sentence an open fact could have written
    assert _writable(("what", "was", "my", "x"), patterns) is False  # (a subject is never the value)
    assert _writable(("what", "was", "our", "pension"), patterns)


def test_it_shares_no_four_words_with_the_written_set():
    """As tests/test_written_eval.py keeps the generator's templates from the hand-written set: no fact or question
    of it (its value masked) is four words in a row an open fact could write, whatever its subject."""
    from kvchat.app.bench.written_eval import written_triples

    patterns = _patterns()
    shared = []
    for t in written_triples():
        for text, value in ((t["fact"], t["answer"].lower()), (t["question"], "")):
            shared += [(" ".join(g), text) for g in _grams(text, value) if _writable(g, patterns)]
    assert not shared, shared[:10]


def _chats(phrasing: str, subjects: float, seed: int = 3):
    split = "train" if phrasing == "train" else "heldout"
    return d.dialogues(split, 10, seed, 30, 40, phrasing=phrasing, noise=6 if phrasing == "train" else 0,
                       mix="copy", mix_share=0.5, subjects=subjects)


def test_training_chats_with_subjects_tell_and_ask_open_facts_and_no_other_chat_does():
    assert not any(k.startswith("open:") for dlg in _chats("train", 0.0) for k in dlg.known_before[-1])
    chats = _chats("train", 0.5)
    told = [(dlg, k) for dlg in chats for k in dlg.known_before[-1] if k.startswith("open:")]
    assert len(told) > 20
    asked = [(dlg, q) for dlg in chats for q in dlg.questions if any(k.startswith("open:") for k in q.keys)]
    assert len(asked) > 20
    for dlg, q in asked:
        reply = dlg.rounds[q.round_index].assistant
        assert all(v in reply for v in q.values), (reply, q.values)  # the reply copies each value told
    never = [r for dlg in chats for r in dlg.rounds if r.assistant == d.UNKNOWN_REPLY]
    assert never
    for phrasing in ("heldout", "dev"):
        assert _chats(phrasing, 0.5) == _chats(phrasing, 0.0)


# sha256 of repr(chats), computed from the code before facts about anything were added (6a2bd0f): without them
# (subjects=0) every copy-mix chat is the one it was, and no chat but a training one ever has them.
BEFORE_OPEN_FACTS = {
    "copy-train-talk-requests": "3ba300f80bc1e42d",
    "copy-heldout": "8d746684c03775cb",
    "copy-dev": "db1a957486e86813",
    "copy-heldout-values-train-phrasing": "018bad3cf4404a40",
}
_CALLS = {
    "copy-train-talk-requests": lambda s: d.dialogues("train", 6, 100_000, 32, 60, noise=6, never_told=50, wide=True,
                                                      mix="copy", mix_share=0.5, talk=0.7, requests=0.7, subjects=s),
    "copy-heldout": lambda s: d.dialogues("heldout", 6, 0, 44, 52, "heldout", mix="copy", subjects=s),
    "copy-dev": lambda s: d.dialogues("heldout", 6, 1, 44, 52, "dev", mix="copy", subjects=s),
    # held-out values in trained phrasings (the benchmarks' and calibrations' chats): no facts about anything either
    "copy-heldout-values-train-phrasing": lambda s: d.dialogues("heldout", 6, 2, 20, 30, "train", mix="copy",
                                                                subjects=s),
}


@pytest.mark.parametrize("call", sorted(BEFORE_OPEN_FACTS))
def test_chats_without_open_facts_are_byte_for_byte_the_ones_before_them(call):
    digest = hashlib.sha256(repr(_CALLS[call](0.0)).encode()).hexdigest()[:16]
    assert digest == BEFORE_OPEN_FACTS[call]
    with_them = hashlib.sha256(repr(_CALLS[call](0.5)).encode()).hexdigest()[:16]
    assert (with_them == digest) == (call != "copy-train-talk-requests")  # training chats alone change


def test_a_fact_about_anything_is_found_by_its_subject_alone():
    """Two open facts of one chat share no word of their subjects, so a question fits one fact only."""
    for dlg in _chats("train", 0.8, seed=5):
        subjects = [set(d.slot_for(k).keywords) for k in dlg.known_before[-1] if k.startswith("open:")]
        for a, b in itertools.combinations(subjects, 2):
            assert not a & b, (a, b)


def test_its_vocabulary_shares_no_word_with_the_written_set():
    """The hand-written set measures facts about things no training chat named: no vocabulary word is one of its
    words (read here to compare, never by training code)."""
    import re

    from kvchat.app.bench.written_eval import written_triples

    words = {w.lower() for t in written_triples() for k in ("fact", "question", "reply", "subject")
             for w in re.findall(r"[A-Za-z]+", t[k])}
    assert len(words) > 1000
    shared = sorted((set(open_facts.HEADS) | set(open_facts.MODIFIERS)) & words)
    assert not shared, shared
