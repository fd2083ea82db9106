"""The table of KV policies: `kvchat eval --kv-policy NAME` and the tests run over it.

`make_policy` builds one from its parameters alone (pure: no calibration, no file). A policy that still lacks what
its model's calibration gives (`KVPolicy.calibration_needed`) is refused here; app/session/policies.py builds policies
with the calibration made or read for the model (`build_policy`, `chat_policy`)."""

from __future__ import annotations

from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.full import FullKV
from kvchat.engine.policies.krul import KrulMerge
from kvchat.engine.policies.loopserve import LoopServe, LoopServeRound
from kvchat.engine.policies.louiskv import LouisKV
from kvchat.engine.policies.pyramid import PyramidBudget
from kvchat.engine.policies.quest import QuestPages
from kvchat.engine.policies.round_attention import (
    RoundAttention,
    RoundAttentionAdaptive,
    RoundAttentionThreshold,
    RoundAttentionTopK,
)
from kvchat.engine.policies.uniform import UniformBudget
from kvchat.engine.policies.xkv import XKV
from kvchat.errors import KvchatError

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls
    for cls in (FullKV, KrulMerge, LoopServe, LoopServeRound, RoundAttention, RoundAttentionThreshold,
                RoundAttentionTopK, RoundAttentionAdaptive, XKV, UniformBudget, PyramidBudget, LouisKV, QuestPages)
}


# What chats accept: the full cache, Round Attention on its tiered KV, LoopServe on the full cache (sparse prefill
# of long messages, progressive selection of what the reply reads), XKV (per-layer budgets of what the reply reads) or
# LouisKV (the reply reads the clusters of the chat's keys its queries score best, chosen again at boundaries).
CHAT_POLICIES = ("full", "round", "loopserve", "xkv", "louiskv")
# Policies whose reply reads a per-layer budget (engine.policies.budgets): they take `budget=` (a share in (0, 1]).
BUDGET_POLICIES = ("xkv", "uniform", "pyramid")


def policy_class(name: str) -> type[KVPolicy]:
    """The policy class `name` names; a one-line error naming the accepted ones otherwise."""
    if name not in POLICIES:
        raise KvchatError(f"unknown KV policy {name!r} (accepted: {', '.join(POLICIES)})")
    return POLICIES[name]


def chat_policy_class(name: str) -> type[KVPolicy] | None:
    """The class of the policy a chat runs under: None for the full cache, else a tiered policy (`round` or a
    strategy), `loopserve` or `xkv`; a one-line error for any other name."""
    if name == "full":
        return None
    if name in ("loopserve", "xkv", "louiskv") or (name in POLICIES and POLICIES[name].tiered):
        return POLICIES[name]
    raise KvchatError(f"unknown KV policy {name!r} for chats (accepted: "
                      f"{', '.join(n for n in POLICIES if n in CHAT_POLICIES or POLICIES[n].tiered)})")


def make_policy(name: str, engine=None, **options) -> KVPolicy:
    """The policy `name` with `options` as its parameters, checked against `engine`'s model when one is given.
    What calibration gives (watershed=, pairs=) must be among the options: this never measures nor reads a file."""
    policy = policy_class(name).construct(**options)
    missing = policy.calibration_needed()
    if missing:
        raise KvchatError(f"the {name} KV policy needs {', '.join(f'{m}=' for m in missing)} from its model's "
                          f"calibration (kvchat.app.session.policies.build_policy makes or reads it)")
    if engine is not None:
        policy.check_model(engine.model)
    return policy
