"""State files: one chat exported as a single zip file — a JSON manifest and the chat's KV segment files as blobs.

Importing treats the file as hostile: only members the manifest names are read, each into memory and never past a
size cap (the zip's own size fields are not trusted), names must be content hashes (no paths, so nothing can land
outside the store), every blob's hash and every segment's checksums and sizes are verified before anything is
decompressed or written, and nothing is written unless the whole file is valid.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.paths import replace_atomically
from kvchat.storage.codec import StorageError
from kvchat.storage.db import (CHAT_PARAMETERS, REPLY_DONE, REPLY_STATES, SEGMENT_KINDS, SEGMENT_KV, SEGMENT_MERGED,
                              SEGMENT_UNIT_ROWS, SEGMENT_UNITS, RoundRow, Store, chat_parameters, now)
from kvchat.storage.segments import SUFFIX, layer_rows_fit, parse_segment, store_segment_bytes, token_rows_fit

FORMAT = "kvchat-state"
# 2: segments of kind "merged" and the `merged` column (cross-layer merging); 3: segments of kind "units" (a round's
# retrieval units, LouisKV); 4: units segments of bytes (uint8: 8-bit centroids, since 2026-11-29), a dtype a kvchat
# reading 3 at most does not know. Each is written only when used, so a chat without them stays readable by an older
# kvchat, which refuses a newer file by its version rather than calling its segments corrupt.
VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 32 << 20
MAX_BLOB_BYTES = 4 << 30
MAX_TOTAL_BYTES = 64 << 30
MAX_ROUNDS = 100_000
_BLOB_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))


class StateFileError(StorageError):
    pass


@dataclass
class ImportResult:
    session_id: str
    rounds: int
    segments: int
    notices: list[str] = field(default_factory=list)


def export_session(store: Store, sid: str, out: Path, *, text_only: bool = False, model_name: str = "") -> Path:
    """Write the chat to `out` atomically (temp file, fsync, rename): a reader never sees half a state file."""
    info = store.session(sid)
    rounds = store.rounds(sid)
    # (a round's unit rows are a copy of its K/V in another order, for a lazy resume: left out, as any cache the
    # importer can rebuild)
    segments = [] if text_only else [s for s in store.segments(sid) if s["kind"] != SEGMENT_UNIT_ROWS]
    manifest = {
        "format": FORMAT, "version": state_version(segments), "exported": now(),
        "model": {"fingerprint": info["model_fingerprint"], "name": model_name,
                  "file": Path(info["model_path"]).name},
        "session": {"title": info["title"], "system_prompt": info["system_prompt"], "settings": info["settings"],
                    # The chat's own parameters (NULL: the default); an older kvchat ignores the key, so the version
                    # stays.
                    "parameters": chat_parameters(info)},
        "rounds": [{"idx": r.idx, "user": r.user_text, "assistant": r.assistant_text, "token_start": r.token_start,
                    "token_end": r.token_end, "reply_state": r.reply_state} for r in rounds],
        "segments": [{k: s[k] for k in ("round_idx", "kind", "layer_start", "layer_end", "token_start", "token_end",
                                        "codec", "dtype", "byte_size", "raw_size", "checksum", "file", "live_from",
                                        "merged")}
                     for s in segments],
        # What a compacted chat leaves out (recomputing it was faster than loading it where it was exported), so
        # an importer can say so; anything absent is recomputed on first open either way.
        "absent": absent_kv(rounds, segments),
    }
    out = Path(out)

    def write(raw) -> None:
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(MANIFEST, json.dumps(manifest, ensure_ascii=False, indent=1))
            for name in sorted({s["file"] for s in segments}):
                zf.write(store.kv_dir / name, f"blobs/{name}")

    try:
        return replace_atomically(out, write, binary=True)
    except OSError as exc:  # a missing or read-only folder, a full disk: one line, nothing written
        raise StateFileError(f"cannot write {out}: {exc.strerror or exc}") from None


def state_version(segments: list[dict]) -> int:
    """The oldest version that can hold `segments`: 4 with units of bytes, 3 with units, 2 with merged layers, else
    1."""
    if any(s["kind"] == SEGMENT_UNITS and s.get("dtype") == "uint8" for s in segments):
        return 4
    if any(s["kind"] == SEGMENT_UNITS for s in segments):
        return 3
    return 2 if any(s.get("merged") or s["kind"] == SEGMENT_MERGED for s in segments) else 1


def absent_kv(rounds: list[RoundRow], segments: list[dict]) -> list[dict]:
    """Per round, the layer ranges no K/V segment covers (up to the highest layer any segment holds)."""
    kv = [s for s in segments if s.get("kind", SEGMENT_KV) == SEGMENT_KV]
    if not kv:
        return []
    top = max(s["layer_end"] for s in kv)
    by_round: dict[int, list[tuple[int, int]]] = {}
    for s in kv:
        by_round.setdefault(s["round_idx"], []).append((s["layer_start"], s["layer_end"]))
    absent = []
    for r in rounds:
        covered = 0
        for lo, hi in sorted(by_round.get(r.idx, [])):
            if lo > covered:
                absent.append({"round_idx": r.idx, "layer_start": covered, "layer_end": lo})
            covered = max(covered, hi)
        if covered < top:
            absent.append({"round_idx": r.idx, "layer_start": covered, "layer_end": top})
    return absent


def import_state(store: Store, path: Path, *, current_fingerprint: str, model_path: str) -> ImportResult:
    """Validate the whole state file in memory, then create a new session from it."""
    path = Path(path)
    manifest, blobs = _read_state(path)
    notices = []
    segments = manifest["segments"]
    if manifest["model"]["fingerprint"] != current_fingerprint and segments:
        notices.append("the chat's KV cache was computed by another model; imported as text, it will be "
                       "recomputed on first use")
        segments, blobs = [], {}
    elif segments and manifest["absent"]:
        left_out = len({a["round_idx"] for a in manifest["absent"]})
        notices.append(f"the state file leaves out the K/V of {left_out} of {len(manifest['rounds'])} rounds (the chat "
                       f"was compacted: where it was exported, recomputing them is faster than loading them); they "
                       f"are recomputed when the chat is opened, and kept if loading them is faster here")
    for seg in segments:
        header, _ = parse_segment(blobs[seg["file"]], seg["file"], fingerprint=manifest["model"]["fingerprint"])
        held = (header.layer_start, header.layer_end, header.token_start, header.token_end, header.checksum)
        said = (seg["layer_start"], seg["layer_end"], seg["token_start"], seg["token_end"], seg["checksum"])
        # The blob's header does not record its kind: its shape must fit the kind the manifest gives.
        if held != said or not token_rows_fit(seg["kind"], header.shape[3], len(header.tokens)) or \
                not layer_rows_fit(seg["kind"], header.shape[0], seg["layer_end"] - seg["layer_start"]):
            raise StateFileError(f"{path.name}: blob {seg['file'][:12]}… does not hold what the manifest says")
    # Everything is valid: write the blobs first (content-addressed, so harmless if we stop here), then the rows.
    store.check_writable("import a chat")
    for name, data in blobs.items():
        store_segment_bytes(store.kv_dir, name, data)
    s = manifest["session"]
    # A file written before reply states were kept holds whole replies.
    rows = [RoundRow(r["idx"], r["user"], r["assistant"], r["token_start"], r["token_end"], now(),
                     r.get("reply_state", REPLY_DONE)) for r in manifest["rounds"]]
    sid = store.insert_session(title=s["title"], model_fingerprint=current_fingerprint, model_path=model_path,
                               system_prompt=s["system_prompt"], settings=s["settings"], rounds=rows,
                               parameters=s["parameters"],
                               segments=[{**seg, "model_fingerprint": current_fingerprint} for seg in segments])
    return ImportResult(sid, len(rows), len(segments), notices)


def _read_state(path: Path) -> tuple[dict, dict[str, bytes]]:
    def bad(why: str) -> StateFileError:
        return StateFileError(f"{path.name} is not a valid kvchat state file: {why}")

    try:
        if path.stat().st_size > MAX_TOTAL_BYTES:
            raise bad(f"it is larger than {MAX_TOTAL_BYTES >> 30} GiB")
        with zipfile.ZipFile(path) as zf:
            members = {}
            for info in zf.infolist():
                if info.filename in members:
                    raise bad(f"member {info.filename[:60]!r} appears twice")
                members[info.filename] = info
            manifest = _validate_manifest(json.loads(_read_member(zf, members, MANIFEST, MAX_MANIFEST_BYTES, bad)), bad)
            blobs, total = {}, 0
            for seg in manifest["segments"]:
                name = seg["file"]
                if name in blobs:
                    continue
                data = _read_member(zf, members, f"blobs/{name}", min(seg["byte_size"], MAX_BLOB_BYTES), bad)
                if len(data) != seg["byte_size"]:
                    raise bad(f"blob {name[:12]}… is {len(data)} bytes, the manifest says {seg['byte_size']}")
                if hashlib.sha256(data).hexdigest() + SUFFIX != name:
                    raise bad(f"blob {name[:12]}… does not match its checksum")
                total += len(data)
                if total > MAX_TOTAL_BYTES:
                    raise bad("its blobs add up to more than the size cap")
                blobs[name] = data
            return manifest, blobs
    except StateFileError:
        raise
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise bad(f"damaged or not a zip archive ({exc})") from None
    except json.JSONDecodeError as exc:
        raise bad(f"its manifest is not JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise bad("its manifest is not UTF-8") from None
    except OSError as exc:
        raise StateFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (NotImplementedError, RuntimeError, ValueError) as exc:  # unsupported compression, encryption, ...
        raise bad(str(exc)[:120]) from None


def _read_member(zf: zipfile.ZipFile, members: dict, name: str, cap: int, bad) -> bytes:
    info = members.get(name)
    if info is None:
        raise bad(f"member {name[:60]!r} is missing")
    if info.file_size > cap:
        raise bad(f"member {name[:60]!r} declares {info.file_size} bytes, more than the {cap} allowed")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise bad(f"member {name[:60]!r} uses an unsupported compression")
    with zf.open(info) as f:
        data = f.read(cap + 1)  # the zip's size field can lie; never read past the cap
    if len(data) > cap:
        raise bad(f"member {name[:60]!r} is larger than it declares")
    return data


def _validate_manifest(m, bad) -> dict:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise bad("the manifest is not a kvchat state manifest")
    if m.get("version") not in READABLE_VERSIONS:
        raise bad(f"format version {m.get('version')!r} is not supported (this kvchat reads versions "
                  f"{', '.join(map(str, READABLE_VERSIONS))})")
    model, session, rounds, segments = (m.get(k) for k in ("model", "session", "rounds", "segments"))
    if not (isinstance(model, dict) and _is_hex64(model.get("fingerprint"))):
        raise bad("the model fingerprint is missing")
    if not (isinstance(session, dict) and isinstance(session.get("title"), str)
            and isinstance(session.get("system_prompt"), (str, type(None)))
            and isinstance(session.get("settings"), dict)):
        raise bad("the session entry is malformed")
    parameters = session.setdefault("parameters", {})  # files written before chats had parameters
    if not isinstance(parameters, dict) or not all(
            v is None or (_is_int(v) if kind is int else isinstance(v, (int, float)) and not isinstance(v, bool))
            for name, kind in CHAT_PARAMETERS.items() for v in [parameters.get(name)]):
        raise bad("the chat's parameters are malformed")
    session["parameters"] = {name: parameters.get(name) for name in CHAT_PARAMETERS}  # the known ones only
    if not isinstance(rounds, list) or len(rounds) > MAX_ROUNDS:
        raise bad("the rounds list is malformed")
    expect_start = 0
    for i, r in enumerate(rounds):
        ok = (isinstance(r, dict) and r.get("idx") == i and isinstance(r.get("user"), str)
              and isinstance(r.get("assistant"), str) and _is_int(r.get("token_start"))
              and _is_int(r.get("token_end")) and r["token_start"] == expect_start
              and r["token_end"] > r["token_start"] and r.get("reply_state", REPLY_DONE) in REPLY_STATES)
        if not ok:
            raise bad(f"round {i} is malformed")
        expect_start = r["token_end"]
    if not isinstance(segments, list):
        raise bad("the segments list is malformed")
    ints = ("round_idx", "layer_start", "layer_end", "token_start", "token_end", "byte_size", "raw_size")
    for j, s in enumerate(segments):
        if isinstance(s, dict):
            kind = s.setdefault("kind", SEGMENT_KV)  # files exported before segments had kinds hold only K/V
            if not (isinstance(kind, str) and kind in SEGMENT_KINDS and kind != SEGMENT_UNIT_ROWS):
                raise bad(f"segment {j} is of an unknown kind {str(kind)[:40]!r}")
            s.setdefault("live_from", 0)  # and before sliding windows were trimmed, every token
            s.setdefault("merged", "")  # and before cross-layer merging, no layer pairs
        ok = (isinstance(s, dict) and all(_is_int(s.get(k)) for k in ints)
              and isinstance(s.get("file"), str) and _BLOB_NAME.fullmatch(s["file"])
              and _is_hex64(s.get("checksum")) and isinstance(s.get("codec"), str) and isinstance(s.get("dtype"), str)
              and 0 <= s["round_idx"] < len(rounds) and 0 < s["byte_size"] <= MAX_BLOB_BYTES
              and _is_int(s["live_from"]) and 0 <= s["live_from"] <= s["token_end"]
              and isinstance(s["merged"], str) and _MERGED_PAIRS.fullmatch(s["merged"])
              and (s["token_start"], s["token_end"]) == (rounds[s["round_idx"]]["token_start"],
                                                         rounds[s["round_idx"]]["token_end"]))
        if not ok:
            raise bad(f"segment {j} is malformed")
    absent = m.setdefault("absent", [])  # files exported before compaction existed say nothing of it
    if not isinstance(absent, list) or not all(
            isinstance(a, dict) and all(_is_int(a.get(k)) for k in ("round_idx", "layer_start", "layer_end"))
            and a["round_idx"] < len(rounds) and a["layer_start"] < a["layer_end"] for a in absent):
        raise bad("the list of absent K/V is malformed")
    return m


_MERGED_PAIRS = re.compile(r"(\d{1,4}\+\d{1,4}(,\d{1,4}\+\d{1,4}){0,255})?")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 48


def _is_hex64(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None
