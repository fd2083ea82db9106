"""What a lazy resume of a louiskv chat would have to read from disk, if a round's K/V stays one compressed segment
of every layer: the rounds holding any slot louiskv's choices read (issue 44's target, bytes read before the first
token <= 0.15x kv-load's, is then bounded below by their share of the chat).

Each MT-Bench chat (engine/teacher_forcing.text_chats) is prefilled under the full cache, its last message too; then
louiskv's first choice (the last input token's queries, per global layer and KV head: the sinks, the buffer of the
latest slots and `tokens` slots of the best units) and the choices its reply makes as it is teacher-forced. Printed
per chat: the rounds whose slots the first choice reads (and their share of the chat's tokens), the same for every
choice of the reply, and the same with the sinks' and buffer's rounds left out (a lazy resume loads those anyway).

    python docs/probes/louiskv_rounds_touched.py --model gemma-3-270m --lengths 8000 --chats 2 --tokens 1024
"""

from __future__ import annotations

import argparse
import bisect
import json

import torch

from kvchat.engine.teacher_forcing import text_chats
from kvchat.app.session.policies import build_policy
from kvchat.engine.generate import prefill
from xkv_fidelity import probe_engine  # this folder's: the probes run as scripts from it


def touched(chosen: torch.Tensor, base: torch.Tensor, layers: list[int], starts: list[int]) -> set[int]:
    """Rounds holding any input slot the lists of `layers` name."""
    slots = torch.cat([chosen[layer, :, : int(base[layer])].flatten() for layer in layers]).unique().tolist()
    return {bisect.bisect_right(starts, s) - 1 for s in slots}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="8000")
    parser.add_argument("--chats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    _, engine = probe_engine(args.model, args.device)
    model, rows = engine.model, []
    for length in map(int, args.lengths.split(",")):
        for chat in text_chats(engine, length, args.chats, args.positions):
            policy = build_policy("louiskv", engine, tokens=args.tokens)
            cache = model.new_cache(chat.tokens + 8)
            starts = []
            for span in chat.history:
                starts.append(cache.length)
                prefill(model, cache, span)
            policy.visible_slots(cache, starts, chat.prompt, model=model)
            prefill(model, cache, chat.prompt)
            step = policy.decode_step(model, cache, starts[-1] + len(chat.history[-1]), None, chat.tokens + 8, False)
            rounds = [*starts, sum(map(len, chat.history))]  # the message is a round of its own
            sizes = [b - a for a, b in zip(rounds, rounds[1:] + [cache.length])]
            lo, hi = policy.sinks, cache.length - policy.buffer
            always = {bisect.bisect_right(rounds, s) - 1 for s in (*range(min(lo, hi)), *range(max(hi, 0),
                                                                                              cache.length))}
            first = touched(step.chosen, step.base, step.layers, rounds)
            every = set(first)
            for token in chat.reply[:-1]:
                step(token)
                every |= touched(step.chosen, step.base, step.layers, rounds)

            def share(rs: set[int]) -> float:
                return sum(sizes[r] for r in rs) / cache.length

            row = {"chat": chat.name, "tokens": cache.length, "rounds": len(rounds), "budget": args.tokens,
                   "global_layers": len(step.layers), "kv_heads": engine.config.n_kv_heads,
                   "first_rounds": len(first), "first_share": share(first),
                   "first_rounds_beyond_always": len(first - always),
                   "first_share_beyond_always": share(first - always),
                   "always_share": share(always), "reply_rounds": len(every), "reply_share": share(every),
                   "selections": policy.selections, "decoded": policy.decoded}
            rows.append(row)
            print(f"{chat.name}: {row['tokens']:,} tokens, {row['rounds']} rounds; first choice reads "
                  f"{row['first_rounds']} rounds ({row['first_share']:.0%} of the tokens), "
                  f"{row['first_rounds_beyond_always']} beyond the sinks' and buffer's ({row['always_share']:.0%}): "
                  f"{row['first_share_beyond_always']:.0%}; the reply's {row['selections']} choices over "
                  f"{row['decoded']} tokens: {row['reply_rounds']} rounds ({row['reply_share']:.0%})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
