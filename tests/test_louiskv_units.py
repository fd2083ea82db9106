"""A chat's retrieval units stored with it (LouisKV, issue 44; engine.kv.units, app/session/units.py): a round's
message in clusters and its reply in segments at the trigger's boundaries, written beside its K/V when it is saved,
read (never clustered again) when the chat is opened, built once for a round stored without them or whose units
are damaged, and carried by state files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor

import kvchat.app.session.restore as restore_module
import kvchat.app.session.units as units_module
import kvchat.engine.policies.louiskv as louiskv_module
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.service import ChatService
from kvchat.app.session.units import pack_units, unpack_units
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.kv.units import Units, in_stored_precision, round_units, segment_units, sliced
from kvchat.engine.policies import make_policy
from kvchat.engine.sampling import SamplingParams
from kvchat.storage.db import SEGMENT_UNITS, Store
from kvchat.storage.statefile import export_session, import_state
from tui_support import shared_engine

SYSTEM = "You are kvchat, a helpful assistant that remembers what the user tells you."
FACTS = ("My dog is called Rex. Our canoe is called Blue Heron. My sister lives in Lisbon. I was born in Porto. "
         "The cat is called Miso. ")
MESSAGES = [FACTS * 2, "Also remember: the boat's code is K-7731.", "What is my dog called?"]


def keys(seed: int, g=2, h=2, n=40, d=8) -> torch.Tensor:
    return torch.randn(g, h, n, d, generator=torch.Generator().manual_seed(seed))


def test_a_reply_is_cut_where_each_layers_trigger_fired_and_no_segment_runs_longer_than_the_longest():
    k = keys(0)
    cuts = torch.zeros(2, 40, dtype=torch.bool)
    cuts[0, [5, 9]] = True  # layer 0's trigger fired at tokens 5 and 9; layer 1's never
    units = segment_units(k, 100, cuts, longest=16)
    assert units.start == 100 and units.end == 140
    want0 = [0] * 5 + [1] * 4 + [2] * 16 + [3] * 15  # 9..24, then from 25 on: no segment past 16 tokens
    want1 = [0] * 16 + [1] * 16 + [2] * 8
    assert units.member[0, 0].tolist() == want0 and units.member[1, 1].tolist() == want1
    assert torch.equal(units.member[0, 0], units.member[0, 1])  # a layer's KV heads share its boundaries
    for layer, head, unit in ((0, 1, 1), (0, 0, 3), (1, 0, 2)):  # each summary: the mean of its keys (as stored)
        mask = units.member[layer, head] == unit
        mean = k[layer, head, mask].mean(0)
        assert torch.allclose(units.summary[layer, head, unit, 0], in_stored_precision(mean), rtol=0, atol=1e-6)
        assert torch.allclose(units.summary[layer, head, unit, 0], mean, rtol=0.07, atol=mean.abs().max() / 16)
    assert units.member[1].max() == 2  # layer 1's fourth centroid is unused: no slot points to it
    plain = segment_units(k, 0, None, longest=16)  # no trigger watched: segments of `longest`
    assert plain.member[0, 0].tolist() == want1


def test_a_rounds_units_are_its_messages_clusters_then_its_replys_segments():
    k = keys(1, n=48)
    units = round_units(k, 10, 42, None, tokens_per_cluster=8, longest=8)
    message, reply = units.member[:, :, :32], units.member[:, :, 32:]
    assert int(message.max()) < 4 <= int(reply.min())  # ceil(32 / 8) clusters first
    assert reply[0, 0].tolist() == [4] * 8 + [5] * 8
    part = sliced(units, 20, 50)
    assert (part.start, part.end) == (20, 50) and torch.equal(part.member, units.member[:, :, 10:40])
    with pytest.raises(ValueError):
        sliced(units, 5, 20)


def test_units_pack_into_a_segment_and_back_exactly():
    # centroids are made in the 8-bit format's precision, so the segment gives back exactly what the session read
    units = round_units(keys(2, n=37), 3, 20, None, tokens_per_cluster=4, longest=6)
    assert torch.equal(units.summary, in_stored_precision(units.summary))
    packed = pack_units(units)
    assert packed.dtype == torch.uint8 and packed.shape[1] == 2
    # at a real head size (128) about half the bytes of the format before: its centroids took them
    wide = round_units(keys(4, n=600, d=128), 0, 400, None)
    assert 0.45 < pack_units(wide).numel() / (pack_units_bfloat16(wide).numel() * 2) < 0.55
    back = unpack_units(packed, 3, 40)
    assert torch.equal(back.member, units.member) and back.summary.dtype == torch.float32
    assert torch.equal(back.summary, units.summary[:, :, : back.n_units])
    assert back.n_units == int(units.member.max()) + 1  # the units no member names are not stored
    # segments of the formats before (chats saved before) read back the centroids they hold
    for old_format, precision in ((pack_units_bfloat16, torch.bfloat16), (pack_units_float32, torch.float32)):
        old = unpack_units(old_format(units), 3, 40)
        want = units.summary[:, :, : old.n_units].to(precision).float()
        assert torch.equal(old.member, units.member) and torch.equal(old.summary, want)
    # more units than a member's int16 holds: refused, not stored wrong
    many = Units(0, 1, torch.zeros(1, 1, 1, dtype=torch.long), torch.zeros(1, 1, (1 << 15) + 1, 1, 8))
    with pytest.raises(ValueError, match="more than a units segment holds"):
        pack_units(many)
    # a token naming a unit the segment does not hold, in each format
    g, _, h, rows, d = packed.shape
    packed[0, 1].reshape(h, rows * d)[0, :2].view(torch.int16)[0] = 10_000
    bf16 = pack_units_bfloat16(units)
    bf16[0, 1, 0, 0].view(torch.int16)[0] = 10_000
    before = pack_units_float32(units)
    before[0, 1, 0, 0, 0] = 10_000
    for bad in (packed, bf16, before):
        with pytest.raises(ValueError, match="does not hold"):
            unpack_units(bad, 3, 40)


def test_an_8_bit_units_segment_whose_scales_do_not_fit_is_refused_not_read_past():
    """The scales follow the members in plane 1: a segment cut short (its rows too few for the units its members
    name) is refused, never read into the zeros or past the end."""
    units = round_units(keys(3, n=64, d=4), 0, 40, None, tokens_per_cluster=4, longest=6)
    packed = pack_units(units)
    named = int(units.member.max()) + 1
    rows = packed.shape[3]
    assert rows == max(named, -(-(2 * 64 + 2 * named) // 4))  # d = 4: the members and scales need more than U rows
    with pytest.raises(ValueError, match="does not hold"):
        unpack_units(packed[:, :, :, : rows - 1].contiguous(), 0, 64)
    with pytest.raises(ValueError, match="head size"):
        pack_units(round_units(keys(3, n=8, d=3), 0, 4, None, tokens_per_cluster=4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_units_unpacked_where_their_segments_are_match_the_hosts_and_flag_the_bad_ones(device):
    """`units_of_packed` (a lazy open on a GPU unpacks there, with one wait for every round) gives what the host's
    `unpack_units` gives, for every format, and None for a segment naming units it does not hold."""
    from kvchat.app.session.units import units_of_packed

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    units = round_units(keys(2, n=37), 3, 20, None, tokens_per_cluster=4, longest=6)
    other = round_units(keys(2, n=37).flip(2), 3, 20, None, tokens_per_cluster=4, longest=6)
    damaged = pack_units(other)
    damaged[1, 1, 0, 0, 6:8].view(torch.int16)[0] = 10_000
    packed = [pack_units(units), pack_units_bfloat16(units), pack_units_float32(units), damaged]
    got = units_of_packed([p.to(device) for p in packed], [(3, 40)] * 4)
    for p, back in zip(packed[:3], got[:3]):
        want = unpack_units(p, 3, 40)
        assert back.summary.device.type == device
        assert torch.equal(back.member.cpu(), want.member) and torch.equal(back.summary.cpu(), want.summary)
        assert back.summary.is_contiguous() and back.summary.untyped_storage().data_ptr() != \
            p.untyped_storage().data_ptr()  # (its own copy, not a view holding the whole segment)
    assert torch.equal(got[0].summary.cpu(), units.summary[:, :, : got[0].n_units])  # as the session read them
    assert got[3] is None and units_of_packed([], []) == []


def pack_units_bfloat16(units: Units) -> Tensor:
    """The units segment's format from 2026-11-28 to 11-29: bfloat16, plane 0 the centroids, plane 1 the members'
    int16 bits."""
    g, h, u, _, d = units.summary.shape
    n = units.member.shape[2]
    rows = max(u, -(-n // d), 1)
    packed = torch.zeros(g, 2, h, rows, d, dtype=torch.bfloat16)
    packed[:, 0, :, :u] = units.summary[:, :, :, 0].to(torch.bfloat16)
    members = torch.zeros(g, h, rows * d, dtype=torch.int16)
    members[:, :, :n] = units.member.to(torch.int16)
    packed[:, 1] = members.view(g, h, rows, d).view(torch.bfloat16)
    return packed


def pack_units_float32(units: Units) -> Tensor:
    """The units segment's format before 2026-11-28: float32, members as float32 values."""
    g, h, u, _, d = units.summary.shape
    n = units.member.shape[2]
    rows = max(u, -(-n // d), 1)
    packed = torch.zeros(g, 2, h, rows, d)
    packed[:, 0, :, :u] = units.summary[:, :, :, 0]
    members = torch.zeros(g, h, rows * d)
    members[:, :, :n] = units.member.float()
    packed[:, 1] = members.view(g, h, rows, d)
    return packed


def louiskv(tau: float = 0.5):
    return make_policy("louiskv", shared_engine(), tau=tau, tokens=16, buffer=8)


def new_chat(store: Store) -> str:
    return ChatService(device="cpu").create_chat(DEFAULT_MODEL, SYSTEM)  # in the same home as `store`


def run_chat(store: Store, sid: str, policy, messages: list[str]) -> ChatSession:
    session = ChatSession(store, shared_engine(), sid, policy=policy)
    for text in messages:
        session.send(text, max_tokens=12, sampling=SamplingParams())
    session.writer.drain()
    return session


def stored_units(store: Store, sid: str) -> dict[int, dict]:
    return {s["round_idx"]: s for s in store.segments(sid) if s["kind"] == SEGMENT_UNITS}


def count_clustering(monkeypatch) -> list[int]:
    made = []
    real = louiskv_module.round_units

    def counted(keys, start, *args, **kw):
        made.append(start)
        return real(keys, start, *args, **kw)

    monkeypatch.setattr(louiskv_module, "round_units", counted)
    real_cluster = louiskv_module.cluster_units
    monkeypatch.setattr(louiskv_module, "cluster_units",
                        lambda k, start, *a: made.append(start) or real_cluster(k, start, *a))
    return made



def test_a_reopened_chat_reads_its_units_while_its_k_v_is_restored(kvchat_home, monkeypatch):
    """Every round's units file is read on the reader threads from the restore's start (`read_ahead`), each once,
    not after the K/V is in: the restore waits, before it returns, until each read has begun."""
    store = Store()
    sid = new_chat(store)
    run_chat(store, sid, louiskv(), MESSAGES).close()
    begun, all_begun, lock = [], threading.Event(), threading.Lock()
    real_read, real_run = units_module.ChatUnits._read, restore_module.RestoreRun.run

    def read(self, seg, row):
        with lock:
            begun.append(row.idx)
            if len(begun) == len(MESSAGES):
                all_begun.set()
        return real_read(self, seg, row)

    def run(self, *args, **kwargs):
        stats = real_run(self, *args, **kwargs)
        run.waited = all_begun.wait(10)  # before the restore returns, hence before `load` is called
        return stats

    monkeypatch.setattr(units_module.ChatUnits, "_read", read)
    monkeypatch.setattr(restore_module.RestoreRun, "run", run)
    made = count_clustering(monkeypatch)
    again = ChatSession(store, shared_engine(), sid, policy=louiskv())
    stats = again.restore()
    assert run.waited and sorted(begun) == list(range(len(MESSAGES)))  # each round's file read once, ahead
    assert not made and not [n for n in stats.notes if "retrieval units" in n]
    assert sorted(again.cache.units) == [(r.token_start, r.token_end) for r in again.rounds]
    again.close()

def test_a_louiskv_chat_stores_each_rounds_units_and_a_reopened_chat_reads_them(kvchat_home, monkeypatch):
    store = Store()
    sid = new_chat(store)
    policy = louiskv(tau=1.0)  # the trigger fires at every reply token: every token its own segment
    session = run_chat(store, sid, policy, MESSAGES)
    rounds = session.rounds
    units = stored_units(store, sid)
    assert sorted(units) == [0, 1, 2]
    kept = {span: u for span, u in session.cache.units.items()}
    session.close()
    # The last round's reply (generated under the policy's own step) is cut at every token it decoded: each of
    # them but the last is a segment of its own.
    last, decoded = rounds[-1], len(policy.reply_cuts)
    sizes = torch.bincount(kept[(last.token_start, last.token_end)].member[0, 0])
    assert decoded >= 6 and int((sizes == 1).sum()) >= decoded - 1
    # Reopened: every round's units come from the store, none is clustered again, and they are the saved ones.
    made = count_clustering(monkeypatch)
    again = ChatSession(store, shared_engine(), sid, policy=louiskv())
    stats = again.restore()
    assert not [n for n in stats.notes if "retrieval units" in n]
    for span, u in kept.items():
        assert torch.equal(again.cache.units[span].member.cpu(), u.member.cpu())
        assert torch.allclose(again.cache.units[span].summary.cpu(), u.summary.float().cpu())
    again.send("And what is my cat called?", max_tokens=8, sampling=SamplingParams())
    # only the new message's: its own span for its reply (before the buffer), then its round's units at its save
    assert made == [again.rounds[-1].token_start] * 2
    again.writer.drain()
    again.close()
    assert sorted(stored_units(store, sid)) == [0, 1, 2, 3]


def test_a_chat_stored_without_units_gets_them_built_once_and_a_damaged_one_is_rebuilt(kvchat_home, monkeypatch):
    store = Store()
    sid = new_chat(store)
    run_chat(store, sid, None, MESSAGES).close()  # the full cache: no units stored
    assert not stored_units(store, sid)
    session = ChatSession(store, shared_engine(), sid, policy=louiskv())
    notes = session.restore().notes
    assert any("retrieval units built for 3 of 3 rounds" in n and "stored without them" in n for n in notes), notes
    session.writer.drain()
    session.close()
    units = stored_units(store, sid)
    assert sorted(units) == [0, 1, 2]
    made = count_clustering(monkeypatch)
    session = ChatSession(store, shared_engine(), sid, policy=louiskv())
    assert not [n for n in session.restore().notes if "retrieval units" in n] and not made
    session.close()
    # A damaged units file: that round's units are built again from its K/V, said once, and stored again.
    path = store.kv_dir / units[1]["file"]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    session = ChatSession(store, shared_engine(), sid, policy=louiskv())
    notes = [n for n in session.restore().notes if "retrieval units" in n]
    assert len(notes) == 1 and "built for 1 of 3 rounds" in notes[0] and "round 1:" in notes[0], notes
    assert made == [session.rounds[1].token_start]
    session.writer.drain()
    session.close()
    # The K/V itself was never in question: a full-cache open of the chat has nothing to say about units.
    plain = ChatSession(store, shared_engine(), sid)
    assert not [n for n in plain.restore().notes if "units" in n]
    plain.close()


def test_a_state_file_carries_the_units(kvchat_home, tmp_path):
    store = Store()
    sid = new_chat(store)
    run_chat(store, sid, louiskv(), MESSAGES[:2]).close()
    out = tmp_path / "chat.kvstate"
    info = store.session(sid)
    export_session(store, sid, out, model_name="embedded")
    new_sid = import_state(store, out, current_fingerprint=info["model_fingerprint"],
                           model_path=info["model_path"]).session_id
    assert {i: s["file"] for i, s in stored_units(store, new_sid).items()} == \
        {i: s["file"] for i, s in stored_units(store, sid).items()}
    layers = shared_engine().config.global_layers
    for s in stored_units(store, new_sid).values():
        assert (store.kv_dir / s["file"]).exists() and s["layer_end"] - s["layer_start"] >= len(layers)
    assert Path(out).stat().st_size > 0


def test_a_state_file_with_8_bit_units_says_version_4_and_one_of_bfloat16_units_version_3(kvchat_home, tmp_path,
                                                                                          monkeypatch):
    """Units of bytes are a dtype a kvchat reading version 3 at most does not know: such a file says version 4, so
    an older kvchat refuses it by its version (rather than calling its segments corrupt); a chat whose units are
    all bfloat16 stays version 3."""
    import json
    import zipfile

    def version(sid: str) -> int:
        out = tmp_path / f"{sid}.kvstate"
        export_session(store, sid, out, model_name="embedded")
        with zipfile.ZipFile(out) as zf:
            return json.loads(zf.read("manifest.json"))["version"]

    store = Store()
    sid = new_chat(store)
    run_chat(store, sid, louiskv(), MESSAGES[:1]).close()
    assert {s["dtype"] for s in stored_units(store, sid).values()} == {"uint8"} and version(sid) == 4
    monkeypatch.setattr(units_module, "pack_units", pack_units_bfloat16)
    older = new_chat(store)
    run_chat(store, older, louiskv(), MESSAGES[:1]).close()
    assert {s["dtype"] for s in stored_units(store, older).values()} == {"bfloat16"} and version(older) == 3
