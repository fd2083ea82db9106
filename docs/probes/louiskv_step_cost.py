"""What a louiskv decode step costs beyond the bytes it reads (issue 44's decode target): on one chat, the full
cache's step against louiskv's at the same budget, choosing (a) once after the prefill and never again (tau = -1:
the slot-list step alone), (b) at its boundaries (tau per global layer at the 0.25-quantile of this chat's own r,
as `kvchat calibrate` sets it), (c) after every token in every layer (tau = 1), (d) at its boundaries in the step
(`instep=1`: each layer with its token's own query, so every layer scores and ranks its units at every token), (e)
Quest's pages in the step likewise; and one choice timed alone (made
eagerly for every global layer, and for one; and as the decode makes it on a CUDA graph: the choice's replay).
The byte bound counts the weights as placed and the K/V the lists name; the time bound, the full step's time less
the share of its K/V time (its time above the full step's at 256 tokens) that the lists leave unread.

    python docs/probes/louiskv_step_cost.py MODEL.gguf [--context 32768] [--tokens 1024] [--repeats 3]

A chat of MT-Bench rounds in the model's template (as `kvchat bench xkv`), its round starts the policy's; JSON to
stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvchat.app.bench.loopserve import CHUNK, decode_rates
from kvchat.app.bench.xkv import FLOOR_CONTEXT, kv_bytes_read, step_floor_rate, time_bound, weight_bytes
from kvchat.engine.data.workloads import mt_bench_workload
from kvchat.engine.engine import Engine
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.louiskv import query_similarity


def chat(engine: Engine, context: int) -> tuple[torch.Tensor, list[int]]:
    work = mt_bench_workload(engine.chat, f"louiskv-{context}", seed=0, target=context + 512)
    tokens, starts = [], []
    for span in engine.chat.round_spans(work.conversation):
        if len(tokens) >= context:
            break
        starts.append(len(tokens))
        tokens += span
    return torch.tensor(tokens[:context]), starts


def timed(fn, device, n: int) -> float:
    """Median seconds of `n` calls of fn."""
    out = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    engine = Engine(args.model, device=args.device)
    model, device, cfg = engine.model, engine.device, engine.config
    tokens, starts = chat(engine, args.context)
    context, n = len(tokens), args.decode_tokens
    capacity = context + n + 2
    cache = model.new_cache(capacity)
    for s in range(0, context, CHUNK):
        model(tokens[s : s + CHUNK], cache)
    weights = weight_bytes(engine)
    full_kv = kv_bytes_read(engine, [context] * cfg.n_layers, n // 2)
    out: dict = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "context": context, "rounds": len(starts), "tokens": args.tokens, "weight_bytes": weights,
                 "full": decode_rates(cache, context, lambda: decoder_step(model, cache, capacity, None), device,
                                      args.repeats, n)}
    out["floor"] = step_floor_rate(engine, tokens, args.repeats, n)
    print(f"full cache: {statistics.median(out['full']):.1f} tok/s; at {FLOOR_CONTEXT} tokens {out['floor']:.1f} "
          f"tok/s", flush=True)
    last = [int(tokens[-1])]
    history = starts[:-1] if starts and starts[-1] == context else starts

    def louiskv(tau, keep: list | None = None, record: list | None = None, name: str = "louiskv", instep: int = 0):
        options = {"tau": tau} if name == "louiskv" else {}
        policy = make_policy(name, engine, tokens=args.tokens, instep=instep, **options)
        # with `record`: every layer's r at every token (tau = 1 chooses everywhere, so all are seen), read back
        # on the host, so not in a CUDA graph
        if record is not None:
            boundary = policy.boundary
            policy.boundary = lambda prev, cur: (record.append(query_similarity(prev, cur).float().cpu()),
                                                 boundary(prev, cur))[1]

        def make():
            cache.length = context
            policy.visible_slots(cache, history, last)
            step = policy.decode_step(model, cache, context - 1, None, capacity, False if record is not None else None)
            if keep is not None:
                keep[:] = [step]
            return step
        return policy, make

    r_values: list = []
    n_global = len(cfg.global_layers)
    policy, make = louiskv(1.0, record=r_values)
    decode_rates(cache, context, make, device, 0, n)  # one run, to see this chat's r per layer
    r = torch.stack(r_values)  # [tokens, G]
    taus = [float(t) for t in r.quantile(0.25, dim=0)]
    out["r_quantile_0.25"] = taus
    keep: list = []
    at_boundaries = tuple(taus) if n_global > 1 else taus[0]
    # (in step: each layer chooses with its token's own query inside the step, every layer at every token, kept
    # where its trigger did not fire; quest's pages likewise, its trigger firing always)
    for label, tau, name, instep in (("once", -1.0, "louiskv", 0), ("boundaries", at_boundaries, "louiskv", 0),
                                     ("every", 1.0, "louiskv", 0), ("in_step", at_boundaries, "louiskv", 1),
                                     ("quest_in_step", None, "quest", 1)):
        policy, make = louiskv(tau, keep, name=name, instep=instep)
        rates = decode_rates(cache, context, make, device, args.repeats, n)
        step = keep[0]
        per_slot_reads = [args.tokens + len(step.always[0, 0])] * n_global
        kept = [per_slot_reads[cfg.global_layers.index(i)] if i in cfg.global_layers else min(context, cfg.window(i))
                for i in range(cfg.n_layers)]
        read = weights + kv_bytes_read(engine, kept, n // 2)
        full_rate = statistics.median(out["full"])
        row = {"tok_s": rates, "choices_per_token": policy.selections / max(policy.decoded, 1),
               "bytes_per_token": read, "bound": (weights + full_kv) / read,
               "speedup": statistics.median(rates) / full_rate}
        row["share_of_bound"] = row["speedup"] / row["bound"]
        row["time_bound"] = time_bound(full_rate, out["floor"], read - weights, full_kv)
        row["share_of_time_bound"] = row["speedup"] / row["time_bound"]
        out[label] = row
        print(f"{name}, choosing {label}: {statistics.median(rates):.1f} tok/s ({min(rates):.1f}-{max(rates):.1f}); "
              f"{row['choices_per_token']:.2f} choices a token; {row['speedup']:.2f}x of the byte bound's "
              f"{row['bound']:.2f}x ({row['share_of_bound']:.0%}), of the time bound's {row['time_bound']:.2f}x "
              f"({row['share_of_time_bound']:.0%})", flush=True)
    policy, make = louiskv(at_boundaries, keep)
    make()
    step = keep[0]
    every = torch.ones(n_global, dtype=torch.bool)
    one = torch.zeros(n_global, dtype=torch.bool)
    one[0] = True
    out["select_all_ms"] = 1e3 * timed(lambda: step.select(step.previous, every), device, 20)
    out["select_one_ms"] = 1e3 * timed(lambda: step.select(step.previous, one), device, 20)
    out["choice_replay_ms"] = 1e3 * timed(step._choice, device, 20)  # every layer, fixed shapes (a graph on CUDA)
    out["units_per_layer_head"] = int(step.summary.shape[2])
    print(f"one choice made eagerly: every global layer {out['select_all_ms']:.2f} ms, one layer "
          f"{out['select_one_ms']:.2f} ms; the choice's replay (every layer) {out['choice_replay_ms']:.3f} ms; "
          f"{out['units_per_layer_head']} units a layer and KV head", flush=True)
    keep.clear()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
