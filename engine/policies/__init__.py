"""The table of KV policies: `kvchat eval --kv-policy NAME` and the tests run over it."""

from __future__ import annotations

from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.full import FullKV
from kvchat.errors import KvchatError

POLICIES: dict[str, type[KVPolicy]] = {FullKV.name: FullKV}


def make_policy(name: str) -> KVPolicy:
    if name not in POLICIES:
        raise KvchatError(f"unknown KV policy {name!r} (accepted: {', '.join(POLICIES)})")
    return POLICIES[name]()
