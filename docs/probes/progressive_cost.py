"""Probe: where LoopServe's progressive decode spends its time (GPU).

After a prefill of `context` tokens of an MT-Bench chat: decode tok/s of the full cache's captured step, of the
progressive step (choices every 16 tokens, pooled), and of the progressive step that never chooses (its lists stay
"everything", so it reads as much as the full cache through the slot-list form of the kernel); and one choice
(`select`) timed alone, as the engine makes it (layers grouped) and one layer at a time (as it did before
2026-11-24). Medians of `--repeats`, JSON lines.

    python docs/probes/progressive_cost.py --shape llama-3.1-8b --cache-dir /tmp/bench-models
(with the package importable as kvchat, as docs/gpu/loopserve.sh sets it up)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvchat.app.bench.engine_speed import model_file
from kvchat.app.bench.loopserve import CHUNK, POOL, chat_tokens
from kvchat.engine.engine import Engine
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.policies.progressive_decode import ProgressiveDecode
from kvchat.engine.timing import sync


def select_per_layer(self: ProgressiveDecode) -> None:
    """The choice as it was made before 2026-11-24: a dozen small operations per layer."""
    cfg = self.model.cfg
    n_win = min(self.n_out, self.interval)
    end = self.cache.length
    ring = [(self.n_out - n_win + i) % self.interval for i in range(n_win)]
    row_slots = torch.arange(end - n_win, end, device=self.chosen.device)
    keys_slots = torch.arange(end, device=self.chosen.device)
    causal = keys_slots[None, :] <= row_slots[:, None]
    reply = torch.ones(end - self.first, dtype=torch.bool, device=self.chosen.device)
    window = self.queries[ring]
    for layer in self.layers:
        q = window[:, layer]
        keys = self.cache.layer(layer)[0, :, :end]
        grouped = q.view(n_win, cfg.n_kv_heads, cfg.n_rep, cfg.head_dim).permute(1, 2, 0, 3)
        scores = (grouped.reshape(cfg.n_kv_heads, -1, cfg.head_dim) @ keys.transpose(1, 2)).float()
        visible = torch.cat([self.candidates[layer], reply])
        mask = (causal & visible[None, :]).repeat(cfg.n_rep, 1)
        scores = scores.mul_(cfg.softmax_scale).masked_fill_(~mask, float("-inf"))
        mass = torch.softmax(scores, dim=-1).sum(1)[:, : self.first]
        if self.pool > 1:
            mass = F.max_pool1d(mass[:, None], self.pool, stride=1, padding=self.pool // 2)[:, 0, : self.first]
        mass = mass.masked_fill(~self.candidates[layer], -1.0)
        n_keep = min(self.budget, self.n_candidates[layer])
        self.write(layer, mass.topk(n_keep, dim=1).indices.to(torch.int32))
    self.selections += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--cache-dir", default="/tmp/bench-models")
    parser.add_argument("--context", default="8192,32768,65536")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="a GGUF file instead of --shape (e.g. to try it on the CPU)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    engine = Engine(args.model or model_file(Path(args.cache_dir), args.shape), device=args.device)
    model, device = engine.model, engine.device

    for context in [int(c) for c in args.context.split(",")]:
        tokens = chat_tokens(engine, context)
        capacity = context + args.tokens + 2
        with torch.inference_mode():
            cache = model.new_cache(capacity)
            for s in range(0, context, CHUNK):
                model(tokens[s : s + CHUNK], cache)

        def rate(make_step) -> float:
            rates = []
            for run in range(args.repeats + 1):
                cache.length = context
                step = make_step()
                token = 1
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.tokens):
                    token = int(torch.argmax(step(token)))
                if run:
                    rates.append(args.tokens / (time.perf_counter() - t0))
            return statistics.median(rates)

        def choice_ms(choose) -> float:
            cache.length = context
            step = ProgressiveDecode(model, cache, context, capacity, pool=POOL)
            token = 1
            for _ in range(15):  # the queries of 15 tokens; the 16th would choose
                token = int(torch.argmax(step(token)))
            times = []
            for _ in range(args.repeats + 2):
                sync(device)
                t0 = time.perf_counter()
                choose(step)
                sync(device)
                times.append(time.perf_counter() - t0)
            return 1000 * statistics.median(times[1:])

        row = {"context": context, "model": args.model or args.shape,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "full_tok_s": rate(lambda: decoder_step(model, cache, capacity, None)),
               "progressive_tok_s": rate(lambda: ProgressiveDecode(model, cache, context, capacity, pool=POOL)),
               "progressive_no_choice_tok_s": rate(
                   lambda: ProgressiveDecode(model, cache, context, capacity, pool=POOL, warmup=10**9)),
               "choice_grouped_ms": choice_ms(ProgressiveDecode.select),
               "choice_per_layer_ms": choice_ms(select_per_layer)}
        print(json.dumps(row))
        sys.stdout.flush()
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
