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

    python docs/probes/xkv_score_variants.py rowmax [--budget 0.4]

Prints the variant, the budget and the correct answers of the questions (docs/benchmarks.md, "XKV").
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import kvchat.engine.policies.budgets as budgets
from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy

VARIANTS = ("sum", "rowmax", "headmax", "renorm", "lead4")


def window_probabilities(q, k, n_input: int, scale: float | None):
    """q [G, T, H, D], k [G, Hkv, S, D] -> softmax probabilities [G, Hkv, rep, T, n_input] (causal), as
    kernels/slot_mass.py's reference computes them before its sum."""
    n_layers, n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    rep = n_heads // n_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped = q.view(n_layers, n_tokens, n_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4)
    scores = grouped.reshape(n_layers, n_kv_heads, rep * n_tokens, head_dim).float() @ k.float().transpose(2, 3)
    scores = scores.view(n_layers, n_kv_heads, rep, n_tokens, n_keys) * scale
    seen = torch.arange(n_keys)[None, :] <= (n_keys - n_tokens + torch.arange(n_tokens))[:, None]
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)[..., :n_input]


def variant_mass(variant: str):
    def mass(q, k, n_input, visible=None, scale=None):
        p = window_probabilities(q, k, n_input, scale)
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
    policy = make_policy("xkv", engine, budget=args.budget)
    if args.variant == "lead4":
        policy.pooled = lead_pooled(policy, 4)
    result = evaluate(engine, policy, chats, mode="compare")
    print(args.variant, args.budget, result.overall.correct, result.overall.questions, flush=True)


if __name__ == "__main__":
    main()
