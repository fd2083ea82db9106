"""Training chats' small talk from a grammar (engine/data/small_talk.py, `TrainConfig.talk`): what it may not
contain, that the checks see every sentence it can make, and that it reaches training chats alone."""

from __future__ import annotations

import random

from test_dialogues import _grams, _phrasing_groups

from kvchat.engine.data import dialogues as d
from kvchat.engine.data import small_talk

FRAMES = {"called", "named", "name", "names", "live", "lives", "born", "favorite", "favourite", "love", "loves",
          "remember", "are"}  # the words that tell a fact


def _values_and_named_things() -> set[str]:
    """Every word of the value pools, the named things' nouns, the relations and the breeds, lower case."""
    pools = {w.lower() for w in d._FIRST + d._CITIES + d._COLORS + d._FOODS + d._ANIMALS + d._MONTHS + d._WEEKDAYS}
    nouns = {w.lower() for w in d._NOUNS_TRAIN + d._NOUNS_HELDOUT + d._NOUNS_DEV}
    relations = {w for r in d._RELATIONS for w in r.split()}
    return pools | nouns | relations | {b.lower() for b in d._BREEDS}


def _held_out_and_dev_grams() -> set[tuple[str, ...]]:
    """Four words in a row of the held-out small talk and of every held-out or dev template (the thing told or asked
    masked)."""
    others = set().union(*(_grams(f) for f in d._FILLER_HELDOUT))
    for members, subject in _phrasing_groups():
        others |= set().union(*(_grams(t, subject) for g in members for t in g.heldout + g.dev))
    return others


def test_its_words_are_no_value_named_thing_relation_or_fact_frame():
    words = small_talk.vocabulary()
    assert len(words) > 150
    assert not words & (_values_and_named_things() | FRAMES | {"is"})


def test_every_four_words_in_a_row_it_can_write_are_enumerated():
    """The checks below run over `four_word_sequences`, every sentence's; sampled sentences' are all among them
    (so the enumeration is not missing a form's windows)."""
    grams = small_talk.four_word_sequences()
    rng = random.Random(0)
    for _ in range(3000):
        assert _grams(small_talk.everyday_sentence(rng)) <= grams
    assert len(grams) > 5000


def test_it_shares_no_four_words_with_held_out_or_dev_sentences():
    """Training-only small talk: no four words in a row in common with the held-out chats' small talk, or with a
    held-out or dev template of any group (the thing told or asked masked)."""
    grams = small_talk.four_word_sequences()
    others = _held_out_and_dev_grams()
    assert len(others) > 1000 and not grams & others
    # the check does catch a held-out sentence the grammar could have written
    assert _grams("We watched the sunset from the hill and stayed out until it got cold.") & others


def test_training_chats_with_talk_draw_their_small_talk_from_it_and_no_other_chat_does():
    def users(phrasing, talk, seed=3):
        split = "train" if phrasing == "train" else "heldout"
        return [r.user for dlg in d.dialogues(split, 6, seed, 30, 40, phrasing=phrasing, talk=talk)
                for r in dlg.rounds]

    grammar = small_talk.four_word_sequences()

    def from_grammar(texts):
        return sum(1 for t in texts for s in t.split(". ") if len(_grams(s)) > 2 and _grams(s) <= grammar)

    assert from_grammar(users("train", 0.0)) == 0
    assert from_grammar(users("train", 0.8)) > 30
    for phrasing in ("heldout", "dev"):
        assert users(phrasing, 0.8) == users(phrasing, 0.0)  # a measuring set is the same chats either way
    # without it, training chats are exactly those of before (the same draws from the same seed)
    assert d.dialogues("train", 4, 9, 30, 40) == d.dialogues("train", 4, 9, 30, 40, talk=0.0)


# -- the requests (`TrainConfig.requests`) --

def test_requests_words_are_no_value_named_thing_relation_or_fact_frame():
    """As the small talk's, but "is" (a request may ask "what is ..."): a polite reply's prompt must not be taken for
    a fact by its words."""
    topics = {w for t in d._TOPICS_HELDOUT + d._TOPICS_DEV for w in t.split()} - {"the"}
    words = small_talk.vocabulary(small_talk.REQUEST_FORMS)
    assert len(words) > 150
    assert not words & (_values_and_named_things() | FRAMES | {"my"} | topics)


def test_every_four_words_of_a_request_are_enumerated():
    grams = small_talk.four_word_sequences(small_talk.REQUEST_FORMS)
    rng = random.Random(0)
    for _ in range(3000):
        form = rng.choice(small_talk.REQUEST_FORMS)
        assert _grams(small_talk._written(form, rng)) <= grams
    assert len(grams) > 2000


def test_requests_share_no_four_words_with_held_out_or_dev_sentences():
    """Numbers and topics masked as the templates hold them ({a}, {b}, {t}): no four words in a row in common with a
    held-out or dev template of any group, nor with the held-out small talk; the topics are the training's."""
    grams = small_talk.four_word_sequences(small_talk.REQUEST_FORMS)
    others = _held_out_and_dev_grams()
    assert not grams & others
    # the check does catch a held-out request the grammar could have written
    assert _grams("Could you describe {t} in detail?") & others
    rng = random.Random(1)
    made = [small_talk.everyday_request(rng, d._TOPICS) for _ in range(500)]
    assert not any(t in m.lower() for m in made for t in d._TOPICS_HELDOUT + d._TOPICS_DEV)
    assert len(set(made)) > 450


def test_training_chats_with_requests_draw_them_from_it_and_no_other_chat_does():
    def prompts(phrasing, requests, seed=3):
        split = "train" if phrasing == "train" else "heldout"
        return [r for dlg in d.dialogues(split, 8, seed, 30, 40, phrasing=phrasing, requests=requests)
                for r in dlg.rounds]

    templates = d._REQUESTS.train + d._REQUESTS.more
    own = small_talk.vocabulary(small_talk.REQUEST_FORMS) - {w for t in (*templates, *d._TOPICS)
                                                             for w in small_talk._words(t)}

    def from_grammar(rounds):  # a request with a word only the grammar writes
        return [r for r in rounds if r.assistant == d.DEMO_REPLY and set(small_talk._words(r.user)) & own]

    assert not from_grammar(prompts("train", 0.0))
    drawn = from_grammar(prompts("train", 0.8))
    assert len(drawn) > 8
    for phrasing in ("heldout", "dev"):
        assert prompts(phrasing, 0.8) == prompts(phrasing, 0.0)
    assert d.dialogues("train", 4, 9, 30, 40) == d.dialogues("train", 4, 9, 30, 40, requests=0.0)
