"""One table over many `xkv_fidelity.py --json` files (one chat each, or several): per length and budget, each
policy's mean KL over all the chats' positions, how many chats it has the lowest KL of all the rows on, and for
each xkv row its KL against the lower of uniform's and PyramidKV's — pooled, and resampled over the chats (2,000
draws of as many chats with replacement) so that the spread the chats themselves give is printed beside it.

    python docs/probes/xkv_fidelity_table.py results/*.json [--baselines uniform,pyramid]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict


def load(paths: list[str]) -> dict[tuple[int, float], dict[str, list[tuple[int, float]]]]:
    """{(length, budget): {policy: [(positions, summed KL) per file]}}: every file's rows, by length and budget."""
    rows: dict = defaultdict(lambda: defaultdict(list))
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for length, entry in data["lengths"].items():
            for p in entry["policies"]:
                name, _, budget = p["policy"].rpartition("@")
                if not name or "mean_kl" not in p:
                    continue  # the full cache (no budget) or a policy that refused the model
                rows[(int(length), float(budget))][name].append((p["positions"], p["mean_kl"] * p["positions"]))
    return rows


def pooled(pairs: list[tuple[int, float]]) -> float:
    return sum(kl for _, kl in pairs) / max(sum(n for n, _ in pairs), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baselines", default="uniform,pyramid")
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args()
    baselines = args.baselines.split(",")
    rng = random.Random(0)
    for (length, budget), by_policy in sorted(load(args.files).items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        names = list(by_policy)
        chats = min(len(v) for v in by_policy.values())
        if any(len(v) != chats for v in by_policy.values()):
            print(f"{length} tokens, budget {budget:g}: policies measured on different chats, skipped")
            continue
        lowest = defaultdict(int)
        for i in range(chats):
            lowest[min(names, key=lambda name: by_policy[name][i][1] / by_policy[name][i][0])] += 1
        print(f"{length} tokens, budget {budget:g}, {chats} chats:")
        best_baseline = min((pooled(by_policy[b]) for b in baselines if b in by_policy), default=None)
        for name in names:
            kl = pooled(by_policy[name])
            line = f"  {name:<28} KL {kl:.4f}  lowest on {lowest[name]:>2} of {chats}"
            if name not in baselines and best_baseline is not None:
                ratios = []
                for _ in range(args.draws):
                    pick = [rng.randrange(chats) for _ in range(chats)]
                    mine = pooled([by_policy[name][i] for i in pick])
                    theirs = min(pooled([by_policy[b][i] for i in pick]) for b in baselines if b in by_policy)
                    ratios.append(mine / theirs if theirs else float("nan"))
                ratios.sort()
                below = sum(r < 1 for r in ratios) / len(ratios)
                line += (f"  ÷ best baseline {kl / best_baseline:.3f} (chats resampled: 5-95% "
                         f"{ratios[len(ratios) // 20]:.3f}-{ratios[-len(ratios) // 20]:.3f}, below in {below:.0%})")
            print(line)


if __name__ == "__main__":
    main()
