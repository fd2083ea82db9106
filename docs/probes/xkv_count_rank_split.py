"""Which part of xkv's choice loses answers (issue 43): each layer's count (XKV's allocation) or the ranking of slots
within it. On the development chats in policy-comparison mode at budget 0.4, each choice takes its counts from one
score and its ranking from the other: the message's window's (the policy as shipped before its look-ahead) or the
oracle's (xkv_oracle_recall.py: the expected reply's own attention beside the window's).

    python docs/probes/xkv_count_rank_split.py window oracle [--chats 20]   # counts from the window, ranks oracle's
    python docs/probes/xkv_count_rank_split.py oracle window [--chats 20]

Prints the running count of correct answers after each chat (docs/benchmarks.md, "XKV looking ahead": 36 against 28
of the first 61 questions); JSON last.
"""

from __future__ import annotations

import argparse
import json

import torch

import xkv_oracle_recall as oracle_probe
from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("counts_from", choices=["window", "oracle"])
    ap.add_argument("ranks_from", choices=["window", "oracle"])
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--budget", type=float, default=0.4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine(DEFAULT_MODEL, device="cpu")
    chats = heldout_chats(args.chats, 1, 44, 52, engine, 2000, "heldout")  # the eval command's defaults, seed 1
    expected = oracle_probe.ExpectedReplies({})
    real_open = engine.chat.open_round_tokens

    def open_round_tokens(conv, user):
        expected.last = (conv, user)
        return real_open(conv, user)

    engine.chat.open_round_tokens = open_round_tokens
    correct = total = 0
    for dlg in chats:
        expected.replies = {r.user: r.assistant for r in dlg.rounds}
        # the window's choice alone, and the oracle's scores beside it: lookahead=0, or the reply's step would choose
        # through choose_looking_ahead and never call the `choose` replaced below
        window = make_policy("xkv", engine, budget=args.budget, lookahead=0)
        oracle = oracle_probe.oracle(make_policy("xkv", engine, budget=args.budget, lookahead=0), engine, expected)
        window_scores = type(window)._scores.__get__(window)
        window_visible = window.visible_slots

        def visible_slots(cache, round_starts, new_tokens, model=None, oracle=oracle, window_visible=window_visible):
            oracle.visible_slots(cache, round_starts, new_tokens, model=None)  # the oracle's prompt, recorded
            return window_visible(cache, round_starts, new_tokens, model=model)

        def choose(model, cache, window=window, oracle=oracle, window_scores=window_scores):
            cfg, first = model.cfg, cache.length
            n_win = min(len(window._window_tokens), first)
            if not window.scores_needed(cfg, first, n_win):
                return window.keep_everything(cfg, first)
            tokens = window._window_tokens[-n_win:]
            # each (pooled scores [G, Hkv, N], the layers' attention shares [G])
            scores = {"window": window_scores(model, cache, cfg.global_layers, tokens, 0),
                      "oracle": oracle._scores(model, cache, cfg.global_layers, tokens, 0)}
            shares = scores["window"][1]
            scores = {k: v[0] for k, v in scores.items()}
            per_layer = scores[args.counts_from].sum(1)
            per_layer = per_layer / per_layer.sum(1, keepdim=True).clamp_min(1e-30)
            counts = window.allocate(per_layer, len(cfg.global_layers) * (window.kept_per_layer(first) - n_win),
                                     shares)
            allocate = window.allocate
            window.allocate = lambda _scores, _total, _shares=None: counts  # the counts given; ranked by the scores
            try:
                return type(window).choice_from_scores(window, cfg, scores[args.ranks_from], first, n_win)
            finally:
                window.allocate = allocate

        window.visible_slots, window.choose = visible_slots, choose
        r = evaluate(engine, window, [dlg], mode="compare")
        correct, total = correct + r.overall.correct, total + r.overall.questions
        print(f"counts from the {args.counts_from}, ranks from the {args.ranks_from}: {correct}/{total}", flush=True)
    print(json.dumps({"counts": args.counts_from, "ranks": args.ranks_from, "correct": correct, "total": total}))


if __name__ == "__main__":
    main()
