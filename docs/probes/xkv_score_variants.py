"""Other ways of turning the window's attention into a slot's score (issue 43's recall gap at 0.4), each run as
xkv with everything else as shipped: the embedded model's development chats (seed 1, 20 chats, 253 questions) in
policy-comparison mode. The shipped score sums the softmax probabilities over the window's tokens and the KV head's
query heads, then averages them over 15 neighbouring slots (engine.policies.budgets); the variants change one step:

    sum      the shipped score (the probe's own check: it must give what `kvchat eval` gives)
    rowmax   the most any one window token pays a slot, summed over the query heads
    headmax  summed over the window's tokens, the most any one query head of the group pays
    renorm   each window token's probabilities over the input renormalized to 1 (its attention to the window and
             itself left out) before the sum
    lead4    the pooled neighbourhood shifted 4 slots back ([s-11, s+3]): a slot inherits the attention paid to the
             words before it (a value told after its key)
    shared   each layer's pooled score (normalized per KV head) plus the mean of every global layer's: a slot that
             some layers' window finds is kept in the others too
    across   the mean of every global layer's pooled score alone, the same ranking in every layer

    python docs/probes/xkv_score_variants.py rowmax [--budget 0.4]

Prints the variant, the budget and the correct answers of the questions (docs/benchmarks.md, "XKV").
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F

import kvchat.engine.policies.budgets as budgets
from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy
from kvchat.kernels.slot_mass import slot_probabilities_ref

VARIANTS = ("sum", "rowmax", "headmax", "renorm", "lead4", "shared", "across")


def variant_mass(variant: str):
    def mass(q, k, n_input, visible=None, scale=None):
        p = slot_probabilities_ref(q, k, n_input, visible, scale)  # [G, Hkv, rep, T, N]
        if variant == "rowmax":
            return p.amax(3).sum(2)
        if variant == "headmax":
            return p.sum(3).amax(2)
        if variant == "renorm":
            return (p / p.sum(-1, keepdim=True).clamp_min(1e-30)).sum((2, 3))
        return p.sum((2, 3))
    return mass


def lead_pooled(policy, lead: int):
    """`policy.pooled` with its neighbourhood shifted `lead` slots back."""
    def pooled(mass):
        g, h, n = mass.shape
        half = policy.pool // 2
        pad = (half + lead, max(half - lead, 0))
        width = policy.pool if lead <= half else half + lead + 1
        total = F.avg_pool1d(F.pad(mass.reshape(g * h, 1, n), pad), width, stride=1)
        count = F.avg_pool1d(F.pad(mass.new_ones(1, 1, n), pad), width, stride=1)
        return (total / count.clamp_min(1e-9))[..., :n].reshape(g, h, n)
    return pooled


def across_layers(policy, own: float):
    """`policy.pooled`, then each layer's scores (per KV head, normalized to sum to 1) times `own` plus the mean over
    the global layers of those normalized scores."""
    pooled_alone = policy.pooled

    def pooled(mass):
        scores = pooled_alone(mass)  # [G, Hkv, N]
        normalized = scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)
        return own * normalized + normalized.mean((0, 1), keepdim=True)
    return pooled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--budget", type=float, default=0.4)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    budgets.slot_mass = variant_mass(args.variant)
    engine = Engine(DEFAULT_MODEL, device="cpu")
    chats = heldout_chats(args.chats, args.seed, 44, 52, engine, 2000, "heldout")
    policy = make_policy("xkv", engine, budget=args.budget, lookahead=0)  # the window's scores alone
    if args.variant == "lead4":
        policy.pooled = lead_pooled(policy, 4)
    if args.variant in ("shared", "across"):
        policy.pooled = across_layers(policy, 1.0 if args.variant == "shared" else 0.0)
    result = evaluate(engine, policy, chats, mode="compare")
    print(args.variant, args.budget, result.overall.correct, result.overall.questions, flush=True)


if __name__ == "__main__":
    main()
