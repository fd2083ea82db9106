"""XKV's layer costs, per model (engine.policies.xkv's `costs`): what losing a share of each global layer's
attention costs the next-token distribution, at each of a few budgets.

The paper's allocation (XKV, Alg. 1) maximizes the mean retention over the layers, as if a share of any layer's
attention were worth as much as a share of any other's. It is not: on gemma-3-270m at 2k tokens and budget 0.4,
giving the first global layer half as much again of its even share removes 90% of the KL all three layers' budgets
add, the last layer's almost none (docs/benchmarks.md, "XKV with each layer's cost measured"). So each layer's cost
is measured where the policy works, and the top-N weighs each layer's normalized scores by it (it then minimizes
sum_j c_j (1 - R_j)).

How, per budget b in BUDGETS: every global layer keeps the even share of b (the `even` run), then each layer j in
turn keeps the even share and ADDED of it more (the others the even share); c_j(b) = (KL_even - KL_j) / (R_j -
R_j,even), the KL the added slots remove per share of the layer's window attention they add (KL: mean over the
teacher-forced reply positions of all chats, against the full cache; R: the layer's kept share of its pooled window
scores, averaged over the chats). Measured differences are small where a layer matters little and the KL of a few
positions can outweigh them (gemma-3-270m's costs at 0.1, measured twice on the same three chats with slightly
different numerics, came out 1.34 : 1.46 : 1 and 2.7 : 1 : 1): so each cost is drawn toward the budget's mean as far
as its standard error over the positions says it may be noise (`shrunk`), then floored at FLOOR of the budget's
largest (and where none is positive, all are equal: the paper's weights). The
choice is XKV's own (window, pooling, look-ahead) with the whole reply decoded over it (`keep_ahead=False`: a short
reply would otherwise be decoded over the full cache and show no cost at all); its look-ahead reaches as far as the
teacher-forced reply does (16 tokens, or fewer for a shorter reply: the embedded model's average ~10). The standard
error counts every position as independent, which they are not (a chat's positions share one choice): it is a lower
bound, and the shrinkage as light as the data allow, not more.

The chats: any model's, MT-Bench chats of about 2,000 tokens (within half its context) with their reference answers,
from seed 100 — the material gemma-3-270m's costs were measured on and then checked against on 26 new chats at 2k,
8k and 24k; the embedded model's, its own held-out memory dialogues (engine.calibrate.watershed's chats) with its
greedy replies. Each chat's history is read once for all of its runs.

Nothing here reads or writes a file: app/session/artifacts.py keeps one per model fingerprint, and
app/session/policies.py makes it on a model's first use of xkv and hands the costs to the policy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import Tensor

from kvchat.engine.calibrate.watershed import ProgressCallback, calibration_chats, is_embedded_model, reference_reply
from kvchat.engine.policies.budgets import LayerBudgetPolicy
from kvchat.engine.teacher_forcing import TextChat, forced_logits, history_cache, position_kl, text_chats
from kvchat.errors import KvchatError

# Bumped when what is measured changes: files of another version are measured again, not trusted.
LAYER_COSTS_VERSION = 1
BUDGETS = (0.4, 0.2, 0.1)  # where the costs are measured; the policy interpolates between them (xkv.costs_at)
ADDED = 0.5  # of the even share, given to one layer at a time
FLOOR = 0.01  # of the budget's largest cost: the least a layer's cost is taken to be
SHRINK_Z = 2.0  # standard errors within which a cost is not told from the budget's mean (`shrunk`)
TEXT_TOKENS, TEXT_CHATS, TEXT_SEED, TEXT_POSITIONS = 2000, 3, 100, 128
DIALOGUE_CHATS = 144  # the embedded model's replies are a few tokens each: 16 or 48 dialogues left its costs to noise


@dataclass(eq=False)
class OperatingPoint(LayerBudgetPolicy):
    """Every global layer at the even share of the budget, and global layer number `index` (0: the first; -1: none)
    `added` of it more; records that layer's R at its count and at the even share, per choice."""

    name = "layer-cost-point"
    index: int = -1
    added: float = ADDED
    retained: list = field(default_factory=list)
    retained_even: list = field(default_factory=list)

    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        g, n = scores.shape
        even = min(n, total // g)
        counts = [even] * g
        if self.index >= 0:
            counts[self.index] = min(n, even + round(self.added * even))
            self.record(scores[self.index], counts[self.index], even)
        return counts

    def record(self, row: Tensor, count: int, even: int) -> None:
        """Layer `index`'s R (its kept share of its normalized scores `row`) at `count` slots and at `even`."""
        ranked = row.sort(descending=True).values.cumsum(0)
        whole = float(ranked[-1]) or 1e-30
        self.retained.append(float(ranked[count - 1]) / whole if count else 0.0)
        self.retained_even.append(float(ranked[even - 1]) / whole if even else 0.0)


@dataclass
class LayerCostCalibration:
    fingerprint: str
    model_name: str
    n_layers: int
    layers: list[int]  # the global layers (sliding-window layers are outside the budget)
    budgets: list[float]
    costs: list[list[float]]  # per budget, per global layer: KL removed per share of attention added (floored)
    measured: list[list[float]]  # the same as measured (may be <= 0 where noise outweighs a layer's effect)
    errors: list[list[float]]  # their standard errors (over the positions)
    kl_even: list[float]  # per budget: the mean KL with every layer at the even share
    chats: int
    positions: int  # teacher-forced reply positions, all chats
    source: str  # "memory-dialogues" | "mt_bench"
    date: str
    version: int = LAYER_COSTS_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "LayerCostCalibration":
        """The calibration as stored; ValueError, TypeError or AttributeError when it does not hold together."""
        cal = cls(**raw)
        if len(cal.costs) != len(cal.budgets) or not cal.budgets or not all(0 < b <= 1 for b in cal.budgets):
            raise ValueError("a row of costs per budget in (0, 1]")
        if not all(len(row) == len(cal.layers) and all(isinstance(c, (int, float)) and c > 0 for c in row)
                   for row in cal.costs):
            raise ValueError("a positive cost per global layer")
        if not all(isinstance(i, int) and 0 <= i < cal.n_layers for i in cal.layers):
            raise ValueError("global layers of the model")
        return cal

    def spec(self) -> str:
        """The costs as engine.policies.xkv.XKV takes them: "0.4=a/b/c;0.2=...". """
        return ";".join(f"{b:g}=" + "/".join(f"{c:.6g}" for c in row) for b, row in zip(self.budgets, self.costs))


def shrunk(costs: list[float], errors: list[float], z: float = SHRINK_Z) -> list[float]:
    """Each cost drawn toward the budget's mean cost as far as its standard error says it may be noise: one that
    differs from the mean by d, with standard error s, keeps the share max(0, 1 - (z s / d)^2) of d (none within z
    standard errors of the mean; nearly all far beyond them)."""
    measured = [c for c, e in zip(costs, errors) if math.isfinite(e)]  # a layer whose share could not grow: no cost
    mean = sum(measured) / len(measured) if measured else 0.0
    out = []
    for cost, error in zip(costs, errors):
        d = cost - mean
        out.append(mean + d * max(0.0, 1 - (z * error / d) ** 2) if d and math.isfinite(error) else mean)
    return out


def calibration_text_chats(engine, count: int | None = None) -> tuple[str, list[TextChat]]:
    """(source, chats): the embedded model's memory dialogues with its greedy replies; MT-Bench otherwise. `count`
    chats (default: DIALOGUE_CHATS dialogues, TEXT_CHATS MT-Bench chats)."""
    if is_embedded_model(engine):
        source, pairs = calibration_chats(engine, count or DIALOGUE_CHATS)
        chats = []
        for n, (conversation, message) in enumerate(pairs):
            ref = reference_reply(engine, conversation, message)
            if ref.reply:
                chats.append(TextChat(f"dialogue-{n}", ref.history, ref.prompt, ref.reply))
        return source, chats
    length = min(TEXT_TOKENS, engine.config.context_length // 2)
    return "mt_bench", text_chats(engine, length, count or TEXT_CHATS, TEXT_POSITIONS, seed=TEXT_SEED)


@torch.inference_mode()
def calibrate_layer_costs(engine, fingerprint: str, chats: int | None = None,
                          progress: ProgressCallback | None = None) -> LayerCostCalibration:
    """Measure each global layer's cost at each of BUDGETS on `chats` calibration chats (default: the source's own
    count; not stored: see app.session.policies; `fingerprint` only labels it). Progress counts runs: per chat the
    full cache, then per budget the even run and one per layer."""
    from kvchat.engine.policies.full import FullKV

    cfg = engine.config
    layers = list(cfg.global_layers)
    if not layers:
        raise KvchatError("this model has no global layers: every layer keeps its window, there is nothing to budget")
    source, material = calibration_text_chats(engine, chats)
    if not material:
        raise KvchatError("the model gave no reply to any calibration chat: its layer costs cannot be measured")
    g = len(layers)
    total_runs, done = len(material) * (1 + len(BUDGETS) * (g + 1)), 0
    kl = {(b, j): [] for b in BUDGETS for j in range(-1, g)}  # per (budget, layer or -1): KL per position
    retained = {(b, j): ([], []) for b in BUDGETS for j in range(g)}  # R at the count and at the even share
    for chat in material:
        read = history_cache(engine, chat)
        ref = forced_logits(engine, FullKV(), chat, read)
        done += 1
        if progress is not None:
            progress(done, total_runs)
        for b in BUDGETS:
            for j in range(-1, g):
                policy = OperatingPoint(budget=b, index=j, keep_ahead=False)
                kl[b, j].append(position_kl(ref, forced_logits(engine, policy, chat, read)).cpu())
                if j >= 0:
                    retained[b, j][0].extend(policy.retained)
                    retained[b, j][1].extend(policy.retained_even)
                done += 1
                if progress is not None:
                    progress(done, total_runs)
        del read, ref
    positions = sum(len(chat.reply) for chat in material)
    measured, errors, costs, kl_even = [], [], [], []
    for b in BUDGETS:
        base = torch.cat(kl[b, -1])  # [positions]: the same positions, in the same order, in every run
        row, row_errors = [], []
        for j in range(g):
            at, even = retained[b, j]
            gained = (sum(at) - sum(even)) / max(len(at), 1)
            removed = base - torch.cat(kl[b, j])  # per position: the KL the added slots remove
            se = float(removed.std()) / len(removed) ** 0.5 if len(removed) > 1 else float("inf")
            row.append(float(removed.mean()) / gained if gained > 1e-9 else 0.0)
            row_errors.append(se / gained if gained > 1e-9 else float("inf"))
        if not all(math.isfinite(c) for c in row) or not math.isfinite(float(base.mean())):
            raise KvchatError(f"the layer costs at budget {b:g} are not finite numbers (the model's logits overflowed "
                              f"in its dtype?); measure them in float32 or run xkv with --option costs=equal")
        kept = shrunk(row, row_errors)
        top = max(kept)
        # no layer measurably costs anything (a model whose budgets change nothing): equal weights, the paper's
        floored = [max(c, FLOOR * top) for c in kept] if top > 0 else [1.0] * g
        measured.append([float(f"{c:.6g}") for c in row])
        errors.append([float(f"{e:.6g}") if e != float("inf") else 1e9 for e in row_errors])
        costs.append([float(f"{c:.6g}") for c in floored])
        kl_even.append(float(f"{float(base.mean()):.6g}"))
    return LayerCostCalibration(
        fingerprint=fingerprint, model_name=str(engine.metadata.get("general.name", "")) or Path(engine.path).stem,
        n_layers=cfg.n_layers, layers=layers, budgets=list(BUDGETS), costs=costs, measured=measured, errors=errors,
        kl_even=kl_even,
        chats=len(material), positions=positions, source=source,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def cost_lines(cal: LayerCostCalibration) -> list[str]:
    """The costs as `kvchat calibrate` prints them: a line per budget, each global layer's cost relative to the
    budget's largest."""
    lines = []
    for b, row, kl in zip(cal.budgets, cal.costs, cal.kl_even):
        top = max(row)
        lines.append(f"  budget {b:g}: " + "  ".join(f"{layer}:{c / top:.2f}" for layer, c in zip(cal.layers, row))
                     + f"  (KL at the even share {kl:.4f})")
    return lines
