"""The retrieval trigger's thresholds for LouisKV (engine.policies.louiskv), per model.

LouisKV retrieves again when a decode step's queries turn away from the last step's: r = mean over query heads of
cos(q_prev, q), at a layer, below that layer's τ. The paper's notes give τ ≈ 0.7 for Qwen3-8B, "set once per model
from a few hundred validation samples". Layers differ too much for one τ (the embedded model, 2026-11-27: the median
r of its first layer is 0.09, of its others 0.55-0.80), so here each global layer gets its own: the `share`-quantile
of its r over the greedy replies of the full cache to the calibration chats (engine.calibrate.watershed's chats),
i.e. the τ at which that layer would have retrieved at `share` of the steps. `share` is the one setting: how often
a reply retrieves, traded against how stale its units may get (docs/benchmarks.md, "LouisKV").

Nothing here reads or writes a file: app/session/artifacts.py keeps one per model fingerprint, and
app/session/policies.py makes it on a model's first use and hands τ to the policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import Tensor

from kvchat.engine.calibrate.watershed import DEFAULT_SEED, ProgressCallback, calibration_chats
from kvchat.engine.generate import prefill
from kvchat.engine.policies.louiskv import query_similarity
from kvchat.engine.text.chat_format import Conversation

# Bumped when what is measured changes: files of another version are measured again, not trusted.
TRIGGER_VERSION = 1
DEFAULT_SHARE = 0.25  # of decode steps at which a layer retrieves (docs/benchmarks.md, "LouisKV": how it was chosen)
REPLY_TOKENS = 64  # greedy tokens per calibration chat
# Chats measured: the embedded model's replies are a few tokens each (16 chats: ~150 steps, 2 s on 2 cores); an
# MT-Bench chat's reply runs its 64 tokens (~1,000 steps).
DEFAULT_CHATS = 16


@dataclass
class TriggerCalibration:
    fingerprint: str
    model_name: str
    n_layers: int
    layers: list[int]  # the global layers (sliding-window layers keep their window and retrieve nothing)
    tau: list[float]  # per global layer: retrieve when r falls below it
    share: float  # the quantile τ was read at
    steps: int  # r values measured per layer
    chats: int
    source: str  # "memory-dialogues" | "mt_bench"
    date: str
    version: int = TRIGGER_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "TriggerCalibration":
        """The calibration as stored; ValueError, TypeError or AttributeError when it does not hold together."""
        cal = cls(**raw)
        if len(cal.tau) != len(cal.layers) or not all(isinstance(t, (int, float)) and -1 <= t <= 1 for t in cal.tau):
            raise ValueError("a τ in [-1, 1] per global layer")
        if not all(isinstance(i, int) and 0 <= i < cal.n_layers for i in cal.layers) or not 0 < cal.share < 1:
            raise ValueError("global layers of the model and a share in (0, 1)")
        return cal


@torch.inference_mode()
def reply_similarities(engine, conversation: Conversation, message: str, tokens: int = REPLY_TOKENS) -> Tensor:
    """r at each step of the full cache's greedy reply to `message` after `conversation`, at every global layer:
    [steps, G] (the first step's previous token is the prompt's last)."""
    model, cfg = engine.model, engine.config
    layers = [i for i in range(cfg.n_layers) if not cfg.window(i)]
    history = [t for span in engine.chat.round_spans(conversation) for t in span]
    prompt = engine.chat.open_round_tokens(conversation, message)
    cache = model.new_cache(len(history) + len(prompt) + tokens + 1)
    if history:
        prefill(model, cache, history)
    similarities: list[Tensor] = []
    previous = None
    fed = prompt
    for _ in range(tokens + 1):
        start = cache.length
        queries: list[Tensor] = []
        h = model.run_layers(model.embed(torch.tensor(fed)), torch.arange(start, start + len(fed)), cache, start,
                             queries=queries)
        cache.length = start + len(fed)
        current = torch.stack([queries[i].reshape(len(fed), cfg.n_heads, cfg.head_dim)[-1] for i in layers])
        if previous is not None:
            similarities.append(query_similarity(previous, current))
        previous = current
        token = int(model.head(h[-1:])[-1].argmax())
        if token in engine.tokenizer.eog_ids:
            break
        fed = [token]
    return torch.stack(similarities) if similarities else torch.zeros(0, len(layers))


def calibrate_trigger(engine, fingerprint: str, chats: int = DEFAULT_CHATS, seed: int = DEFAULT_SEED,
                      share: float = DEFAULT_SHARE, progress: ProgressCallback | None = None) -> TriggerCalibration:
    """Measure r along the full cache's replies to `chats` calibration chats and read each global layer's τ at the
    `share`-quantile (not stored: see app.session.policies; `fingerprint` only labels it)."""
    source, pairs = calibration_chats(engine, chats, seed)
    measured = []
    for n, (conversation, message) in enumerate(pairs):
        measured.append(reply_similarities(engine, conversation, message))
        if progress is not None:
            progress(n + 1, len(pairs))
    r = torch.cat(measured)
    cfg = engine.config
    layers = [i for i in range(cfg.n_layers) if not cfg.window(i)]
    tau = r.quantile(share, dim=0).tolist() if len(r) else [0.0] * len(layers)
    return TriggerCalibration(
        fingerprint=fingerprint, model_name=str(engine.metadata.get("general.name", "")) or Path(engine.path).stem,
        n_layers=cfg.n_layers, layers=layers, tau=[round(float(t), 4) for t in tau], share=share, steps=len(r),
        chats=len(pairs), source=source, date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
