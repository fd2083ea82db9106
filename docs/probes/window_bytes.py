"""Bytes on disk per token of a long chat with sliding-window layers (Gemma 3), stored as the app stores it
(trimmed: those layers only where a later round can still read them) and with every layer of every token.

    python docs/probes/window_bytes.py gemma-3-270m 30000 cuda > window-bytes.json

Each chat is an MT-Bench chat (engine.data.workloads) inserted as text, reopened, recomputed and stored by
ChatSession, once per setting; prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from kvchat.app.session.chat import ChatSession
from kvchat.engine.engine import Engine
from kvchat.engine.data.workloads import mt_bench_workload
from kvchat.storage.db import SEGMENT_KV, RoundRow, Store, now
from kvchat.storage.fingerprint import model_fingerprint
from kvchat.storage.known_models import resolve_model


def stored_bytes(engine: Engine, conv, spans, folder: Path, trim: bool) -> tuple[int, float]:
    store = Store(folder)
    rows, start = [], 0
    for i, (r, span) in enumerate(zip(conv.rounds, spans)):
        rows.append(RoundRow(i, r.user, r.assistant or "", start, start + len(span), now()))
        start += len(span)
    sid = store.insert_session(title="bytes", model_fingerprint=model_fingerprint(Path(engine.path), store),
                               model_path=engine.path, system_prompt=conv.system, settings={}, rounds=rows,
                               segments=[])
    t0 = time.perf_counter()
    chat = ChatSession(store, engine, sid, trim_windows=trim)
    chat.restore()
    chat.store_all()
    chat.close()
    seconds = time.perf_counter() - t0
    if chat.writer.errors:
        raise SystemExit(f"storing failed: {chat.writer.errors[0]}")
    return sum(s["byte_size"] for s in store.segments(sid) if s["kind"] == SEGMENT_KV), seconds


def main(model: str, tokens: int, device: str) -> None:
    engine = Engine(resolve_model(model), device=device)
    cfg = engine.config
    work = mt_bench_workload(engine.chat, "bytes", target=tokens)
    spans = engine.chat.round_spans(work.conversation)
    n = sum(map(len, spans))
    with tempfile.TemporaryDirectory() as tmp:
        whole, whole_s = stored_bytes(engine, work.conversation, spans, Path(tmp) / "whole", trim=False)
        trimmed, trimmed_s = stored_bytes(engine, work.conversation, spans, Path(tmp) / "trimmed", trim=True)
    print(json.dumps({
        "model": model, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "tokens": n, "rounds": work.rounds, "layers": cfg.n_layers, "global_layers": len(cfg.global_layers),
        "window": cfg.sliding_window, "raw_bytes_per_token": cfg.kv_bytes_per_token(engine.dtype.itemsize),
        "every_layer_bytes": whole, "trimmed_bytes": trimmed, "ratio": round(trimmed / whole, 4),
        "every_layer_bytes_per_token": round(whole / n, 1), "trimmed_bytes_per_token": round(trimmed / n, 1),
        "seconds": [round(whole_s, 1), round(trimmed_s, 1)],
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cpu")
