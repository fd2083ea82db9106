"""How much recall any choice of slots by attention can keep at a budget (issue 43's recall target): the embedded
model's development chats in policy-comparison mode, with the budgets chosen from the attention of the *expected
reply's own tokens* (teacher-forced over the full cache, beside the question's last 8) instead of the question's
window alone. That is information no policy has when it chooses; what it keeps bounds what a better score of the
window could keep, for the same selection (per layer and KV head, pooled, a global top-N or an even share).

    python docs/probes/xkv_oracle_recall.py [--chats 20] [--seed 1] [--budget 0.4] [--policies xkv,uniform]

Prints, per policy, recall with the question's window (the policy as shipped) and with the oracle's; JSON last.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.budgets import SCORE_BYTES, prefill_window
from kvchat.engine.policies.progressive_decode import layer_groups
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.kernels.slot_mass import slot_mass


@dataclass
class ExpectedReplies:
    """The chat's expected reply to each user message (set per chat), and the conversation a prompt was opened in
    (recorded by wrapping the chat format's open_round_tokens)."""

    replies: dict
    last: tuple | None = None


def oracle(policy, engine: Engine, expected: ExpectedReplies):
    """`policy` scoring its window followed by the expected reply's tokens (teacher-forced, then taken back)."""
    chat = engine.chat

    def answer_tokens(prompt: list[int]) -> list[int]:
        conv, user = expected.last
        closed = chat.round_spans(Conversation([*conv.rounds, Round(user, expected.replies[user])], conv.system))[-1]
        return closed[len(prompt):] if closed[: len(prompt)] == prompt else []

    prompts: list = []
    real_visible = policy.visible_slots

    def visible_slots(cache, round_starts, new_tokens, model=None):
        prompts[:] = [list(new_tokens)]
        return real_visible(cache, round_starts, new_tokens, model=model)

    @torch.inference_mode()
    def scores(model_, cache, layers, tokens, after=0):
        cfg, first, n_win = model_.cfg, cache.length, len(tokens)
        window, shares = prefill_window(model_, cache, layers, tokens, after)  # [L, T, H, D], [G]
        answer = answer_tokens(prompts[0]) if prompts else []
        queries = window
        if answer:
            got: list = []
            model_.run_layers(model_.embed(torch.tensor(answer)), torch.arange(first, first + len(answer)), cache,
                              first, queries=got)
            more = torch.stack([q.reshape(len(answer), cfg.n_heads, cfg.head_dim) for q in got])
            queries = torch.cat([window, more.to(window.dtype)], 1)
        end = first + len(answer)
        out = []
        for group, at in layer_groups(model_, cache, layers, cfg.n_heads * queries.shape[1] * end * 4, SCORE_BYTES):
            keys = cache.keys_of(group, end)
            out.append(slot_mass(queries[at], keys, first - n_win, None, cfg.softmax_scale))
        cache.truncate(first)
        return policy.pooled(torch.cat(out)), shares

    policy.visible_slots = visible_slots
    policy._scores = scores
    return policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.4)
    ap.add_argument("--policies", default="xkv,uniform")
    ap.add_argument("--runs", default="full,window,oracle")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine(DEFAULT_MODEL, device="cpu")
    chats = heldout_chats(args.chats, args.seed, 44, 52, engine, 2000, "heldout")  # the eval command's defaults
    expected = ExpectedReplies({})
    real_open = engine.chat.open_round_tokens

    def open_round_tokens(conv, user):
        expected.last = (conv, user)
        return real_open(conv, user)

    engine.chat.open_round_tokens = open_round_tokens
    out = {"chats": args.chats, "seed": args.seed, "budget": args.budget, "runs": {}}
    runs = args.runs.split(",")
    for name in ["full"] if "full" in runs else []:
        r = evaluate(engine, make_policy("full", engine), chats, mode="compare")
        out["runs"]["full"] = [r.overall.correct, r.overall.questions]
        print(f"full cache: {r.overall.correct}/{r.overall.questions} ({r.overall.accuracy:.1%})", flush=True)
    for name in args.policies.split(","):
        for how in [h for h in ("window", "oracle") if h in runs]:
            correct = total = 0
            for dlg in chats:  # one chat at a time: its expected replies by user message
                expected.replies = {r.user: r.assistant for r in dlg.rounds}
                # the window's choice (no look-ahead: what the oracle bounds, as measured on 2026-11-27/28)
                policy = make_policy(name, engine, budget=args.budget, lookahead=0)
                if how == "oracle":
                    oracle(policy, engine, expected)
                r = evaluate(engine, policy, [dlg], mode="compare")
                correct, total = correct + r.overall.correct, total + r.overall.questions
            out["runs"][f"{name}-{how}"] = [correct, total]
            print(f"{name} at {args.budget:g}, chosen by the {how}: {correct}/{total} ({correct / total:.1%})",
                  flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
