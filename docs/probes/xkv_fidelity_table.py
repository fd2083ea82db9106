"""One table over many `xkv_fidelity.py --json` files (one chat each, or several): per length and budget, each
policy's mean KL over the chats, how many chats it has the lowest KL of all the rows on, and for each xkv row its
KL against the lower of uniform's and PyramidKV's — over all the chats, and resampled over the chats (2,000 draws
of as many chats with replacement) so that the spread the chats themselves give is printed beside it.

The mean is over every position of every chat, as `kvchat eval --text` pools them (a chat whose reply is shorter
than the positions asked for counts less); `--equal` weighs each chat alike instead. A file of several chats counts
as one chat.

    python docs/probes/xkv_fidelity_table.py results/*.json [--baselines uniform,pyramid] [--equal]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict


def load(paths: list[str]) -> dict[tuple[int, float], dict[str, dict[str, tuple[int, float]]]]:
    """{(length, budget): {policy: {file: (positions, summed KL)}}}: every file's rows, by length and budget."""
    rows: dict = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for length, entry in data["lengths"].items():
            for p in entry["policies"]:
                name, _, budget = p["policy"].rpartition("@")
                if not name or "mean_kl" not in p:
                    continue  # the full cache (no budget) or a policy that refused the model
                rows[(int(length), float(budget))][name][path] = (p["positions"], p["mean_kl"] * p["positions"])
    return rows


def mean_kl(pairs: list[tuple[int, float]], equal: bool = False) -> float:
    """The mean KL over the chats' positions, or (`equal`) the mean of the chats' own means."""
    if equal:
        return sum(kl / max(n, 1) for n, kl in pairs) / max(len(pairs), 1)
    return sum(kl for _, kl in pairs) / max(sum(n for n, _ in pairs), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baselines", default="uniform,pyramid")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--equal", action="store_true", help="each chat weighs alike, whatever its positions")
    args = parser.parse_args()
    baselines = args.baselines.split(",")
    rng = random.Random(0)
    for (length, budget), by_policy in sorted(load(args.files).items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        names = list(by_policy)
        chats = sorted(set.intersection(*(set(v) for v in by_policy.values())))  # the files every row measured
        left_out = sum(len(v) for v in by_policy.values()) - len(chats) * len(names)
        if not chats:
            continue
        rows = {name: [by_policy[name][c] for c in chats] for name in names}
        lowest: dict[str, int] = defaultdict(int)
        for i in range(len(chats)):
            lowest[min(names, key=lambda name: rows[name][i][1] / max(rows[name][i][0], 1))] += 1
        positions = sum(n for n, _ in rows[names[0]])
        note = f"; {left_out} rows of chats not every policy measured left out" if left_out else ""
        print(f"{length} tokens, budget {budget:g}, {len(chats)} chats, {positions} positions{note}:")
        present = [b for b in baselines if b in rows]
        best_baseline = min((mean_kl(rows[b], args.equal) for b in present), default=None)
        for name in names:
            kl = mean_kl(rows[name], args.equal)
            line = f"  {name:<28} KL {kl:.4f}  lowest on {lowest[name]:>2} of {len(chats)}"
            if name not in baselines and best_baseline:
                ratios = []
                for _ in range(args.draws):
                    pick = [rng.randrange(len(chats)) for _ in chats]
                    theirs = min(mean_kl([rows[b][i] for i in pick], args.equal) for b in present)
                    if theirs > 0:
                        ratios.append(mean_kl([rows[name][i] for i in pick], args.equal) / theirs)
                ratios.sort()
                tail = len(ratios) // 20
                below = sum(r < 1 for r in ratios) / max(len(ratios), 1)
                line += (f"  ÷ best baseline {kl / best_baseline:.3f} (chats resampled: 5-95% "
                         f"{ratios[tail]:.3f}-{ratios[len(ratios) - 1 - tail]:.3f}, below in {below:.0%})")
            print(line)


if __name__ == "__main__":
    main()
