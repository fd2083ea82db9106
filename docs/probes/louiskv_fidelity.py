"""LouisKV against its Quest-style baseline and Round Attention's top-k at token budgets, in one run of `kvchat eval
--text`'s harness (app/bench/fidelity.py): the full cache's logits once per chat, every (policy, budget) pair scored
against them. louiskv and quest share sinks (4), buffer (256) and budget, and differ in their units (k-means clusters
of ~16 keys against pages of 16) and in when they choose (at semantic boundaries against every token).

    python docs/probes/louiskv_fidelity.py --model gemma-3-270m --lengths 8000 --chats 2 --json out.json

Prints mean KL, top-1 agreement and, for the retrieval policies, how often the reply chose again (choices per decoded
token) per pair and length (docs/benchmarks.md, "LouisKV"). louiskv's thresholds are the model's calibration (made
and stored on its first use, as a chat's), unless --share names another quantile for this run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvchat.app.bench.fidelity import text_fidelity
from kvchat.app.session.policies import build_policy
from xkv_fidelity import probe_engine  # this folder's: the probes run as scripts from it


def centroids_in_bf16(centroids: torch.Tensor) -> torch.Tensor:
    """Centroids [..., D] as chats stored them before 2026-11-29: rounded to bfloat16, kept as float32."""
    return centroids.to(torch.bfloat16).float()


def keep_centroids_in_bf16() -> None:
    """Every unit built from here on in this process keeps its centroids as `centroids_in_bf16` (in place of the
    8-bit rounding a chat stores them in now, engine.kv.units.in_stored_precision)."""
    from kvchat.engine.kv import units

    units.in_stored_precision = centroids_in_bf16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or gemma-3-270m (default: the embedded model)")
    parser.add_argument("--lengths", default="8000")
    parser.add_argument("--chats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the chats' seed (0: the report chats; 100: development)")
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--budgets", default="1024,2048")
    parser.add_argument("--policies", default="louiskv,quest",
                        help="comma-separated; options after colons: louiskv:tau=1.0:unit_tokens=8")
    parser.add_argument("--share", type=float, default=None,
                        help="louiskv's thresholds at this quantile of the model's r (default: its calibration's)")
    parser.add_argument("--centroids", choices=("bf16", "fp8"), default="fp8",
                        help="the precision louiskv's centroids are kept in: fp8 as a chat stores them, or bf16 as "
                             "chats stored them before 2026-11-29 (fp8: e4m3 with a bfloat16 scale per unit, layer "
                             "and KV head; what storing them in half the bytes costs the choice, issue 44)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.centroids == "bf16":
        keep_centroids_in_bf16()
    path, engine = probe_engine(args.model, args.device)
    tau = None
    if args.share is not None:
        from kvchat.engine.calibrate.retrieval_trigger import calibrate_trigger

        tau = tuple(calibrate_trigger(engine, "probe", share=args.share).tau)
    made: dict[str, list] = {}

    def option_value(text: str):
        """A number where it reads as one (tau=1.0, unit_tokens=8), else the word (prefill=units)."""
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    def maker(spec: str, budget: int):
        """`spec`: a policy name, with options after colons (louiskv:tau=1.0:unit_tokens=8)."""
        name, *given = spec.split(":")
        extra = {k: option_value(v) for k, v in (o.split("=", 1) for o in given)}

        def make():
            options = {"tokens": budget} if name in ("louiskv", "quest") else {}
            if name == "louiskv" and tau is not None:
                options["tau"] = tau
            policy = build_policy(name, engine, **{**options, **extra})
            made.setdefault(label, []).append(policy)
            return policy
        label = f"{spec}@{budget}"
        return label, make

    makers = dict(maker(name, int(b)) for b in args.budgets.split(",") for name in args.policies.split(","))
    print(f"model {path}  device {engine.device}  {args.chats} chats per length (seed {args.seed}), up to "
          f"{args.positions} positions", flush=True)
    every: dict = {}
    for length in [int(x) for x in args.lengths.split(",")]:
        made.clear()
        result = text_fidelity(engine, makers, [length], args.chats, args.positions, seed=args.seed,
                               progress=lambda what, done, total: print(f"\r{done}/{total} {what:<60}", end="",
                                                                         file=sys.stderr, flush=True))
        d = result.as_dict()
        print(file=sys.stderr)
        for length_name, entry in d["lengths"].items():
            print(f"{length_name} tokens (chats of {', '.join(map(str, entry['chat_tokens']))}; "
                  f"{result.seconds:.0f} s):")
            for p in entry["policies"]:
                policies = made.get(p["policy"], [])
                decoded = sum(getattr(x, "decoded", 0) for x in policies)
                rate = (f"  choices {sum(x.selections for x in policies) / decoded:.2f} a token"
                        if decoded else "")
                p["choices_per_token"] = (sum(x.selections for x in policies) / decoded) if decoded else None
                print(f"  {p['policy']:<30} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  ppl {p['ppl']:.3f} "
                      f"(full {p['ppl_full']:.3f}){rate}", flush=True)
        every = {**d, "lengths": {**every.get("lengths", {}), **d["lengths"]}}
        if args.json:
            Path(args.json).write_text(json.dumps(every, indent=2))


if __name__ == "__main__":
    main()
