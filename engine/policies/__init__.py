"""The table of KV policies: `kvchat eval --kv-policy NAME` and the tests run over it."""

from __future__ import annotations

from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.full import FullKV
from kvchat.engine.policies.krul import KrulMerge
from kvchat.engine.policies.loopserve import LoopServe, LoopServeRound
from kvchat.engine.policies.round_attention import (
    RoundAttention, RoundAttentionAdaptive, RoundAttentionThreshold, RoundAttentionTopK,
)
from kvchat.engine.policies.sparse_prefill import DEFAULT_MIN_KEYS
from kvchat.errors import KvchatError

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls
    for cls in (FullKV, KrulMerge, LoopServe, LoopServeRound, RoundAttention, RoundAttentionThreshold, RoundAttentionTopK, RoundAttentionAdaptive)
}


# What chats accept: the full cache, Round Attention on its tiered KV, or LoopServe on the full cache (sparse prefill
# of long messages, progressive selection of what the reply reads).
CHAT_POLICIES = ("full", "round", "loopserve")


def chat_policy(name: str, engine=None, progress=None) -> KVPolicy | None:
    """The policy a chat runs under: None for the full cache, else a tiered policy (`round` or a strategy) or
    `loopserve`."""
    if name == "full":
        return None
    if name == "loopserve":
        # A chat's prefill goes sparse only from where the kernel measured faster (a whole prefill never has yet:
        # docs/benchmarks.md, "LoopServe"); its reply always reads a progressively chosen budget.
        return make_policy(name, engine, progress, min_keys=DEFAULT_MIN_KEYS)
    if name not in POLICIES or not POLICIES[name].tiered:
        raise KvchatError(f"unknown KV policy {name!r} for chats (accepted: "
                          f"{', '.join(n for n in POLICIES if n in CHAT_POLICIES or POLICIES[n].tiered)})")
    return make_policy(name, engine, progress)


def make_policy(name: str, engine=None, progress=None, **options) -> KVPolicy:
    """The policy `name` for `engine`; `progress(done, total)` hears about any calibration it needs first."""
    if name not in POLICIES:
        raise KvchatError(f"unknown KV policy {name!r} (accepted: {', '.join(POLICIES)})")
    return POLICIES[name].create(engine, progress, **options)
