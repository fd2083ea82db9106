"""A chat's cross-layer merging (Krul §4-5) as the chat session uses it: the chat's attention statistics, kept in
the store and added to at every round, and the layer pairs its next stored round is merged in.

The pairs are chosen again at each round from the statistics so far (Algorithm 1, engine.policies.merge_selection)
among the pairs the model's check accepted (made on the model's first use: app/session/policies.py); a round keeps
the pairs it was stored with (the `merged` column of its K/V rows and its segments of kind "merged" say which), so a
chat whose choice changes holds rounds of both.
"""

from __future__ import annotations

from kvchat.app.session.policies import ensure_merge_calibration
from kvchat.engine.kv.cross_layer import LayerPair
from kvchat.engine.policies.layer_stats import LayerStats
from kvchat.engine.policies.merge_selection import GAMMA, RETAIN, choose_pairs, greedy_pairs
from kvchat.errors import KvchatError
from kvchat.storage.db import Store


class ChatMerges:
    def __init__(self, store: Store, sid: str, engine, fingerprint: str, r_l: float, progress=None,
                 allowed: list[LayerPair] | None = None, retain: float = RETAIN, gamma: float = GAMMA,
                 checked: bool = True):
        """`allowed`: the model's checked pairs (default: its merge calibration, made on first use); with
        `checked` False any pair Algorithm 1 picks (random-weight benchmarks, where no check means anything)."""
        if not 0 < r_l <= 1:
            raise KvchatError(f"the share of layers merged is in (0, 1], not {r_l}")
        self.store, self.sid, self.engine, self.r_l, self.retain, self.gamma = store, sid, engine, r_l, retain, gamma
        self.allowed = allowed
        if allowed is None and checked:
            self.allowed = ensure_merge_calibration(engine, fingerprint, progress).pairs
        raw = store.layer_stats(sid)
        try:
            stats = LayerStats.from_dict(raw) if raw else None
        except (KeyError, TypeError, ValueError):
            stats = None  # damaged statistics are only a worse choice of pairs: start again
        n_layers = engine.config.n_layers
        self.stats = stats if stats is not None and stats.n_layers == n_layers else LayerStats(n_layers)

    def observe(self, cache, ends_and_tails: list[tuple[int, list[int]]], tokens: list[int] | None = None,
                windows_from: int = 0) -> None:
        """Probe the full cache at each (end slot, the tokens just before it) and keep the sums in the store.
        `tokens` (the chat's, from slot 0) and `windows_from` (below it the cache's sliding-window K/V may be
        zeros): probes whose sliding windows the cache no longer holds are made on a replay of the chat
        (LayerStats.add_probes), as a chat stored merged at once (`kvchat merge`) needs for its early rounds."""
        self.stats.add_probes(self.engine.model, cache, ends_and_tails, tokens, windows_from)
        self.store.save_layer_stats(self.sid, self.stats.as_dict())

    def pairs(self, within: range | None = None) -> list[LayerPair]:
        """The pairs the chat's next round is stored merged in (both layers in `within`): Algorithm 1 on the chat's
        statistics; with none yet (a tiered chat, which keeps no full cache to probe), the model's checked pairs in
        the order the check accepted them."""
        cfg = self.engine.config
        allowed = self.allowed
        if within is not None and allowed is not None:
            allowed = [p for p in allowed if p.low in within and p.high in within]
        if self.stats.probes == 0:
            return greedy_pairs(allowed or [], cfg.n_layers, self.r_l)
        return choose_pairs(self.stats, cfg, self.r_l, self.gamma, allowed)


def pairs_text(pairs: list[LayerPair]) -> str:
    return ",".join(str(p) for p in sorted(pairs))


def parse_pairs(text: str) -> list[LayerPair]:
    return [LayerPair.parse(p) for p in text.split(",") if p]


def chat_merges(store: Store, info: dict, engine, share: float | None, progress=None) -> ChatMerges | None:
    """The chat's cross-layer merging as its settings say (a `share` given now is kept there: the CLI's --merge),
    or None when off. `progress` hears about the model's check on its first use."""
    from pathlib import Path

    from kvchat.storage.fingerprint import model_fingerprint

    if share is not None and share != info["settings"].get("merge", 0):
        store.update_session(info["id"], settings={**info["settings"], "merge": share})
    share = info["settings"].get("merge", 0) if share is None else share
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        raise KvchatError(f"the chat's merge setting {str(share)[:40]!r} is not a share of layers; "
                          f"`kvchat merge {info['id']} --share 0.5` sets it, `kvchat unmerge {info['id']}` clears it")
    if not share:
        return None
    return ChatMerges(store, info["id"], engine, model_fingerprint(Path(engine.path), store), share, progress)
