"""`kvchat bench storage`: what saving and restoring a chat's KV cache costs, next to what the disk allows.

A long chat is built from the held-out memory dialogues, prefilled once, and stored round by round as the app
stores it. Then: bytes on disk per token (byte planes + zstd, and plain zstd for comparison) against the raw KV;
decode speed while the background writer saves KV against decode speed alone; the disk's cold read bandwidth; and
the time to restore the chat in a fresh session with the page cache dropped, against bytes read ÷ bandwidth.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvchat.app.bench.engine_speed import drop_page_cache
from kvchat.app.session.chat import ChatSession
from kvchat.app.session.writer import KVWriter
from kvchat.engine.data.dialogues import dialogues
from kvchat.engine.engine import Engine
from kvchat.engine.generate import prefill
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.text.chat_format import Conversation
from kvchat.storage import codec
from kvchat.storage.db import RoundRow, Store, now
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.staging import HostToDevice


@dataclass
class StorageFigures:
    model: str
    device: str
    dtype: str
    tokens: int
    rounds: int
    raw_bytes: int
    disk_bytes: int
    plain_zstd_bytes: int
    disk_over_raw: float
    plain_zstd_over_raw: float
    save_seconds: float
    decode_tok_s_alone: float
    decode_tok_s_while_saving: float
    stall_percent: float
    page_cache_dropped: bool
    disk_read_mb_s: float  # the better of the two below: the floor uses it
    disk_read_sequential_mb_s: float
    disk_read_parallel_mb_s: float
    staging_pin_ms: float  # pinning the host-to-GPU staging buffers, once per process (warm-up)
    restore_ms: float
    restore_warm_ms: float
    restore_floor_ms: float
    restore_over_floor: float
    engine_load_s: float


def build_chat(engine: Engine, target_tokens: int) -> tuple[Conversation, list[list[int]]]:
    rounds, system = [], None
    for dlg in dialogues("heldout", 400, 11, 40, 60):
        system = system or dlg.system
        rounds += dlg.rounds
        if len(rounds) * 45 > target_tokens * 1.3:
            break
    spans = engine.chat.round_spans(Conversation(rounds, system))
    total, keep = 0, 0
    for keep, span in enumerate(spans, 1):
        total += len(span)
        if total >= target_tokens:
            break
    return Conversation(rounds[:keep], system), spans[:keep]


def _decode_rate(engine: Engine, cache, steps: int, while_busy: KVWriter | None = None) -> tuple[int, float]:
    """(steps, tokens/s) of greedy decoding: `steps` of them, or while `while_busy` has saves to do (at most
    `steps`)."""
    step = decoder_step(engine.model, cache, cache.length + steps + 2, None)
    token, base, done = 1, cache.length, 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while done < steps and (while_busy is None or while_busy.busy):
        token = int(torch.argmax(step(token)))
        done += 1
    elapsed = time.perf_counter() - t0
    cache.length = base
    return done, done / elapsed


def _stall_percent(engine: Engine, store: Store, sid: str, cache, spans: list[list[int]], max_steps: int,
                   repeats: int = 3) -> tuple[float, float, float]:
    """Decode speed alone and while the writer saves the whole chat (under another fingerprint, so the files are
    new and really written): each "while saving" run lasts as long as the save, the "alone" run beside it decodes
    as many steps, and the median ratio of `repeats` pairs is the stall. Returns (alone, while saving, stall %)."""
    layers = range(engine.config.n_layers)
    _decode_rate(engine, cache, 8)  # warm-up: graph capture
    pairs = []
    for r in range(repeats):
        busy = KVWriter(store, f"{r + 1:x}" * 64)
        start = 0
        for i, span in enumerate(spans):
            kv = cache.read(layers, start, start + len(span))
            busy.submit(sid, 10_000 + i, kv, layers, range(start, start + len(span)))
            start += len(span)
        steps, during = _decode_rate(engine, cache, max_steps, while_busy=busy)
        busy.drain()
        _, alone = _decode_rate(engine, cache, max(steps, 8))
        pairs.append((alone, during))
        with store.transaction() as db:
            files = [row[0] for row in db.execute("SELECT file FROM kv_segments WHERE round_idx >= 10000")]
            db.execute("DELETE FROM kv_segments WHERE round_idx >= 10000")
        store.unlink_files(store.unreferenced(files))
    alone, during = sorted(pairs, key=lambda p: p[1] / p[0])[len(pairs) // 2]
    return alone, during, 100 * (1 - during / alone)


def _disk_read_mb_s(folder: Path, size: int = 1 << 30, threads: int = 16) -> tuple[float, float]:
    """The disk's cold read bandwidth in MB/s, read by one thread in order and by `threads` threads at once
    (interleaved 16 MiB pieces): a disk reaches its bandwidth only with enough requests in flight."""
    path = folder / "bandwidth-probe.bin"
    block = 1 << 24
    data = os.urandom(block)
    with open(path, "wb") as f:
        for _ in range(size // block):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())

    def read(first: int, stride: int) -> None:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(block)
            for offset in range(first * block, size, stride * block):
                f.seek(offset)
                f.readinto(buf)

    rates = []
    for n in (1, threads):
        drop_page_cache()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(read, range(n), [n] * n))
        rates.append(size / (time.perf_counter() - t0) / 1e6)
    path.unlink()
    return rates[0], rates[1]


def bench_storage(model_path: str, device: str | None, target_tokens: int, decode_steps: int = 500,
                  folder: Path | None = None, log=print) -> StorageFigures:
    t0 = time.perf_counter()
    engine = Engine(model_path, device=device)
    load_s = time.perf_counter() - t0
    folder = Path(folder or tempfile.mkdtemp(prefix="kvchat-bench-"))
    store = Store(folder / "home")
    conv, spans = build_chat(engine, min(target_tokens, engine.config.context_length - decode_steps - 8))
    tokens = sum(len(s) for s in spans)
    log(f"chat: {len(spans)} rounds, {tokens} tokens; model loaded in {load_s:.2f} s")
    fp = model_fingerprint(Path(model_path), store)
    sid = store.create_session(title="bench", model_fingerprint=fp, model_path=str(model_path),
                               system_prompt=conv.system)
    cache = engine.new_cache(tokens + decode_steps + 8)
    prefill(engine.model, cache, sum(spans, []))
    layers = range(engine.config.n_layers)
    start = 0
    for i, (r, span) in enumerate(zip(conv.rounds, spans)):
        store.add_round(sid, RoundRow(i, r.user, r.assistant or "", start, start + len(span), now()))
        start += len(span)

    # Save every round's K/V as the app does, and time it.
    writer = KVWriter(store, fp)
    t0 = time.perf_counter()
    start, plain = 0, 0
    for i, span in enumerate(spans):
        kv = cache.read(layers, start, start + len(span))
        writer.submit(sid, i, kv, layers, range(start, start + len(span)))
        raw = kv.cpu().contiguous().view(torch.uint8).numpy().tobytes()  # plain zstd: the comparison
        plain += len(codec.encode(raw, kv.element_size(), "zstd"))
        start += len(span)
    writer.drain()
    save_s = time.perf_counter() - t0
    segs = store.segments(sid)
    raw_bytes, disk_bytes = sum(s["raw_size"] for s in segs), sum(s["byte_size"] for s in segs)
    log(f"saved {disk_bytes / 2**20:.1f} MiB for {raw_bytes / 2**20:.1f} MiB raw ({disk_bytes / raw_bytes:.3f}); "
        f"plain zstd {plain / raw_bytes:.3f}; {save_s:.2f} s")

    alone, during, stall = _stall_percent(engine, store, sid, cache, spans, decode_steps)
    log(f"decode {alone:.1f} tok/s alone, {during:.1f} tok/s while saving the whole chat ({stall:+.1f}% stall, "
        f"median of 3)")

    sequential, parallel = _disk_read_mb_s(folder)
    bandwidth = max(sequential, parallel)
    t0 = time.perf_counter()
    if engine.device.type == "cuda":
        HostToDevice.shared(engine.device)  # pinned once per process: warm-up, like loading the model
    warmup_ms = 1000 * (time.perf_counter() - t0)
    dropped = drop_page_cache()
    chat = ChatSession(store, engine, sid)
    stats = chat.restore()
    warm_ms = statistics.median(ChatSession(store, engine, sid).restore().restore_ms for _ in range(3))
    floor_ms = disk_bytes / (bandwidth * 1e6) * 1000
    log(f"disk reads {sequential:.0f} MB/s cold by one thread, {parallel:.0f} MB/s by 16; restore "
        f"{stats.restore_ms:.0f} ms ({stats.tokens_loaded} loaded, {stats.tokens_recomputed} recomputed) against a "
        f"floor of {floor_ms:.0f} ms (x{stats.restore_ms / floor_ms:.2f}; waiting on reads {stats.wait_ms:.0f} ms); "
        f"{warm_ms:.0f} ms with the files in the page cache; staging buffers pinned in {warmup_ms:.0f} ms at warm-up"
        f"{'' if dropped else '; page cache NOT dropped (not root)'}")
    return StorageFigures(
        model=str(model_path), device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
        tokens=tokens, rounds=len(spans), raw_bytes=raw_bytes, disk_bytes=disk_bytes, plain_zstd_bytes=plain,
        disk_over_raw=disk_bytes / raw_bytes, plain_zstd_over_raw=plain / raw_bytes, save_seconds=save_s,
        decode_tok_s_alone=alone, decode_tok_s_while_saving=during, stall_percent=stall, page_cache_dropped=dropped,
        disk_read_mb_s=bandwidth, disk_read_sequential_mb_s=sequential, disk_read_parallel_mb_s=parallel,
        staging_pin_ms=warmup_ms, restore_ms=stats.restore_ms, restore_warm_ms=warm_ms, restore_floor_ms=floor_ms,
        restore_over_floor=stats.restore_ms / floor_ms, engine_load_s=load_s)


def as_dict(f: StorageFigures) -> dict:
    return asdict(f)
