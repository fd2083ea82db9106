"""A chat whose K/V lives in host memory (engine.kv.host_resident), as the app runs an xkv chat whose full cache does
not fit the GPU memory budget ("xkv:host"): it answers, saves, restores and recomputes as the same policy over the
full cache on the device does, and the budget chooses it between the full cache and the tiered one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cli_run import kvchat
from kvchat.app.session import memory
from kvchat.app.session.service import ChatService
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.kv.host_resident import HostResidentKV
from kvchat.engine.memory_plan import plan_memory
from kvchat.engine.sampling import SamplingParams
from kvchat.storage.db import SEGMENT_KV, Store
from test_memory_plan import cpu_budget  # noqa: F401 - the fixture: --gpu-memory applied on the CPU
from tui_support import shared_engine

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
MESSAGES = ["My name is Ada.", "My sister's name is Mira.", "I live in Lisbon.", "What is my sister's name?"]
LAST = "Where do I live?"


@pytest.fixture(autouse=True)
def choices_from_the_window(monkeypatch):
    """A host-resident chat chooses its slots from the message's window alone (it has no full cache on the device
    to look ahead over): the device chats it is compared with here do the same, so both read the same slots."""
    from kvchat.app.session import policies

    build = policies.build_policy

    def build_policy(name, engine=None, progress=None, **options):
        if name in policies.BUDGET_POLICIES:
            options.setdefault("lookahead", 0)
        return build(name, engine, progress, **options)

    monkeypatch.setattr(policies, "build_policy", build_policy)


def service() -> ChatService:
    svc = ChatService(device="cpu")
    svc.kv_budget = 0.4  # the embedded model answers under it as over the full cache (tests/test_xkv_chats.py)
    engine = shared_engine()
    svc._engines[str(Path(engine.path).resolve())] = engine
    return svc


def send(svc: ChatService, sid: str, text: str, kv_policy: str) -> str:
    return svc.send(sid, text, max_tokens=16, sampling=SamplingParams(), kv_policy=kv_policy).round.assistant_text


def stored_kv(svc: ChatService, sid: str) -> torch.Tensor:
    """The chat's K/V as a fresh full-cache restore reads it from the store."""
    session = svc.wire(svc.store.session(sid), shared_engine(), planned=False)
    session.restore()
    kv = session.cache.read(range(shared_engine().config.n_layers), 0, session.cache.length)
    session.close()
    return kv


def test_a_host_resident_chat_answers_saves_and_restores_as_the_device_cache(kvchat_home):
    svc = service()
    chats = {}
    for kv_policy in ("xkv", "xkv:host"):
        sid = svc.create_chat(DEFAULT_MODEL, SYSTEM)
        replies = [send(svc, sid, m, kv_policy) for m in MESSAGES]
        chats[kv_policy] = sid, replies
        session = svc._open[sid].session
        assert isinstance(session.cache, HostResidentKV) == (kv_policy == "xkv:host")
        budgets = svc.store.kv_budgets(sid)
        assert budgets["policy"] == "xkv" and budgets["round_idx"] == len(MESSAGES) - 1
    assert chats["xkv:host"][1] == chats["xkv"][1]  # the same replies, each reading its budget
    assert chats["xkv"][1][-1] == "Your sister's name is Mira."
    svc.drain()
    device_kv, host_kv = (stored_kv(svc, chats[p][0]) for p in ("xkv", "xkv:host"))
    assert host_kv.shape == device_kv.shape
    assert (host_kv - device_kv).abs().max() <= 1e-3 * device_kv.abs().max()  # the store holds the same K/V
    svc.close()

    # Reopened after a restart: the host-resident chat is loaded into host memory, nothing recomputed, and answers
    # the next message as the device cache does.
    svc = service()
    again = {}
    for kv_policy in ("xkv", "xkv:host"):
        sid = chats[kv_policy][0]
        stats = svc.restore(sid, kv_policy=kv_policy)
        assert stats.restore.tokens_recomputed == 0 and stats.restore.tokens_loaded > 0
        cache = svc._open[sid].session.cache
        assert isinstance(cache, HostResidentKV) == (kv_policy == "xkv:host")
        if kv_policy == "xkv:host":
            assert cache.device_bytes() == 0  # nothing of the chat on the device until a message streams it
        again[kv_policy] = send(svc, sid, LAST, kv_policy)
    assert again["xkv:host"] == again["xkv"]
    svc.close()


def test_a_round_missing_from_the_store_is_recomputed_into_host_memory(kvchat_home):
    """A round whose K/V is not stored is recomputed layer by layer through the device over the rounds loaded
    around it: the K/V the device cache recomputes for it (not what the reply stored, which was written reading its
    budget), then the same answer."""
    svc = service()
    sid = svc.create_chat(DEFAULT_MODEL, SYSTEM)
    for m in MESSAGES:
        send(svc, sid, m, "xkv:host")
    svc.close()
    store = Store()
    rows = [s for s in store.segments(sid) if s["round_idx"] == 1 and s["kind"] == SEGMENT_KV]
    store.unlink_files(store.drop_segment_rows(sid, [(1, s["kind"], s["layer_start"]) for s in rows]))
    rounds = store.rounds(sid)
    n_layers = shared_engine().config.n_layers
    restored = {}
    for kv_policy in ("xkv", "xkv:host"):  # the device cache first: its restore stores round 1 again
        if kv_policy == "xkv:host":
            store.unlink_files(store.drop_segment_rows(sid, [(1, s["kind"], s["layer_start"]) for s in rows]))
        svc = service()
        stats = svc.restore(sid, kv_policy=kv_policy).restore
        assert stats.tokens_recomputed == rounds[1].token_end - rounds[1].token_start
        assert any(note.startswith("round 1:") for note in stats.notes)
        cache = svc._open[sid].session.cache
        assert isinstance(cache, HostResidentKV) == (kv_policy == "xkv:host")
        assert cache.length == rounds[-1].token_end
        restored[kv_policy] = cache.read(range(n_layers), 0, cache.length), send(svc, sid, LAST, kv_policy)
        store.unlink_files(svc.store.delete_last_round(sid)[1])  # the next restore starts from the same chat
        svc.close()
        rows = [s for s in store.segments(sid) if s["round_idx"] == 1 and s["kind"] == SEGMENT_KV]
    (device_kv, device_reply), (host_kv, host_reply) = restored["xkv"], restored["xkv:host"]
    assert (host_kv - device_kv).abs().max() <= 1e-3 * device_kv.abs().max()
    assert host_reply == device_reply == "You live in Lisbon."


def test_an_xkv_chat_whose_full_cache_does_not_fit_stays_in_host_memory(models, cpu_budget):  # noqa: F811
    """Between what the host-resident chat needs and what the full cache needs, `send --kv-policy xkv` keeps the
    chat's K/V in host memory (said once); below the host-resident plan the tiered cache or a refusal follows."""
    from kvchat.engine.text.chat_format import Conversation

    path = models.get(n_layers=4)
    sid = kvchat("new", "--model", str(path)).stdout.strip()
    for i in range(4):
        kvchat("send", sid, f"Remember the number {i}.", "--max-tokens", "8")
    engine = Engine(path, device="cpu")
    budget = memory.Budget(torch.device("cpu"), 1 << 40, "--gpu-memory")
    rounds = Store().rounds(sid)
    message = "What was the first number?"
    new = len(engine.chat.open_round_tokens(Conversation([], None), message)) + 8 + 1
    lengths = [r.token_end - r.token_start for r in rounds]
    full = plan_memory(memory.chat_needs(engine, budget, rounds[-1].token_end, new, lengths))
    from kvchat.engine.policies import make_policy

    host = memory.plan_host_chat(engine, replace(budget, bytes=full.needed - 1), rounds[-1].token_end, new, lengths,
                                 make_policy("xkv", engine, budget=0.2))
    assert full.kind == "full" and host.kind == "host" and host.needed < full.needed
    out = kvchat("send", sid, message, "--kv-policy", "xkv", "--gpu-memory", f"{(full.needed - 1) // 1024}KiB",
                 "--max-tokens", "8", "--json")
    assert json.loads(out.stdout)["kv_policy"] == "xkv:host"
    assert out.stderr.count("it stays in host memory, each message streamed through the GPU") == 1, out.stderr
    notes = json.loads(kvchat("show", sid, "--json").stdout)["last_restore"]["notes"]
    assert "stays in host memory" in notes[0]
    # With room to spare the chat runs over the full cache on the device.
    out = kvchat("send", sid, "And the second?", "--kv-policy", "xkv", "--gpu-memory", "8GiB", "--max-tokens", "8",
                 "--json")
    assert json.loads(out.stdout)["kv_policy"] == "xkv" and "host memory" not in out.stderr
