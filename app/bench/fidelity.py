"""Fidelity on real text (`kvchat eval --text`): how far each KV policy moves a model's next-token distribution
from the full cache's, on long chats of real text.

Chats are built from MT-Bench questions and reference answers as `kvchat bench` builds them (engine.data.workloads), at
a few lengths. Each chat's last reply is teacher-forced through each policy (engine.teacher_forcing: the history
read round by round, the prompt prefilled under the policy, the reply's tokens fed through its decode path). At every
reply position: KL(full || policy) of the next-token distributions, whether their top tokens agree, and the
negative log-likelihood of the reply's actual next token (perplexity), grouped by position in the reply.

`full` against itself must give exactly 0 KL and 100% agreement: the harness checks its own determinism.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from kvchat.engine.engine import Engine
from kvchat.engine.policies import KVPolicy
from kvchat.engine.teacher_forcing import forced_logits, position_kl, text_chats
from kvchat.errors import KvchatError

LENGTHS = (2000, 8000, 24000)
# Reply positions grouped by how far into the reply they are (the policy's choice was made at the prompt).
BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 1 << 30))


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi - 1}"


@dataclass
class Tally:
    positions: int = 0
    kl: float = 0.0  # sum of KL(full || policy), nats
    agree: int = 0  # positions whose top tokens are the same
    nll: float = 0.0  # sum of -log p_policy(actual next token)
    nll_full: float = 0.0

    def add(self, kl: float, agree: bool, nll: float, nll_full: float) -> None:
        self.positions += 1
        self.kl += kl
        self.agree += int(agree)
        self.nll += nll
        self.nll_full += nll_full

    def as_dict(self) -> dict:
        n = max(self.positions, 1)
        return {"positions": self.positions, "mean_kl": round(self.kl / n, 6), "top1": round(self.agree / n, 4),
                "ppl": round(math.exp(self.nll / n), 4), "ppl_full": round(math.exp(self.nll_full / n), 4)}


@dataclass
class PolicyFidelity:
    policy: str
    overall: Tally = field(default_factory=Tally)
    by_position: dict[str, Tally] = field(default_factory=dict)
    error: str | None = None  # the policy refused this model (one line), nothing measured
    watershed: int | None = None  # round policies: the layer they chose at
    merged: list[list[str]] = field(default_factory=list)  # krul: the pairs merged, per chat
    # layer-budget policies (xkv, uniform, pyramid), per chat: the share of the input's K/V the reply read (mean
    # over the global layers, window included) and the mean share of the window's scored attention kept
    kept: list[float] = field(default_factory=list)
    retention: list[float] = field(default_factory=list)
    kept_by_layer: list[list[int]] = field(default_factory=list)  # per chat: each global layer's kept input slots

    def add(self, position: int, kl: float, agree: bool, nll: float, nll_full: float) -> None:
        self.overall.add(kl, agree, nll, nll_full)
        lo, hi = next(b for b in BUCKETS if b[0] <= position < b[1])
        self.by_position.setdefault(bucket_name(lo, hi), Tally()).add(kl, agree, nll, nll_full)

    def as_dict(self) -> dict:
        if self.error:
            return {"policy": self.policy, "error": self.error}
        extra = {} if self.watershed is None else {"watershed": self.watershed}
        if self.merged:
            extra["merged_pairs"] = self.merged
        if self.kept:
            extra["kept_share"] = round(sum(self.kept) / len(self.kept), 4)
            extra["retention"] = round(sum(self.retention) / len(self.retention), 4)
            extra["kept_by_layer"] = self.kept_by_layer
        return {"policy": self.policy, **extra, **self.overall.as_dict(),
                "by_position": {k: v.as_dict() for k, v in self.by_position.items()}}


def compare(policy: PolicyFidelity, ref: torch.Tensor, got: torch.Tensor, reply: list[int]) -> None:
    """Add one chat's positions: ref / got logits [n, V] of the full cache and the policy."""
    ref_lp, got_lp = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = position_kl(ref, got)  # [n]
    agree = ref.argmax(-1) == got.argmax(-1)
    target = torch.tensor(reply, device=ref.device)[:, None]
    nll, nll_full = -got_lp.gather(1, target)[:, 0], -ref_lp.gather(1, target)[:, 0]
    for i, (k, a, x, y) in enumerate(zip(kl.tolist(), agree.tolist(), nll.tolist(), nll_full.tolist())):
        policy.add(i, k, a, x, y)


@dataclass
class FidelityResult:
    model: str
    device: str
    lengths: dict[int, list[PolicyFidelity]] = field(default_factory=dict)
    chat_tokens: dict[int, list[int]] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)  # lengths the model's context cannot hold
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "seconds": round(self.seconds, 1),
                "skipped": {str(k): v for k, v in self.skipped.items()},
                "lengths": {str(k): {"chat_tokens": self.chat_tokens[k], "policies": [p.as_dict() for p in v]}
                            for k, v in self.lengths.items()}}


def text_fidelity(engine: Engine, policies: dict[str, Callable[[], KVPolicy]], lengths=LENGTHS, chats: int = 2,
                  max_positions: int = 256, seed: int = 0,
                  progress: Callable[[str, int, int], None] | None = None) -> FidelityResult:
    """Every policy (name -> a maker, so a policy that refuses the model is reported, not fatal) against the full
    cache, on `chats` chats per length. `full` is always measured against itself as the harness's own check.
    `progress(what, done, total)`: before each run, counted in runs (the reference and each policy, per chat)."""
    from kvchat.engine.policies import make_policy

    result = FidelityResult(engine.path, str(engine.device))
    started = time.perf_counter()
    full = make_policy("full", engine)
    runs = [length for length in lengths if length + max_positions <= engine.config.context_length]
    total = len(runs) * chats * (1 + len([p for p in policies if p != "full"]) + 1)  # + the reference per chat
    done = 0
    for length in lengths:
        if length + max_positions > engine.config.context_length:
            result.skipped[length] = f"longer than the model's context of {engine.config.context_length} tokens"
            continue
        material = text_chats(engine, length, chats, max_positions, seed)
        result.chat_tokens[length] = [c.tokens for c in material]
        rows = {name: PolicyFidelity(name) for name in ["full", *[p for p in policies if p != "full"]]}
        for chat in material:
            ref = forced_logits(engine, full, chat)
            done += 1
            for name, fid in rows.items():
                if progress:
                    progress(f"{length} tokens, {chat.name}: {name}", done, total)
                done += 1
                if fid.error:
                    continue
                try:
                    policy = full if name == "full" else policies[name]()
                    fid.watershed = getattr(policy, "watershed", None)
                    got = forced_logits(engine, policy, chat)
                    if hasattr(policy, "last_pairs"):
                        fid.merged.append([str(p) for p in policy.last_pairs])
                    choice = getattr(policy, "last_choice", None)
                    if choice is not None:
                        fid.kept.append(choice.kept_share)
                        fid.retention.append(sum(choice.retention) / max(len(choice.retention), 1))
                        fid.kept_by_layer.append([choice.kept[i] for i in choice.global_layers])
                except KvchatError as exc:
                    fid.error = str(exc)
                    continue
                compare(fid, ref, got, chat.reply)
            del ref
        result.lengths[length] = list(rows.values())
    if progress and total:
        progress("done", total, total)
    result.seconds = time.perf_counter() - started
    return result
