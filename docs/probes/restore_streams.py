"""Probe: what running the recompute stream and the load stream at once costs each of them (GPU).

On a chat stored by `kvchat bench` (its --work-dir), for a few flat splits k: the recompute of the first k rounds
alone (PrefixRecompute), the restore that loads everything (kv-load), and the restore that recomputes the first k
rounds while loading the rest, with the loader threads at normal priority and below it. Each timed 3 times after a
warm-up; the medians are printed as JSON lines.

    python docs/probes/restore_streams.py --home WORK/llama-3.1-8b/home --model MODEL.gguf
(with the package importable as kvchat, as docs/gpu/bench-resume.sh sets it up)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kvchat.app.session.chat import ChatSession
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.engine.engine import Engine
from kvchat.engine.restore.recompute import PrefixRecompute, PyramidStep
from kvchat.engine.restore.plan import fixed_plan
from kvchat.storage import prefetch
from kvchat.storage.db import Store


def median_of(runs: int, fn) -> dict:
    results = [fn() for _ in range(runs)]
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def bench_chats(home: str, model: str, device: str) -> tuple[Engine, Store, list[dict]]:
    """The engine, the store in `home` and the chats `kvchat bench` stored there, shortest first."""
    store = Store(Path(home))
    chats = sorted((s for s in store.sessions() if s["title"].startswith("bench ")), key=lambda s: s["n_rounds"])
    return Engine(model, device=device), store, chats


def bench_chat_runs(engine: Engine, store: Store, info: dict):
    """For a chat `kvchat bench` stored: (recompute_alone(k), restore(k)): the first k rounds recomputed alone on
    the recompute stream, and the chat restored with its first k rounds recomputed (k None: everything loaded);
    each returns its figures in ms."""
    sid, rounds = info["id"], store.rounds(info["id"])
    layers = range(engine.config.n_layers)

    def recompute_alone(k: int) -> dict:
        conv = Conversation([Round(r.user_text, r.assistant_text) for r in rounds[:k]], info["system_prompt"])
        tokens = engine.chat.conversation_tokens(conv)
        cache = engine.new_cache(len(tokens) + 8)
        run = PrefixRecompute(engine.model, tokens, [PyramidStep(layers, len(tokens), cache)]).run()
        return {"busy_ms": 1000 * run.busy_s, "launched_ms": 1000 * run.launched_s}

    def restore(k: int | None) -> dict:
        planner = None if k is None else (lambda r, g, b: fixed_plan(r, g, (k,) * len(g)))
        session = ChatSession(store, engine, sid, planner=planner)
        st = session.restore()
        session.close()
        return {"restore_ms": st.restore_ms, "compute_ms": st.compute_ms, "launch_ms": st.compute_launch_ms,
                "load_ms": st.load_ms, "gap_ms": st.gap_ms}

    return recompute_alone, restore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine, store, chats = bench_chats(args.home, args.model, args.device)
    for info in chats:
        rounds = store.rounds(info["id"])
        n = len(rounds)

        recompute_alone, restore = bench_chat_runs(engine, store, info)

        restore(None), restore(n // 2), recompute_alone(n // 2)  # warm-up
        out = {"tokens": rounds[-1].token_end, "rounds": n, "kv_load": median_of(args.runs, lambda: restore(None))}
        for k in (n // 4, n // 2):
            row = {"k": k, "tokens": rounds[k - 1].token_end, "alone": median_of(args.runs, lambda: recompute_alone(k))}
            for nice in (0, prefetch.NICE or 5):
                prefetch.NICE = nice
                row[f"split_nice{nice}"] = median_of(args.runs, lambda: restore(k))
            out[f"k{k}"] = row
        print(json.dumps(out))
        sys.stdout.flush()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
