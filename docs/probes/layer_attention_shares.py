"""How far each layer's attention moves the residual stream over a message's last tokens (QueryTap.attention_shares:
the mean norm of what the attention adds, after Gemma's post-attention norm, over the mean norm of the stream
entering the layer), on MT-Bench chats of the given lengths: what xkv's `layer_weight` weighs its layers by.

    python docs/probes/layer_attention_shares.py --model gemma-3-270m --lengths 2000,8000 --chats 2

Prints one line per chat: its tokens and every layer's share (global layers marked *; docs/benchmarks.md, "XKV:
layers weighed by how far their attention moves the residual stream").
"""

from __future__ import annotations

import argparse

import torch

from kvchat.engine.teacher_forcing import text_chats
from kvchat.engine.model.decoder import QueryTap
from xkv_fidelity import probe_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--chats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path, engine = probe_engine(args.model, args.device)
    m, cfg = engine.model, engine.config
    print(f"model {path}  window {args.window}  (* global layers)")
    for length in [int(x) for x in args.lengths.split(",")]:
        for chat in text_chats(engine, length, args.chats, 1, args.seed):
            tokens = [t for r in chat.history for t in r] + chat.prompt
            cache = m.new_cache(len(tokens) + 1)
            m.query_tap = tap = QueryTap(args.window, norms=True)
            with torch.inference_mode():
                cache.prefill_prompt(m, tokens)
            m.query_tap = None
            shares = tap.attention_shares(list(range(cfg.n_layers)), len(tokens), args.window).tolist()
            marks = " ".join(f"{i}{'*' if i in cfg.global_layers else ''}:{s:.3f}" for i, s in enumerate(shares))
            print(f"{length} {chat.name} {len(tokens)} tokens  {marks}", flush=True)


if __name__ == "__main__":
    main()
