"""Sliding-window layers in the store (Gemma 3): a round's segments hold those layers' K/V only where a later
token can still read it, earlier rounds are stored again as the chat moves past them, and every way of reopening a
chat (restore, after a retraction, a fork, a state file) gives the same replies as a chat that never stopped."""

from __future__ import annotations

import pytest
import torch

from kvchat.app.session.chat import ChatSession
from kvchat.engine.engine import Engine
from kvchat.engine.train.synthetic import REFERENCE_MODELS
from kvchat.storage.db import SEGMENT_KV, Store
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.statefile import export_session, import_state

MESSAGES = ["The quick brown fox jumps over the lazy dog.", "My name is Alice and I live in Paris.",
            "Remember that my sister's birthday is on the 14th of March.", "What is the capital of France?",
            "Tell me a story about a dragon."]
REPLY = 10  # tokens per reply: random weights answer with noise, a window of 8 is crossed many times anyway


@pytest.fixture(scope="module")
def gemma(models):
    path = models.get(**REFERENCE_MODELS["gemma3-f32-swa"])  # window 8 on 6 of 7 layers
    return Engine(path, device="cpu")


def new_chat(store: Store, engine: Engine, **options) -> ChatSession:
    sid = store.create_session(title="t", model_fingerprint=model_fingerprint(engine.path, store),
                               model_path=engine.path, system_prompt="Be brief.")
    return ChatSession(store, engine, sid, **options)


def chat_of(store: Store, engine: Engine, messages: list[str], **options) -> tuple[ChatSession, list[list[int]]]:
    chat = new_chat(store, engine, **options)
    replies = [chat.send(m, max_tokens=REPLY).tokens for m in messages]
    chat.close()
    return chat, replies


def kv_rows(store: Store, sid: str) -> list[dict]:
    return [s for s in store.segments(sid) if s["kind"] == SEGMENT_KV]


def test_old_rounds_keep_only_their_global_layers_and_restore_exactly(gemma, kvchat_home):
    store = Store()
    chat, _ = chat_of(store, gemma, MESSAGES[:4])
    rows = {s["round_idx"]: s for s in kv_rows(store, chat.sid)}
    end = chat.rounds[-1].token_end
    for i, row in enumerate(chat.rounds):
        assert rows[i]["live_from"] == min(row.token_end, max(row.token_start, end - 8 + 1))
    assert rows[0]["live_from"] == chat.rounds[0].token_end  # the first round: wholly out of every window
    assert chat.rounds[0].token_start < rows[3]["live_from"] < chat.rounds[3].token_end
    reopened = ChatSession(store, gemma, chat.sid)
    stats = reopened.restore()
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == end
    cfg = gemma.config
    for layer in range(cfg.n_layers):  # every K/V the chat can still read is the never-stopped chat's, bit for bit
        first = end - cfg.window(layer) + 1 if cfg.window(layer) else 0
        one = range(layer, layer + 1)
        assert torch.equal(reopened.cache.read(one, first, end), chat.cache.read(one, first, end))
    _, never_stopped = chat_of(Store(kvchat_home / "other"), gemma, MESSAGES, trim_windows=False)
    assert reopened.send(MESSAGES[4], max_tokens=REPLY).tokens == never_stopped[4]


def test_trimming_stores_far_fewer_bytes(gemma, kvchat_home):
    trimmed, _ = chat_of(Store(kvchat_home / "a"), gemma, MESSAGES)
    whole, _ = chat_of(Store(kvchat_home / "b"), gemma, MESSAGES, trim_windows=False)
    size = lambda chat: sum(s["byte_size"] for s in kv_rows(chat.store, chat.sid))  # noqa: E731
    # 1 global layer of 7 keeps every token; the others only the last 7 of the chat
    assert size(trimmed) < 0.45 * size(whole)


def test_a_retraction_brings_trimmed_k_v_back_into_reach(gemma, kvchat_home):
    store = Store()
    chat, replies = chat_of(store, gemma, MESSAGES[:4])
    chat.retract_last_round()  # the chat's end moves back: round 2's tail is read again, and the cache has it
    chat.close()
    rows = {s["round_idx"]: s for s in kv_rows(store, chat.sid)}
    assert rows[2]["live_from"] == chat.live_from(2) < chat.rounds[2].token_end
    reopened = ChatSession(store, gemma, chat.sid)
    assert reopened.restore().tokens_recomputed == 0
    assert reopened.send(MESSAGES[3], max_tokens=REPLY).tokens == replies[3]


def test_a_fork_and_a_state_file_reopen_with_what_they_can_read(gemma, kvchat_home, tmp_path):
    store = Store()
    chat, replies = chat_of(store, gemma, MESSAGES[:4])
    _, never_stopped = chat_of(Store(kvchat_home / "other"), gemma, MESSAGES, trim_windows=False)
    fork = store.fork_session(chat.sid, 2, "fork")  # ends where round 1 ended: its trimmed tails are read again
    forked = ChatSession(store, gemma, fork)
    stats = forked.restore()
    assert stats.tokens_recomputed > 0 and any("sliding-window" in note for note in stats.notes)
    assert forked.send(MESSAGES[2], max_tokens=REPLY).tokens == replies[2]
    forked.close()
    path = export_session(store, chat.sid, tmp_path / "chat.kvstate")
    imported = import_state(store, path, current_fingerprint=model_fingerprint(gemma.path, store),
                            model_path=gemma.path).session_id
    assert [s["live_from"] for s in kv_rows(store, imported)] == [s["live_from"] for s in kv_rows(store, chat.sid)]
    again = ChatSession(store, gemma, imported)
    assert again.restore().tokens_recomputed == 0
    assert again.send(MESSAGES[4], max_tokens=REPLY).tokens == never_stopped[4]


def assert_same_round_kv(engine: Engine, got: ChatSession, want: ChatSession, i: int) -> None:
    """Every layer's K/V of round i in `got`'s cache equals `want`'s (to float rounding)."""
    row, every = want.rounds[i], range(engine.config.n_layers)
    a = got.cache.read(every, row.token_start, row.token_end)
    b = want.cache.read(every, row.token_start, row.token_end)
    assert (a - b).abs().max() / b.abs().max() < 1e-5


def test_a_missing_round_is_recomputed_with_the_rounds_its_windows_read(gemma, kvchat_home):
    """Round 2's files are lost: its recompute reads round 1's tail in the sliding-window layers, which is stored
    trimmed (zeros), so rounds 0-1 are recomputed with it; every layer's K/V of round 2 then equals the chat that
    never stopped (recomputed alone, the global layer was off by ~10%)."""
    store = Store()
    chat, _ = chat_of(store, gemma, MESSAGES[:4])
    store.drop_segment_rows(chat.sid, [(s["round_idx"], s["kind"], s["layer_start"])
                                       for s in store.segments(chat.sid) if s["round_idx"] == 2])
    reopened = ChatSession(store, gemma, chat.sid)
    stats = reopened.restore()
    assert stats.recomputed_rounds == [2]
    assert any("rounds 0-1: recomputed again, since round 2's sliding windows read them" in n for n in stats.notes)
    assert_same_round_kv(gemma, reopened, chat, 2)


def test_a_retraction_after_reopening_recomputes_the_trimmed_window(gemma, kvchat_home):
    """Reopened, the cache holds zeros where the store trimmed the windows; retracting the last round brings them
    back into reach, so the chat is restored again (recomputing them) before the message is answered again: its
    K/V are the never-stopped chat's (kept as they were, they were off by ~12%)."""
    store = Store()
    chat, _ = chat_of(store, gemma, MESSAGES[:4])
    reopened = ChatSession(store, gemma, chat.sid)
    reopened.restore()
    reopened.retract_last_round()
    assert reopened.restored is None
    stats = reopened.restore()
    assert stats.tokens_recomputed > 0 and any("sliding-window" in note for note in stats.notes)
    reopened.send(MESSAGES[3], max_tokens=REPLY)
    assert_same_round_kv(gemma, reopened, chat, 3)


def test_a_chat_given_as_text_is_stored_trimmed_by_store_all(gemma, kvchat_home):
    store = Store()
    chat, _ = chat_of(store, gemma, MESSAGES[:3])
    text_only = store.fork_session(chat.sid, 3, "text")
    store.drop_segment_rows(text_only, [(s["round_idx"], s["kind"], s["layer_start"])
                                        for s in store.segments(text_only)])
    again = ChatSession(store, gemma, text_only)
    again.restore()
    again.store_all()
    again.close()
    assert [s["live_from"] for s in kv_rows(store, text_only)] == [s["live_from"] for s in kv_rows(store, chat.sid)]
    assert ChatSession(store, gemma, text_only).restore().tokens_recomputed == 0


# --- Round Attention over sliding windows ---

def tiered_run(engine: Engine, mode: str, k: float, messages=MESSAGES) -> tuple[list, list]:
    """A chat of `messages` read into a TieredKV round by round (watershed 5, the only global layer below the top:
    the top layer is a sliding-window one), then the last message prefilled and 12 tokens decoded greedily:
    (the logits at every step, the rounds chosen, the top layer's K/V of the new round [2, Hkv, n, D])."""
    import torch

    from kvchat.engine.text.chat_format import Conversation, Round
    from kvchat.engine.policies import make_policy
    from kvchat.engine.kv.tiered import TieredKV

    policy = make_policy("round-topk", engine, watershed=5, k=k, recheck_below=0)
    conv = Conversation([Round(m, "Fine, noted.") for m in messages[:-1]], "Be brief.")
    tiered = TieredKV(engine.model, policy, 512, decode=mode)
    for span in engine.chat.round_spans(conv):
        tiered.prefill(span)
        tiered.close_round()
    prompt = engine.chat.open_round_tokens(conv, messages[-1])
    # the message's first two tokens alone first: their logits read the previous round's tail through the window
    logits = [tiered.prefill(prompt[:2]), tiered.prefill(prompt[2:])]
    for _ in range(12):
        logits.append(tiered.step(int(logits[-1].argmax())).clone())  # a replay reuses its output buffer
    chosen = tiered.stats.chosen
    idx = tiered.close_round()
    return torch.stack(logits), chosen, tiered.round_upper(idx)[-1]


def full_run(engine: Engine, messages=MESSAGES):
    import torch

    from kvchat.engine.text.chat_format import Conversation, Round

    conv = Conversation([Round(m, "Fine, noted.") for m in messages[:-1]], "Be brief.")
    cache = engine.new_cache(512)
    for span in engine.chat.round_spans(conv):
        engine.model(torch.tensor(span), cache)
    start = cache.length
    prompt = torch.tensor(engine.chat.open_round_tokens(conv, messages[-1]))
    logits = [engine.model(prompt[:2], cache)[-1], engine.model(prompt[2:], cache)[-1]]
    for _ in range(12):
        logits.append(engine.model(torch.tensor([int(logits[-1].argmax())]), cache)[-1])
    return torch.stack(logits), cache.kv[-1, :, :, start : cache.length]


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_round_attention_keeps_what_the_sliding_windows_read(gemma, mode):
    """Above the watershed this model has one layer, a sliding-window one: the rounds its window reaches are always
    brought in, at their own positions in the packed upper tier, so whichever rounds the policy picks the logits are
    the full cache's (to float rounding), prompt and decoded tokens alike."""
    import torch

    got, chosen, got_kv = tiered_run(gemma, mode, k=1)
    want, want_kv = full_run(gemma)
    assert len(chosen) < len(MESSAGES) - 1  # not every round: the window's rounds and the first, at most
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5  # float summation order (static: over the buffer)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert ((got_kv - want_kv).abs().max() / want_kv.abs().max()) < 1e-4


def test_without_the_window_rounds_it_would_differ(gemma, monkeypatch):
    """The check above can fail: a tiered cache that did not bring in the window's rounds gives other logits."""
    from kvchat.engine.kv.tiered import TieredKV

    monkeypatch.setattr(TieredKV, "_window_rounds", lambda self, start: [])
    got, _, _ = tiered_run(gemma, "eager", k=1)
    want = full_run(gemma)[0]
    assert ((got[0] - want[0]).abs().max() / want[0].abs().max()) > 1e-2


def test_a_watershed_at_a_sliding_window_layer_is_refused(gemma):
    from kvchat.engine.policies import make_policy
    from kvchat.errors import KvchatError

    with pytest.raises(KvchatError, match="watershed layer 2 is a sliding-window layer; choose a global one \\(5\\)"):
        make_policy("round", gemma, watershed=2)


@pytest.mark.gpu
def test_round_attention_over_windows_in_cuda_graphs(models):
    """The same on the GPU through TieredDecode's graphs: the packed upper tier's window is a device-built mask
    over slot positions inside the captured step."""
    import torch

    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cuda", dtype=torch.float32)
    got, _, _ = tiered_run(engine, "graph", k=1)
    want = full_run(engine)[0]
    assert ((got - want).abs().max() / want.abs().max()) < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()
