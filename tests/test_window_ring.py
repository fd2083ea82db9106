"""Sliding-window layers kept in a ring (Gemma 3): a chat's cache holds only the last window (and RING_SLACK) of
those layers, and computes exactly what a cache of every slot does. The slack is cut to 4 here so that the window
of 8 wraps round its ring of 12 many times within the test chats."""

from __future__ import annotations

import pytest
import torch

from kvchat.app.session.chat import ChatSession
from kvchat.engine.kv import cache as cache_module
from kvchat.engine.model.cuda_graph import GraphedDecode
from kvchat.engine.engine import Engine
from kvchat.engine.generate import prefill
from kvchat.engine.restore.plan import fixed_plan
from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT
from kvchat.storage.db import Store
from kvchat.storage.fingerprint import model_fingerprint

MESSAGES = ["The quick brown fox jumps over the lazy dog.", "My name is Alice and I live in Paris.",
            "Remember that my sister's birthday is on the 14th of March.", "What is the capital of France?",
            "Tell me a story about a dragon."]
REPLY = 10


@pytest.fixture(scope="module")
def gemma(models):
    return Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")  # window 8 on 6 of 7 layers


@pytest.fixture(autouse=True)
def small_ring(monkeypatch):
    monkeypatch.setattr(cache_module, "RING_SLACK", 4)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def run(engine: Engine, ring: bool, static: bool, chunks=(1, 3, 20)) -> tuple[torch.Tensor, list[int], object]:
    """The prompt prefilled in chunks (one of them longer than the ring), then 16 tokens decoded greedily, eagerly
    or through the decode step a CUDA graph captures (here run as it is): (every logit, the tokens, the cache)."""
    m = engine.model
    tokens = engine.encode_prompt(REFERENCE_PROMPT * 3)
    cache = m.new_cache(256, ring=ring)
    logits, at = [], 0
    for size in (*chunks, len(tokens)):
        part = tokens[at : at + size]
        at += len(part)
        if part:
            logits.append(m(torch.tensor(part), cache, all_logits=True))
    step = GraphedDecode(m, cache, 256, capture=False) if static else (lambda t: m(torch.tensor([t]), cache)[-1])
    out = [int(logits[-1][-1].argmax())]
    for _ in range(16):
        logits.append(step(out[-1]).clone()[None])
        out.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), out, cache


@pytest.mark.parametrize("static", [False, True], ids=["eager", "step"])
def test_a_ring_cache_computes_what_a_cache_of_every_slot_does(gemma, static):
    want, want_tokens, full = run(gemma, ring=False, static=False)
    got, tokens, ringed = run(gemma, ring=True, static=static)
    assert ringed.ring_size == 12 and ringed.length == full.length > 8 * ringed.ring_size
    # eager: the same arithmetic, bit for bit; the step: another summation order (as for a cache of every slot)
    assert relative_error(got, want) < (1e-5 if static else 1e-7)
    assert tokens == want_tokens
    # one global layer of seven holds every slot; the six window layers 12 each
    assert ringed.device_bytes() < 0.2 * full.device_bytes()
    end, every = full.length, range(gemma.config.n_layers)
    assert relative_error(ringed.read(every, end - 7, end), full.read(every, end - 7, end)) < (1e-5 if static else 1e-7)


def test_the_ring_holds_the_last_slots_and_reads_zeros_before_them(gemma):
    m, cfg = gemma.model, gemma.config
    cache = m.new_cache(64, ring=True)
    windowed = [i for i in range(cfg.n_layers) if cfg.window(i)]
    kv = torch.randn(cfg.n_layers, 2, cfg.n_kv_heads, 30, cfg.head_dim)
    cache.write(range(cfg.n_layers), 0, kv)
    cache.length = 30
    got = cache.read(range(cfg.n_layers), 0, 30)
    assert torch.equal(got[windowed, :, :, 18:], kv[windowed, :, :, 18:])  # the last 12 slots
    assert not got[windowed, :, :, :18].any()  # the ring no longer holds the rest: zeros
    glob = cfg.global_layers
    assert torch.equal(got[glob], kv[glob])
    with pytest.raises(RuntimeError, match="ring holds slots \\[18, 30\\), not all of \\[17, 30\\)"):
        cache.span(windowed[0], 17, 30)
    assert torch.equal(cache.span(windowed[0], 22, 30), kv[windowed[0], :, :, 22:30])  # ring places 10, 11, 0-5
    # cut back by up to the slack + 1, the next token's window (the 7 slots before it) is still held
    assert cache.holds_window(30 - 5) and not cache.holds_window(30 - 6)
    cache.truncate(26)
    assert cache.holds_window(26) and cache.length == 26
    cache.write(range(cfg.n_layers), 26, kv[:, :, :, :3])  # slots 26-28 anew
    assert torch.equal(cache.read(range(windowed[0], windowed[0] + 1), 26, 29)[0], kv[windowed[0], :, :, :3])


def test_a_fork_s_ring_joins_the_ring_it_came_from(gemma):
    """A restore recomputes a prefix on a fork (shared global layers, a ring of its own) while loads fill the
    cache's ring; the join keeps, of each slot, what the cache's ring should hold."""
    m, cfg = gemma.model, gemma.config
    layer = next(i for i in range(cfg.n_layers) if cfg.window(i))
    one = range(layer, layer + 1)
    cache = m.new_cache(64, ring=True)
    fork = cache.fork_ring()
    assert fork.kv is cache.kv and fork.ring is not cache.ring
    front, back = torch.randn(1, 2, cfg.n_kv_heads, 20, cfg.head_dim), torch.randn(1, 2, cfg.n_kv_heads, 6,
                                                                                cfg.head_dim)
    cache.write(one, 20, back)  # loaded: slots 20-25
    fork.write(one, 0, front)  # recomputed: slots 0-19 (the fork's ring keeps 8-19)
    cache.join_ring(fork)
    cache.length = 26
    got = cache.read(one, 0, 26)[0]
    assert torch.equal(got[:, :, 14:20], front[0, :, :, 14:20]) and torch.equal(got[:, :, 20:], back[0])
    assert not got[:, :, :14].any()
    with pytest.raises(RuntimeError, match="cannot grow"):
        fork.reserve(1000)


# --- a chat's cache (ChatSession) ---

@pytest.fixture
def chat_ring(monkeypatch):
    """A ring of 24 for the chats: a reply's end-of-turn tail, tokenized anew, reaches back up to ~12 tokens (a
    ring that cannot hold that much lets the cache go, to be restored, which the test below checks apart)."""
    monkeypatch.setattr(cache_module, "RING_SLACK", 16)


def chat_of(store: Store, engine: Engine, messages: list[str], **options) -> ChatSession:
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt="Be brief.")
    chat = ChatSession(store, engine, sid, **options)
    for text in messages:
        chat.send(text, max_tokens=REPLY)
    chat.close()
    return chat


def assert_like_a_fresh_prefill(engine: Engine, chat: ChatSession) -> None:
    """What the chat's cache holds (global layers: every slot; window layers: the last window) equals a prefill
    of the whole chat into a cache of every slot."""
    tokens = engine.chat.conversation_tokens(chat.conversation())
    fresh = engine.new_cache(len(tokens) + 8)
    prefill(engine.model, fresh, tokens)
    end, cfg = len(tokens), engine.config
    assert chat.cache.length == end
    for layer in range(cfg.n_layers):
        first = end - cfg.window(layer) + 1 if cfg.window(layer) else 0
        one = range(layer, layer + 1)
        assert relative_error(chat.cache.read(one, first, end), fresh.read(one, first, end)) < 1e-4, layer


def test_a_chat_in_a_ring_cache_restores_recomputes_and_retracts_exactly(gemma, kvchat_home, monkeypatch, chat_ring):
    from kvchat.app.session import layout

    monkeypatch.setattr(layout, "GROUP_BYTES_PER_512_TOKENS", 1 << 20)  # layers 0-1, 2-3, 4, 5-6
    store = Store()
    chat = chat_of(store, gemma, MESSAGES[:4])
    assert chat.cache.ring_size == 24 and chat.cache.length > 5 * 24
    assert_like_a_fresh_prefill(gemma, chat)
    # reopened, everything loaded
    loaded = ChatSession(store, gemma, chat.sid)
    assert loaded.restore().tokens_recomputed == 0
    assert_like_a_fresh_prefill(gemma, loaded)
    # a pyramid: rounds 0-2 recomputed in layers 0-3, 0-1 above (on a fork of the ring), the rest loaded
    pyramid = ChatSession(store, gemma, chat.sid,
                          planner=lambda rounds, groups, bg: fixed_plan(rounds, groups, (3, 3, 2, 2)))
    stats = pyramid.restore()
    assert stats.tokens_planned > 0 and stats.tokens_loaded > 0
    assert_like_a_fresh_prefill(gemma, pyramid)
    # the last round's files are lost: recomputed (with what its windows read) on the fork, whose ring then holds
    # the chat's last window, joined to the cache's
    store.drop_segment_rows(chat.sid, [(s["round_idx"], s["kind"], s["layer_start"])
                                       for s in store.segments(chat.sid) if s["round_idx"] == 3])
    missing = ChatSession(store, gemma, chat.sid)
    assert missing.restore().recomputed_rounds == [3]
    assert_like_a_fresh_prefill(gemma, missing)
    # a retraction further back than the ring's slack: the chat is restored again before the message
    reply = missing.rounds[-1].assistant_text
    missing.retract_last_round()
    assert missing.restored is None
    assert missing.send(MESSAGES[3], max_tokens=REPLY).text == reply
    assert_like_a_fresh_prefill(gemma, missing)


def test_a_ring_chat_answers_as_a_chat_of_every_slot(gemma, kvchat_home, monkeypatch, chat_ring):
    ringed = chat_of(Store(kvchat_home / "a"), gemma, MESSAGES)
    monkeypatch.setattr(cache_module, "RING_SLACK", 10_000)  # a ring longer than the chat: every slot kept
    whole = chat_of(Store(kvchat_home / "b"), gemma, MESSAGES)
    assert [r.assistant_text for r in ringed.rounds] == [r.assistant_text for r in whole.rounds]
    assert ringed.cache.device_bytes() < 0.3 * whole.cache.device_bytes()


def test_a_chat_storing_every_layer_keeps_every_slot(gemma, kvchat_home, chat_ring):
    """trim_windows off (the bench's comparison): every layer of every token is stored, so the cache keeps them."""
    trimmed = chat_of(Store(kvchat_home / "a"), gemma, MESSAGES)
    whole = chat_of(Store(kvchat_home / "b"), gemma, MESSAGES, trim_windows=False)
    assert whole.cache.ring_size == 0 and trimmed.cache.ring_size == 24
    size = lambda chat: sum(s["byte_size"] for s in chat.store.segments(chat.sid))  # noqa: E731
    assert size(trimmed) < 0.45 * size(whole)


def test_bench_engine_measures_a_windowed_model_in_rings(gemma, tmp_path, monkeypatch):
    import json

    from cli_run import kvchat

    # each decode run goes back 64 tokens to decode them again: a ring that holds them (window 8 + 70)
    monkeypatch.setattr(cache_module, "RING_SLACK", 70)
    out = tmp_path / "engine.json"
    shown = kvchat("bench", "engine", "--model", str(gemma.path), "--context", "200", "--device", "cpu",
                   "--json", str(out)).stdout
    assert "window layers in rings: prefill" in shown
    figures = json.loads(out.read_text())[0]["contexts"][0]
    ring = figures["ring"]
    # capacity 265 (200 + 65 decoded): the global layer holds 265 slots, the six window layers 78 each
    assert ring["cache_mib"] < 0.5 * figures["cache_mib"]
    assert ring["prefill_tokens_per_s"] > 0 and ring["decode_tokens_per_s"] > 0


def test_bench_engine_refuses_a_missing_model(tmp_path):
    from cli_run import kvchat

    proc = kvchat("bench", "engine", "--model", str(tmp_path / "none.gguf"), check=False)
    assert proc.returncode != 0 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_a_decode_step_over_rings_made_in_inference_mode(gemma):
    """A restore makes the cache in inference mode, generate builds its decode step outside: putting back the ring
    place the capture's warm-up writes must work there too (it raised on the H100, failing every reopened chat)."""
    m = gemma.model
    with torch.inference_mode():
        cache = m.new_cache(64, ring=True)
        m(torch.tensor(gemma.encode_prompt(REFERENCE_PROMPT)), cache)
    step = GraphedDecode(m, cache, 64, capture=False)
    assert step(1).shape[-1] == gemma.config.vocab_size


def test_a_ring_chat_read_again_from_its_text_needs_no_fork(gemma, kvchat_home, monkeypatch, chat_ring):
    """A new system prompt drops the stored K/V: the whole chat is recomputed with nothing loading beside it, so
    straight into the cache's own ring (a fork and its join would only copy)."""
    from kvchat.engine.kv.cache import KVCache

    store = Store()
    chat = chat_of(store, gemma, MESSAGES[:3])
    store.unlink_files(store.update_session(chat.sid, system_prompt="Answer in one word."))
    forks = []
    real_fork = KVCache.fork_ring
    monkeypatch.setattr(KVCache, "fork_ring", lambda self: forks.append(1) or real_fork(self))
    again = ChatSession(store, gemma, chat.sid)
    stats = again.restore()
    assert stats.tokens_loaded == 0 and "no longer match" in stats.notes[0] and not forks
    assert again.cache.ring_size == 24
    assert_like_a_fresh_prefill(gemma, again)
