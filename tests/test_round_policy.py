"""Round Attention as a KV policy: the strategies, layer-split attention, and the policy end to end."""

from __future__ import annotations

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.model.attention import SplitAttend
from kvchat.app.session.policies import build_policy
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.round_attention import select_rounds
from kvchat.errors import KvchatError

ROUNDS = [Round("My name is Ada.", "Nice to meet you, Ada."), Round("My sister's name is Mira.", "Noted."),
          Round("I live in Lisbon.", "Lisbon is lovely."), Round("My dog is called Rex.", "Good name.")]
SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def test_strategies_pick_what_the_paper_says():
    mass = torch.tensor([0.02, 0.5, 0.12, 0.06, 0.3])
    assert select_rounds(mass, "threshold") == [1, 2, 4]
    assert select_rounds(mass, "topk", k=2) == [1, 4]
    assert select_rounds(mass, "topk", k=0.1) == [1]  # top-10% of 5 rounds: one
    assert select_rounds(torch.tensor([0.01] * 20 + [0.8]), "adaptive") == [20]
    # Nothing passes the bar: the round of most mass is kept all the same.
    assert select_rounds(torch.full((4,), 0.25), "threshold", threshold=0.5) == [0]
    assert select_rounds(torch.tensor([]), "topk") == []
    with pytest.raises(KvchatError, match="accepted: threshold, topk, adaptive"):
        select_rounds(mass, "nearest")


def chat_cache(engine):
    spans = engine.chat.round_spans(Conversation(ROUNDS, SYSTEM))
    cache = engine.new_cache(1024)
    starts = []
    for span in spans:
        starts.append(cache.length)
        prefill(engine.model, cache, span)
    prompt = engine.chat.open_round_tokens(Conversation(ROUNDS, SYSTEM), "What is my sister's name?")
    return cache, starts, prompt


def logits_under(engine, attend):
    cache, _, prompt = chat_cache(engine)
    return prefill(engine.model, cache, prompt, attend=attend)


def test_split_attention_that_keeps_everything_is_full_attention(engine):
    cache, _, _ = chat_cache(engine)
    every = torch.arange(cache.length)
    full = logits_under(engine, None)
    assert torch.equal(logits_under(engine, SplitAttend(3, every)), logits_under(engine, every))
    assert torch.allclose(logits_under(engine, SplitAttend(3, every)), full, atol=1e-4)
    # Dropping rounds from the upper layers changes what the model computes.
    assert not torch.allclose(logits_under(engine, SplitAttend(3, torch.arange(10))), full, atol=1e-4)


def test_policy_keeps_lower_layers_whole_and_upper_layers_to_the_chosen_rounds(engine):
    cache, starts, prompt = chat_cache(engine)
    policy = make_policy("round-topk", engine, watershed=4, k=2)
    attend = policy.visible_slots(cache, starts, prompt, model=engine.model)
    # The watershed layer itself still sees every round; the first round is always kept, and two more.
    assert isinstance(attend, SplitAttend) and attend.split == 5 and len(policy.last_selection) == 3
    assert policy.last_selection[0] == 0
    bounds = starts + [cache.length]
    expected = torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in policy.last_selection])
    assert torch.equal(attend.upper, expected)
    assert cache.length == bounds[-1]  # scoring the rounds leaves the cache's length alone
    out = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=12,
                   stop_tokens=engine.tokenizer.eog_ids, stop_strings=engine.chat.stop_strings, attend=attend)
    assert out.tokens


def test_keeping_every_round_answers_as_the_full_cache_does(engine):
    answers = []
    for policy in (make_policy("full"), make_policy("round-topk", engine, watershed=4, k=len(ROUNDS))):
        cache, starts, prompt = chat_cache(engine)
        attend = policy.visible_slots(cache, starts, prompt, model=engine.model)
        out = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=12,
                       stop_tokens=engine.tokenizer.eog_ids, stop_strings=engine.chat.stop_strings, attend=attend)
        answers.append(out.text)
    assert answers[0] == answers[1] == "Your sister's name is Mira."


def test_bad_options_are_one_line_errors(engine):
    with pytest.raises(KvchatError, match="positive count"):
        make_policy("round", engine, watershed=3, k=0)
    with pytest.raises(KvchatError, match="threshold"):
        make_policy("round-threshold", engine, watershed=3, threshold=1.5)
    with pytest.raises(KvchatError, match="needs a model"):
        build_policy("round")  # the watershed layer comes from a model's calibration
    with pytest.raises(KvchatError, match="needs watershed= from its model's calibration"):
        make_policy("round")  # the pure constructor never calibrates
    cache, starts, prompt = chat_cache(engine)
    with pytest.raises(KvchatError, match="no layer above it in the model's 8 layers"):
        make_policy("round", engine, watershed=7)
    with pytest.raises(KvchatError, match="no option tokens"):
        make_policy("round", engine, watershed=3, tokens=4)
    with pytest.raises(KvchatError, match="max_idle"):
        make_policy("round", engine, watershed=3, max_idle=-1)


def test_the_first_round_is_always_kept_and_the_rest_renormalized(engine):
    policy = make_policy("round-threshold", engine, watershed=3)
    # The sink round takes most of the mass; among the others, 0.05 of 0.2 is a quarter: above the 0.1 bar.
    assert policy.choose(torch.tensor([0.8, 0.05, 0.005, 0.145])) == [0, 1, 3]
    assert policy.choose(torch.tensor([1.0])) == [0]
