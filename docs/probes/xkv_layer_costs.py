"""What each global layer's budget costs on its own: one layer keeps the budget's share of its input slots (chosen as
every layer-budget policy chooses: its window and its best-scored slots per KV head), every other layer keeps
everything, in `kvchat eval --text`'s harness. The KL that layer alone adds, and the share of its window's
attention it loses (1 - R_j), give its cost per lost share of attention: what a per-model calibration of XKV's
layer weights would measure (docs/benchmarks.md, "XKV on 46 chats", names it as the next step).

    python docs/probes/xkv_layer_costs.py --model gemma-3-270m --length 2000 --chats 3 --seed 100 --budgets 0.4,0.2,0.1

Prints per budget and layer: the KL, top-1 agreement, the layer's kept share of its window's attention, and the
KL per lost share (KL / (1 - R_j)). With `--added A` the cost is measured where the policy works instead: every layer
at the even share, then each layer in turn given A of it more, its cost the KL that removes over the share of its
window's attention it adds — what engine/calibrate/layer_costs.py now measures for every model on its first xkv use
(and what `xkv-costs:` in docs/probes/xkv_fidelity.py, now XKV's own `costs`, was given by hand).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from torch import Tensor

from kvchat.app.bench.fidelity import text_fidelity
from kvchat.engine.calibrate.layer_costs import OperatingPoint


@dataclass(eq=False)
class OneLayerBudget(OperatingPoint):
    """Global layer number `index` (0 = the first global layer) keeps the budget's even share of its input slots
    and every other global layer keeps all of them; or, with `added` > 0, the calibration's operating point
    (engine.calibrate.layer_costs.OperatingPoint: every layer at the even share, layer `index` `added` of it more)."""

    name = "one-layer"
    index: int = 0
    added: float = 0.0

    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        if self.added:
            return super().allocate(scores, total, shares)
        g, n = scores.shape
        even = min(n, total // g)  # what an even share of the budget gives one layer
        counts = [n] * g
        if self.index >= 0:
            counts[self.index] = even
            self.record(scores[self.index], even, even)
        return counts


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    from xkv_fidelity import probe_engine

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--budgets", default="0.4,0.2,0.1")
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--added", type=float, default=0.0,
                        help="measure at the operating point: every layer at the even share, each layer in turn this "
                             "share of it more (e.g. 0.5); 0: each layer budgeted alone")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path, engine = probe_engine(args.model, args.device, args.fp32)
    layers = engine.config.global_layers
    made: dict[str, list[OneLayerBudget]] = {}

    def maker(name: str, budget: float, index: int):
        def make() -> OneLayerBudget:
            policy = OneLayerBudget(budget=budget, index=index, added=args.added)
            made.setdefault(name, []).append(policy)
            return policy
        return make

    budgets = [float(x) for x in args.budgets.split(",")]
    makers = {f"L{layer}@{b:g}": maker(f"L{layer}@{b:g}", b, j) for b in budgets for j, layer in enumerate(layers)}
    if args.added:
        makers.update({f"even@{b:g}": maker(f"even@{b:g}", b, -1) for b in budgets})
    print(f"model {path}  global layers {layers}  {args.length} tokens, {args.chats} chats from seed {args.seed}"
          + (f", each layer in turn {args.added:g} of the even share more" if args.added else ""), flush=True)
    result = text_fidelity(engine, makers, [args.length], args.chats, args.positions, seed=args.seed).as_dict()
    for entry in result["lengths"].values():
        rows = {p["policy"]: p for p in entry["policies"]}
        for p in entry["policies"]:
            if p["policy"] == "full" or p["policy"].startswith("even@"):
                continue
            policies = made[p["policy"]]
            r = mean([x for policy in policies for x in policy.retained])
            p["layer_retention"] = r
            if args.added:  # the KL the added slots remove, per share of attention they add
                r0 = mean([x for policy in policies for x in policy.retained_even])
                base = rows["even@" + p["policy"].rpartition("@")[2]]["mean_kl"]
                p["cost"] = (base - p["mean_kl"]) / max(r - r0, 1e-9)
                print(f"  {p['policy']:<10} KL {p['mean_kl']:.4f} (all even: {base:.4f})  attention kept {r0:.1%} -> "
                      f"{r:.1%}  KL removed per share added {p['cost']:.4f}", flush=True)
            else:
                p["cost"] = p["mean_kl"] / max(1 - r, 1e-9)
                print(f"  {p['policy']:<10} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  attention kept {r:.1%}  "
                      f"KL per lost share {p['cost']:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
