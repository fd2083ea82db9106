"""How much the share of a budget among the global layers can move the KL at all: fixed shares of the budget per
global layer (e.g. 1:1.5:0.5 for gemma-3-270m's three) beside xkv, uniform and pyramid, in `kvchat eval --text`'s
harness (app/bench/fidelity.py), every policy scoring and selecting alike (engine.policies.budgets).

    python docs/probes/xkv_allocation_grid.py --length 2000 --budget 0.1 --chats 3 --seed 0 \\
        --shares 1.5:1.5:0,2:1:0,1:1.5:0.5,1.5:1:0.5

Prints mean KL, top-1 agreement and the kept share of the window's attention per row (docs/benchmarks.md, "XKV:
the yardstick's own noise").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from torch import Tensor

from kvchat.app.bench.fidelity import text_fidelity
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.budgets import LayerBudgetPolicy
from xkv_fidelity import probe_engine


@dataclass(eq=False)
class FixedShares(LayerBudgetPolicy):
    """The budget shared among the global layers in fixed proportions (first to last), whatever the scores."""

    name = "fixed"
    shares: tuple = (1.0,)

    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        g, n = scores.shape
        if len(self.shares) != g:
            raise SystemExit(f"--shares gives {len(self.shares)} layers' shares, the model has {g} global layers")
        whole = sum(self.shares)
        counts = [min(n, round(total * s / whole)) for s in self.shares]
        counts[max(range(g), key=lambda i: self.shares[i])] += min(total, g * n) - sum(counts)  # rounding settled
        return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--shares", default="", help="comma-separated, each a:b:c (one share per global layer)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path, engine = probe_engine(args.model, args.device)
    b = args.budget
    makers = {f"{p}@{b:g}": (lambda p=p: make_policy(p, engine, budget=b)) for p in ("xkv", "uniform", "pyramid")}
    for spec in filter(None, args.shares.split(",")):
        shares = tuple(float(v) for v in spec.split(":"))
        makers[spec] = lambda shares=shares: FixedShares(budget=b, shares=shares)
    print(f"model {path}  global layers {engine.config.global_layers}  {args.length} tokens, budget {b:g}", flush=True)
    result = text_fidelity(engine, makers, [args.length], args.chats, args.positions, seed=args.seed).as_dict()
    for entry in result["lengths"].values():
        for p in entry["policies"]:
            print(f"  {p['policy']:<14} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  attention kept "
                  f"{p.get('retention', 1):.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
