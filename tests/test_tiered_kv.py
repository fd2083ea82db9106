"""Tiered KV (engine.kv.tiered): the lower layers of every round on the device, the upper layers of the chosen
rounds only, computing exactly what layer-split attention over the same K/V computes."""

from __future__ import annotations

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.kv.key_bounds import BoundsTable, key_bounds
from kvchat.engine.model.attention import SplitAttend
from kvchat.engine.policies import make_policy
from kvchat.engine.kv.tiered import TieredKV

ROUNDS = [Round("My name is Ada.", "Nice to meet you, Ada."), Round("My sister's name is Mira.", "Noted."),
          Round("I live in Lisbon.", "Lisbon is lovely."), Round("My dog is called Rex.", "Good name."),
          Round("I work as a nurse.", "That is a demanding job."), Round("My car is blue.", "A fine colour.")]
SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
QUESTION = "What is my sister's name?"


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


def tiered_chat(engine, **options) -> tuple[TieredKV, list[int]]:
    # Rechecks (tested on their own below) off unless asked for: the other tests check the choice alone.
    decode = options.pop("decode", None)
    policy = make_policy(options.pop("name", "round-topk"), engine, **{"watershed": 2, "recheck_below": 0, **options})
    tiered = TieredKV(engine.model, policy, 512, decode=decode)
    for span in engine.chat.round_spans(Conversation(ROUNDS, SYSTEM)):
        tiered.prefill(span)
        tiered.close_round()
    prompt = engine.chat.open_round_tokens(Conversation(ROUNDS, SYSTEM), QUESTION)
    return tiered, prompt


def flat_cache(engine, tiered: TieredKV):
    """One full cache holding the tiered cache's K/V: lower layers from the device tier, upper from host."""
    n = tiered.closed_end
    cache = engine.new_cache(512)
    cache.write(range(tiered.split), 0, tiered.lower.kv[:, :, :, :n])
    for r, start in enumerate(tiered.round_starts):
        cache.write(range(tiered.split, engine.config.n_layers), start, tiered.round_upper(r))
    cache.length = n
    return cache


def masked(engine, tiered: TieredKV, rounds: list[int]) -> SplitAttend:
    bounds = tiered.round_starts + [tiered.closed_end]
    return SplitAttend(tiered.split, torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in rounds]))


def test_tiered_prefill_computes_what_split_attention_over_the_same_kv_computes(engine):
    tiered, prompt = tiered_chat(engine, k=2, progressive=False)
    reference = flat_cache(engine, tiered)
    left_on_device = set(tiered.resident)  # by the chat's last round
    got = tiered.prefill(prompt)
    chosen = tiered.stats.chosen
    assert chosen[0] == 0 and len(chosen) == 3 and tiered.resident == chosen
    want = prefill(engine.model, reference, prompt, attend=masked(engine, tiered, chosen))
    assert torch.allclose(got, want, atol=1e-4)
    # Only the chosen rounds' upper K/V (and the message's own) are on the device.
    bounds = tiered.round_starts + [tiered.closed_end]
    kept = sum(bounds[r + 1] - bounds[r] for r in chosen)
    assert tiered.upper.length == kept + len(prompt)
    # every round's key bounds too: per block of 32 tokens, as much as one token's upper K/V
    blocks = sum(-(-(bounds[r + 1] - bounds[r]) // 32) for r in range(len(ROUNDS)))
    assert tiered.device_bytes() == (tiered.length * tiered.lower.slot_bytes()
                                     + (kept + len(prompt) + blocks) * tiered.upper.slot_bytes()) < tiered.full_bytes()
    crossed = sum(bounds[r + 1] - bounds[r] for r in chosen if r not in left_on_device)
    assert tiered.stats.transfer_bytes == crossed * tiered.upper.slot_bytes()
    assert tiered.stats.prompt_transfer_ms == tiered.stats.transfer_ms


def test_keeping_every_round_answers_as_the_full_cache(engine):
    tiered, prompt = tiered_chat(engine, k=len(ROUNDS), progressive=False)
    cache = engine.new_cache(512)
    for span in engine.chat.round_spans(Conversation(ROUNDS, SYSTEM)):
        prefill(engine.model, cache, span)
    outs = [generate(engine.model, c, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=12,
                     stop_tokens=engine.tokenizer.eog_ids, stop_strings=engine.chat.stop_strings)
            for c in (tiered, cache)]
    assert outs[0].text == outs[1].text == "Your sister's name is Mira."
    assert tiered.stats.chosen == list(range(len(ROUNDS)))


def test_a_round_brought_in_while_decoding_is_seen_by_the_next_token(engine):
    tiered, prompt = tiered_chat(engine, k=1, progressive=False)
    tiered.prefill(prompt)
    missing = next(r for r in range(len(ROUNDS)) if r not in tiered.resident)
    tiered.step(int(engine.tokenizer.encode(" Your")[0]))
    tiered._insert_before_open([missing])  # what progressive selection does when a token names this round
    token = int(engine.tokenizer.encode(" sister")[0])
    got = tiered.step(token)
    opened = torch.arange(tiered.open_start, tiered.length - 1)
    reference = open_round_reference(engine, tiered, tiered.length - 1)
    rounds = sorted(tiered.resident)
    attend = masked(engine, tiered, rounds)
    want = engine.model(torch.tensor([token]), reference,
                        attend=SplitAttend(attend.split, torch.cat([attend.upper, opened])))[-1]
    assert torch.allclose(got, want, atol=1e-4)


def open_round_reference(engine, tiered: TieredKV, end: int | None = None):
    """A full cache of every closed round plus the open round's tokens before `end` (default: all of them) as the
    tiered cache computed them."""
    end = tiered.length if end is None else end
    n = end - tiered.open_start
    reference = flat_cache(engine, tiered)
    reference.write(range(engine.config.n_layers), tiered.open_start,
                    torch.cat([tiered.lower.kv[:, :, :, tiered.open_start : end],
                               tiered.upper.kv[:, :, :, tiered.upper_base : tiered.upper_base + n]]))
    reference.length = end
    return reference


def bounded_shares(engine, tiered: TieredKV, token: int) -> torch.Tensor:
    """Each round's best share over the upper layers, from bounds of the flat cache's keys and the queries of `token`
    run as the step ran it (the resident rounds and the open round visible above the split)."""
    m, reference = engine.model, open_round_reference(engine, tiered, tiered.length - 1)
    table = BoundsTable(engine.config.n_layers - tiered.split, engine.config.n_kv_heads, engine.config.head_dim,
                        m.dtype, m.device)
    bounds = tiered.round_starts + [tiered.closed_end]
    for r in range(len(tiered.round_starts)):
        table.append(bounds[r + 1] - bounds[r], key_bounds(reference.kv[tiered.split:, 0, :, bounds[r]:bounds[r + 1]]))
    p = tiered.length - 1
    pos = torch.tensor([p])
    attend = masked(engine, tiered, sorted(tiered.resident))
    visible = torch.cat([attend.upper, torch.arange(tiered.open_start, p)])
    h = m.run_layers(m.embed(torch.tensor([token])), pos, reference, p, layers=range(tiered.split))
    best = torch.zeros(len(tiered.round_starts))
    for i, layer in enumerate(range(tiered.split, engine.config.n_layers)):
        best = torch.maximum(best, table.round_share(m.layers[layer].queries(h, m.rotations(pos))[-1], i))
        h = m.run_layers(h, pos, reference, p, layers=range(layer, layer + 1), attend=visible)
    return best


def test_an_unsure_token_is_rechecked_and_the_rounds_it_could_read_are_brought_in(engine):
    # recheck_below near 1: every token is unsure; k=1 and no progressive choice leave most rounds out
    tiered, prompt = tiered_chat(engine, k=1, progressive=False, recheck_below=0.999999, recheck_mass=0.05)
    tiered.prefill(prompt)
    before = list(tiered.resident)
    token = int(engine.tokenizer.encode(" Your")[0])
    got = tiered.step(token)
    stats = tiered.stats
    assert stats.rechecks == 1 and stats.found and not set(stats.found) & set(before)
    assert tiered.resident == before + stats.found and stats.recheck_ms > 0
    assert stats.transfer_ms > stats.prompt_transfer_ms  # the found rounds crossed after the first token
    want_found = [r for r in (bounded_shares(engine, tiered, token) >= 0.05).nonzero().flatten().tolist()
                  if r not in before]
    assert sorted(stats.found) == want_found
    # The token ran again with the found rounds in view, and its upper K/V are the ones computed so.
    opened = torch.arange(tiered.open_start, tiered.length - 1)
    reference = open_round_reference(engine, tiered, tiered.length - 1)
    attend = masked(engine, tiered, sorted(tiered.resident))
    want = engine.model(torch.tensor([token]), reference,
                        attend=SplitAttend(attend.split, torch.cat([attend.upper, opened])))[-1]
    assert torch.allclose(got, want, atol=1e-4)
    tiered.policy.recheck_below = 0
    following = int(engine.tokenizer.encode(" sister")[0])
    reference = open_round_reference(engine, tiered)
    opened = torch.arange(tiered.open_start, tiered.length)
    want = engine.model(torch.tensor([following]), reference,
                        attend=SplitAttend(attend.split, torch.cat([attend.upper, opened])))[-1]
    got = tiered.step(following)
    # Summation order differs across machines and with the slots attended: 5e-4 of the largest logit. On the model
    # shipped 2026-11-28 the two differ by 1.2e-4 of it (0.003 of 25.6); leaving any one round out of view moves them
    # by 0.18-5.8, 14x or more the bound.
    assert (got - want).abs().max() <= 5e-4 * want.abs().max()


def test_a_recheck_that_finds_nothing_moves_nothing_and_keeps_the_tokens_logits(engine):
    tiered, prompt = tiered_chat(engine, k=1, progressive=False, recheck_below=0.999999, recheck_mass=0.99)
    plain, _ = tiered_chat(engine, k=1, progressive=False)
    tiered.prefill(prompt)
    plain.prefill(prompt)
    resident, moved = list(tiered.resident), tiered.stats.transfer_bytes
    unsure = 0  # the steps whose top probability is under recheck_below: each is rechecked
    for word in (" Your", " sister", "'s", " name", " is"):
        token = int(engine.tokenizer.encode(word)[0])
        logits = plain.step(token)
        assert torch.equal(tiered.step(token), logits)
        unsure += float(torch.softmax(logits.float(), dim=-1).max()) < 0.999999
    assert unsure >= 2 and tiered.stats.rechecks == min(unsure, tiered.policy.max_rechecks)
    assert not tiered.stats.found and tiered.resident == resident
    assert tiered.stats.transfer_bytes == moved


def test_key_bounds_of_rounds_stored_without_them_are_computed_at_the_first_recheck(engine):
    tiered, prompt = tiered_chat(engine, k=1, progressive=False, recheck_below=0.999999, recheck_mass=0.05)
    restored = TieredKV(engine.model, tiered.policy, 512)
    n = tiered.closed_end
    restored.lower.write(range(tiered.split), 0, tiered.lower.kv[:, :, :, :n])
    bounds = tiered.round_starts + [n]
    for r in range(len(bounds) - 1):  # the first round with its stored bounds, the others without
        restored.add_closed_round(bounds[r], bounds[r + 1], tiered.round_upper(r) if r == 0 else None,
                                  bounds=tiered.round_bounds(r) if r == 0 else None)
    restored.upper_source = lambda r: tiered.host[r]
    assert restored.round_bounds(1) is None
    restored.prefill(prompt)
    restored.step(int(engine.tokenizer.encode(" Your")[0]))
    missing = [r for r in range(1, len(ROUNDS))]
    assert restored.stats.bounds_computed == missing
    for r in range(len(ROUNDS)):
        assert torch.equal(restored.round_bounds(r), tiered.round_bounds(r))
        assert torch.equal(tiered.round_bounds(r), key_bounds(tiered.round_upper(r)[:, 0]))


@pytest.mark.parametrize("options", [{"recheck_below": 0}, {"max_rechecks": 0},
                                     {"recheck_below": 0.999999, "k": len(ROUNDS)}])
def test_no_recheck_when_off_or_when_every_round_is_visible(engine, options):
    tiered, prompt = tiered_chat(engine, **{"k": 1, "progressive": False, "recheck_below": 0.999999, **options})
    tiered.prefill(prompt)
    for word in (" Your", " sister"):
        tiered.step(int(engine.tokenizer.encode(word)[0]))
    assert tiered.stats.rechecks == 0


def test_rechecks_stop_at_the_limit(engine):
    tiered, prompt = tiered_chat(engine, k=1, progressive=False, recheck_below=0.999999, recheck_mass=0.3,
                                 max_rechecks=1)
    tiered.prefill(prompt)
    for word in (" Your", " sister", "'s", " name"):
        tiered.step(int(engine.tokenizer.encode(word)[0]))
    # the first recheck found rounds but left some out: only the limit stops the next
    assert tiered.stats.found and len(tiered.resident) < len(ROUNDS)
    assert tiered.stats.rechecks == 1


def test_progressive_selection_adds_rounds_while_decoding(engine):
    tiered, prompt = tiered_chat(engine, k=1, progressive=True)
    generate(engine.model, tiered, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=12,
             stop_tokens=engine.tokenizer.eog_ids)
    assert set(tiered.stats.added) <= set(tiered.resident)
    assert not set(tiered.stats.added) & set(tiered.stats.chosen)
    assert len(tiered.stats.added) <= max(2, len(tiered.stats.chosen))


def test_truncating_the_open_round_and_back_to_a_round(engine):
    tiered, prompt = tiered_chat(engine, k=2, progressive=False)
    start = tiered.length
    first = tiered.prefill(prompt)
    tiered.truncate(start + 3)
    assert tiered.length == start + 3 and tiered.upper.length == tiered.upper_base + 3
    again = tiered.prefill(prompt[3:])
    assert torch.allclose(first, again, atol=1e-5)
    tiered.truncate(start)  # the whole open round
    assert tiered.open_start is None and tiered.length == start
    tiered.truncate(tiered.round_starts[-1])  # and the last closed round
    assert len(tiered.round_starts) == len(ROUNDS) - 1 and tiered.length == tiered.closed_end
    with pytest.raises(ValueError, match="not the start of a round"):
        tiered.truncate(tiered.round_starts[-1] + 1)


def with_dropped_rounds(engine) -> tuple[TieredKV, list, list[int]]:
    """A chat whose question dropped idle rounds from host memory, then was taken back: (cache, every round's
    upper K/V as it was saved, the dropped rounds)."""
    tiered, prompt = tiered_chat(engine, k=1, progressive=False, max_idle=1)
    start = tiered.length
    saved = [tiered.round_upper(r) for r in range(len(ROUNDS))]
    tiered.prefill(prompt)
    dropped = tiered.stats.dropped
    tiered.truncate(start)
    return tiered, saved, dropped


def test_idle_rounds_are_dropped_then_fetched_or_recomputed(engine):
    tiered, saved, dropped = with_dropped_rounds(engine)
    assert dropped and all(tiered.host[r] is None for r in dropped) and 0 not in dropped
    # From the store, exactly as saved.
    tiered.upper_source = lambda r: saved[r].permute(3, 0, 1, 2, 4).contiguous()
    tiered._bring_in(dropped)
    assert tiered.stats.fetched == dropped
    assert all(torch.equal(tiered.round_upper(r), saved[r]) for r in dropped)
    # Nothing stored: recomputed from the round's tokens, close to what the chat computed.
    victim = dropped[0]
    tiered._bring_in([0])  # off the device
    tiered.host[victim] = None  # and gone from host memory
    tiered.upper_source = lambda r: None
    tiered.stats.recomputed.clear()
    tiered._bring_in([victim])
    assert tiered.stats.recomputed == [victim]
    assert tiered.round_upper(victim).shape == saved[victim].shape


def test_rounds_to_fetch_are_announced_together_before_the_first_is_asked_for(engine):
    tiered, saved, dropped = with_dropped_rounds(engine)
    calls = []
    tiered.upper_hint = lambda rounds: calls.append(("hint", list(rounds)))
    tiered.upper_source = lambda r: calls.append(("take", r)) or saved[r].permute(3, 0, 1, 2, 4).contiguous()
    tiered._bring_in([0] + dropped)  # round 0 is still in host memory: not announced, not fetched
    assert calls == [("hint", dropped)] + [("take", r) for r in dropped]


def test_rounds_still_on_the_device_are_not_copied_again(engine):
    tiered, prompt = tiered_chat(engine, k=2, progressive=False)
    start = tiered.length
    first = tiered.prefill(prompt)
    chosen = tiered.stats.chosen
    tiered.truncate(start)  # the question's round is gone; the rounds it picked stay on the device
    assert tiered.resident == chosen and tiered.upper.length == tiered.upper_base
    again = tiered.prefill(prompt)
    assert tiered.stats.chosen == chosen and tiered.stats.transfer_bytes == 0
    assert torch.equal(again, first)
    # Picking a round that is not there copies that round alone.
    tiered.truncate(start)
    extra = next(r for r in range(len(tiered.round_starts)) if r not in chosen)
    tiered.stats = type(tiered.stats)()
    tiered._bring_in(chosen + [extra])
    per_token = tiered.upper.slot_bytes()
    assert tiered.stats.transfer_bytes == tiered._round_length(extra) * per_token
    assert all(torch.equal(tiered.round_upper(r).to(tiered.upper.kv.dtype),
                           tiered.upper.kv[:, :, :, at : at + tiered._round_length(r)])
               for r, at in tiered._resident_slots().items())


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_the_upper_tier_grows_without_two_copies_side_by_side(engine, monkeypatch, decode):
    """With no free room past a message, every growth of the upper tier (the reply, a round brought in while
    decoding) lets the old buffer go and puts the rounds back from host memory; the reply is the one that roomy
    tiers give, and a copying grow (KVCache.reserve, old and new side by side) is never used."""
    import kvchat.engine.kv.tiered as tiered_module

    def reply(room: int) -> tuple[list[torch.Tensor], list[int]]:
        monkeypatch.setattr(tiered_module, "REPLY_ROOM", room)
        tiered, prompt = tiered_chat(engine, k=1, progressive=False, decode=decode)
        if room == 0:
            def copying_grow(n_slots, exact=False):
                assert n_slots <= tiered.upper.capacity, "the upper tier grew by a copy"
            monkeypatch.setattr(tiered.upper, "reserve", copying_grow)
        logits = [tiered.prefill(prompt)]
        step = tiered.decode_step(engine.model, 8, 4096)
        missing = next(r for r in range(len(ROUNDS)) if r not in tiered.resident)
        for i, word in enumerate([" Your", " sister", " is", " called"]):
            if i == 2:
                tiered._insert_before_open([missing])  # grows the tier again, the open round's slots kept
            logits.append(step(int(engine.tokenizer.encode(word)[0])))
        return logits, list(tiered.resident)

    tight, resident = reply(0)
    roomy, roomy_resident = reply(4096)
    assert resident == roomy_resident
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(tight, roomy))
