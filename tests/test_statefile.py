"""State files: export/import round trips, and hostile files refused with one line and no change to the store."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_run import kvchat
from kvchat.app.session.chat import ChatSession
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.storage.db import RoundRow, Store, now
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.segments import write_segment
from kvchat.storage.statefile import StateFileError, export_session, import_state


@pytest.fixture(scope="module")
def engine():
    return Engine(DEFAULT_MODEL, device="cpu")


@pytest.fixture
def chat(engine, kvchat_home):
    store = Store()
    sid = store.create_session(title="trip", model_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                               model_path=str(DEFAULT_MODEL), system_prompt="Be brief.")
    session = ChatSession(store, engine, sid)
    for m in ("My name is Ada.", "I live in Lisbon."):
        session.send(m)
    session.close()
    return store, sid


def snapshot(store: Store):
    return (json.dumps(store.sessions(), default=str), sorted(p.name for p in store.kv_dir.iterdir()))


def test_export_import_round_trip_restores_without_recompute(chat, engine, tmp_path):
    store, sid = chat
    path = export_session(store, sid, tmp_path / "trip.kvstate")
    new = import_state(store, path, current_fingerprint=model_fingerprint(DEFAULT_MODEL, store),
                       model_path=str(DEFAULT_MODEL))
    assert new.rounds == 2 and new.segments == 2 and not new.notices
    assert [(r.user_text, r.assistant_text) for r in store.rounds(new.session_id)] == \
        [(r.user_text, r.assistant_text) for r in store.rounds(sid)]
    stats = ChatSession(store, engine, new.session_id).restore()
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded > 0


def test_text_only_export_and_foreign_model_import_as_text(chat, tmp_path):
    store, sid = chat
    text_only = export_session(store, sid, tmp_path / "t.kvstate", text_only=True)
    with zipfile.ZipFile(text_only) as zf:
        assert zf.namelist() == ["manifest.json"]
    full = export_session(store, sid, tmp_path / "f.kvstate")
    res = import_state(store, full, current_fingerprint="ab" * 32, model_path="/other.gguf")
    assert res.segments == 0 and "another model" in res.notices[0] and res.rounds == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.tuples(st.text(max_size=200), st.text(max_size=200)), min_size=1, max_size=6),
       title=st.text(max_size=50), system=st.none() | st.text(max_size=80))
def test_text_round_trip_any_unicode(tmp_path_factory, texts, title, system):
    store = Store(tmp_path_factory.mktemp("home"))
    sid = store.create_session(title=title, model_fingerprint="c" * 64, model_path="/m.gguf", system_prompt=system)
    for i, (u, a) in enumerate(texts):
        store.add_round(sid, RoundRow(i, u, a, i * 10, i * 10 + 10, now()))
    path = export_session(store, sid, tmp_path_factory.mktemp("out") / "s.kvstate", text_only=True)
    new = import_state(store, path, current_fingerprint="c" * 64, model_path="/m.gguf")
    assert [(r.user_text, r.assistant_text) for r in store.rounds(new.session_id)] == texts
    info = store.session(new.session_id)
    assert (info["title"], info["system_prompt"]) == (title, system)


# ---- hostile files ----

def rewrite(src: Path, dst: Path, edit_manifest=None, members: dict[str, bytes] | None = None,
            compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(src) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        blobs = {n: zf.read(n) for n in zf.namelist() if n != "manifest.json"}
    if edit_manifest:
        edit_manifest(manifest)
    blobs.update(members or {})
    with zipfile.ZipFile(dst, "w", compression) as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
        for name, data in blobs.items():
            zf.writestr(name, data)
    return dst


def bomb_segment(good: bytes) -> tuple[str, bytes]:
    """A segment whose hashes all check out but whose payload is a zstd frame declaring 64 GiB."""
    from kvchat.storage.segments import _PREFIX  # header layout: recompute the checksums a forger would

    head_len = _PREFIX.unpack(good[: _PREFIX.size])[2]
    header = bytearray(good[:head_len])
    payload = _frame_declaring(1 << 36)
    header[-40:-32] = len(payload).to_bytes(8, "little")  # payload_size (raw_size stays: the frame contradicts it)
    header[-32:] = hashlib.sha256(payload).digest()  # payload checksum
    data = bytes(header) + payload
    return hashlib.sha256(data).hexdigest() + ".kvs", data


def _frame_declaring(size: int) -> bytes:
    """A tiny zstd frame whose header claims `size` bytes of content."""
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    tiny = stream.compress(b"\0" * 64) + stream.flush()
    params = zstandard.get_frame_parameters(tiny)
    assert params.content_size == zstandard.CONTENTSIZE_UNKNOWN
    # Frame header: magic, descriptor with an 8-byte content size field, window, then the blocks.
    magic, fhd = tiny[:4], tiny[4]
    window = tiny[5:6] if not fhd & 0x20 else b""
    rest = tiny[5 + len(window):]
    return magic + bytes([0xC0 | (fhd & 0x20) | (fhd & 0x04)]) + window + size.to_bytes(8, "little") + rest


HOSTILE = {
    "path traversal": lambda m, d: d.__setitem__("edit", lambda mf: mf["segments"][0].update(file="../../evil.kvs")),
    "unknown version": lambda m, d: d.__setitem__("edit", lambda mf: mf.update(version=99)),
    "not a state file": lambda m, d: d.__setitem__("edit", lambda mf: mf.update(format="something else")),
    "round spans broken": lambda m, d: d.__setitem__("edit", lambda mf: mf["rounds"][1].update(token_start=3)),
    "missing blob": lambda m, d: d.__setitem__("edit", lambda mf: mf["segments"][0].update(file="0" * 64 + ".kvs")),
    "bad merged pairs": lambda m, d: d.__setitem__("edit", lambda mf: mf["segments"][0].update(merged="1+x")),
    "a kind posing as another": lambda m, d: d.__setitem__("edit", lambda mf: mf["segments"][0].update(
        kind="merged")),
}


@pytest.fixture
def exported(chat, tmp_path):
    store, sid = chat
    return store, export_session(store, sid, tmp_path / "good.kvstate")


def import_refused(store: Store, path: Path, needle: str) -> None:
    before = snapshot(store)
    proc = kvchat("import", str(path), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("kvchat: error: "), proc.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert snapshot(Store()) == before


@pytest.mark.parametrize("case,needle", [("path traversal", "segment 0 is malformed"),
                                         ("unknown version", "version 99 is not supported"),
                                         ("not a state file", "not a kvchat state manifest"),
                                         ("round spans broken", "round 1 is malformed"),
                                         ("missing blob", "is missing"),
                                         ("bad merged pairs", "segment 0 is malformed"),
                                         ("a kind posing as another", "does not hold what the manifest says")])
def test_hostile_manifests(exported, tmp_path, case, needle):
    store, good = exported
    spec = {}
    HOSTILE[case](None, spec)
    import_refused(store, rewrite(good, tmp_path / "bad.kvstate", spec["edit"]), needle)


def test_zip_member_with_a_path_outside_is_never_extracted(exported, tmp_path):
    store, good = exported
    bad = rewrite(good, tmp_path / "evil.kvstate", members={"../../../tmp/kvchat-pwned": b"x"})
    out = kvchat("import", str(bad))
    assert out.returncode == 0 and not Path("/tmp/kvchat-pwned").exists()


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated(exported, tmp_path, cut):
    store, good = exported
    data = good.read_bytes()
    bad = tmp_path / "cut.kvstate"
    bad.write_bytes(data[: int(len(data) * cut)])
    import_refused(store, bad, "cut.kvstate")


def test_flipped_blob_byte(exported, tmp_path):
    store, good = exported
    with zipfile.ZipFile(good) as zf:
        name = next(n for n in zf.namelist() if n.startswith("blobs/"))
        blob = bytearray(zf.read(name))
    blob[len(blob) // 2] ^= 0x01
    import_refused(store, rewrite(good, tmp_path / "flip.kvstate", members={name: bytes(blob)}), "checksum")


def test_oversized_manifest(exported, tmp_path):
    store, good = exported
    huge = {"format": "kvchat-state", "version": 1, "padding": "x" * (40 << 20)}
    bad = tmp_path / "big.kvstate"
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zf:  # 40 MiB that compresses to a few KiB
        zf.writestr("manifest.json", json.dumps(huge))
    assert bad.stat().st_size < 1 << 20
    import_refused(store, bad, "more than the")


def test_zstd_frame_declaring_a_huge_size(exported, tmp_path):
    store, good = exported
    with zipfile.ZipFile(good) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        seg = manifest["segments"][0]
        name, data = bomb_segment(zf.read(f"blobs/{seg['file']}"))

    def edit(mf):
        for s in mf["segments"]:
            if s["file"] == seg["file"]:
                s.update(file=name, byte_size=len(data))

    bad = rewrite(good, tmp_path / "bomb.kvstate", edit, members={f"blobs/{name}": data})
    import_refused(store, bad, "cannot be decoded")


def test_export_failure_leaves_no_file(chat, tmp_path, monkeypatch):
    store, sid = chat

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvchat.paths.os.fsync", no_space)  # the atomic write is paths.replace_atomically
    out = tmp_path / "exports"
    out.mkdir()
    with pytest.raises(StateFileError, match="No space left on device"):
        export_session(store, sid, out / "x.kvstate")
    assert list(out.iterdir()) == []


# ---- segment kinds ----

FP = "c" * 64


@pytest.fixture
def bounded(kvchat_home, tmp_path):
    """A chat (no model needed) whose round stored its K/V and its key bounds (2 blocks of 32 for 40 tokens),
    exported."""
    store = Store()
    sid = store.create_session(title="bounds", model_fingerprint=FP, model_path="/m.gguf", system_prompt=None)
    store.add_round(sid, RoundRow(0, "u", "a", 0, 40, now()))
    g = torch.Generator().manual_seed(0)
    for kind, rows in (("kv", 40), ("key-bounds", 2)):
        tensor = torch.randn(2, 2, 1, rows, 4, generator=g).half()
        ref = write_segment(store.kv_dir, tensor, fingerprint=FP, layers=range(2, 4), tokens=range(40), kind=kind)
        store.add_segment(sid, kind=kind, round_idx=0, layer_start=2, layer_end=4, token_start=0, token_end=40,
                          codec=ref.codec, dtype="float16", byte_size=ref.byte_size, raw_size=ref.raw_size,
                          checksum=ref.checksum, file=ref.file, model_fingerprint=FP)
    return store, sid, export_session(store, sid, tmp_path / "bounds.kvstate")


def kinds(store: Store, sid: str) -> list[tuple[str, str]]:
    return [(s["kind"], s["file"]) for s in store.segments(sid)]


def test_round_trip_keeps_each_segments_kind(bounded):
    store, sid, path = bounded
    with zipfile.ZipFile(path) as zf:
        assert [s["kind"] for s in json.loads(zf.read("manifest.json"))["segments"]] == ["key-bounds", "kv"]
    new = import_state(store, path, current_fingerprint=FP, model_path="/m.gguf")
    assert new.segments == 2 and kinds(store, new.session_id) == kinds(store, sid)


def test_manifest_without_kinds_imports_as_kv(bounded, tmp_path):
    store, sid, path = bounded

    def before_kinds(mf):  # as kvchat exported before segments had kinds: K/V only, no "kind"
        mf["segments"] = [{k: v for k, v in s.items() if k != "kind"} for s in mf["segments"] if s["kind"] == "kv"]

    new = import_state(store, rewrite(path, tmp_path / "old.kvstate", before_kinds), current_fingerprint=FP,
                       model_path="/m.gguf")
    assert kinds(store, new.session_id) == [k for k in kinds(store, sid) if k[0] == "kv"]


def test_unit_frames_stay_out_of_an_export(bounded, tmp_path):
    """A round's unit frames (a second copy of its K/V, for lazy resumes) are left out, and a manifest naming one is
    refused: the importer rebuilds them."""
    from kvchat.storage.unit_frames import write_unit_frames

    store, sid, _ = bounded
    rows, counts = torch.zeros(1, 1, 2, 40, 4, dtype=torch.float16), torch.tensor([[[40]]])
    ref = write_unit_frames(store.kv_dir, rows, counts, fingerprint=FP, tokens=range(40))
    store.add_segment(sid, kind="unit-rows", round_idx=0, layer_start=0, layer_end=4, token_start=0, token_end=40,
                      codec=ref.codec, dtype="float16", byte_size=ref.byte_size, raw_size=ref.raw_size,
                      checksum=ref.checksum, file=ref.file, model_fingerprint=FP)
    path = export_session(store, sid, tmp_path / "framed.kvstate")
    with zipfile.ZipFile(path) as zf:
        assert [s["kind"] for s in json.loads(zf.read("manifest.json"))["segments"]] == ["key-bounds", "kv"]
        assert f"blobs/{ref.file}" not in zf.namelist()


@pytest.mark.parametrize("kind,needle", [("bounds", "segment 0 is of an unknown kind 'bounds'"),
                                         ("unit-rows", "segment 0 is of an unknown kind 'unit-rows'"),
                                         (7, "segment 0 is of an unknown kind '7'"),
                                         ("kv", "does not hold what the manifest says")])  # key bounds called K/V
def test_unknown_or_wrong_kind_is_refused(bounded, tmp_path, kind, needle):
    store, sid, path = bounded
    bad = rewrite(path, tmp_path / "bad.kvstate", lambda mf: mf["segments"][0].update(kind=kind))
    before = snapshot(store)
    with pytest.raises(StateFileError, match=needle) as err:
        import_state(store, bad, current_fingerprint=FP, model_path="/m.gguf")
    assert "\n" not in str(err.value) and snapshot(store) == before
