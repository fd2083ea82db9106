"""Watershed-layer calibration for Round Attention (docs/architecture.md, "Watershed calibration").

Round Attention selects a new message's relevant rounds once, at a "watershed" layer L_w, and uses only their KV
above it. The paper (Round Attention, Appendix B) finds L_w per model: run dialogues through the model, take at
every layer the distribution of the new message's attention over the earlier rounds, average for every layer the KL
divergence to each later layer, and take the first significant local minimum of that curve.

That layer is then checked, which the paper does not do: the KL rule sees where the per-round attention stops
changing, not whether the layers above still read rounds the choice leaves out (the embedded model copies names at
its layer 3, one above its KL minimum: docs/benchmarks.md). Along the full cache's own greedy reply to each
calibration message, wherever the full cache is sure of the next token, Round Attention at L_w must predict the same
token; if it does not often enough, the next layer up is checked (`agreement`).

Here: `layer_round_distributions` measures the [L, R] distributions of one chat, `kl_curve` averages the divergences
over chats, `pick_watershed` reads L_w off the curve, and `calibrate` returns it checked as a `Calibration`. Nothing
here reads or writes a file: app/session/artifacts.py keeps one per model fingerprint, and app/session/policies.py
makes it on a model's first use and hands the watershed layer to the round policies.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from kvchat.engine.generate import prefill
from kvchat.engine.text.chat_format import Conversation
from kvchat.errors import KvchatError
from kvchat.kernels.round_scores import round_mass

# Bumped when what is measured or how L_w is read changes: files of another version are recalibrated, not trusted.
CALIBRATION_VERSION = 2
DEFAULT_CHATS = 8
DEFAULT_SEED = 0
MIN_ROUNDS, MAX_ROUNDS = 10, 20
# Probabilities are floored here before the KL divergence, so a round with no attention at one layer does not make
# the divergence infinite (the paper does not say how it handles zeros).
KL_EPSILON = 1e-6
# A local minimum is "significant" (Appendix B's word, left undefined there) when the curve has come down to it by at
# least this share of its range from the highest earlier layer: the paper's picture is a curve that is high for the
# first layers and then "suddenly diminishes substantially"; shallow early dips are noise, not that drop.
SIGNIFICANT_DROP = 0.5
# Below this range (relative to the curve's largest value) the curve counts as flat: no layer stands out.
FLAT_RANGE = 1e-3
# The check of L_w: over the first CHECK_TOKENS tokens of the full cache's greedy replies, at the tokens the full
# cache gives at least SURE probability (near-ties flip with any change of numerics and say nothing about the rounds
# chosen), Round Attention must pick the same next token at least AGREEMENT of the time.
CHECK_TOKENS = 32
SURE = 0.5
AGREEMENT = 0.99

ProgressCallback = Callable[[int, int], None]  # (chats done, chats in all)


def _mass(q: Tensor, keys: Tensor, starts: Tensor) -> Tensor:
    """Per-round attention mass [R] of queries q [T, H, D] over keys [Hkv, S, D], on the CPU."""
    return round_mass(q, keys, starts.to(q.device)).float().cpu()


@torch.inference_mode()
def layer_round_distributions(engine, conversation: Conversation, message: str) -> Tensor:
    """[L, R] float32: at every layer, the share of the new message's attention that each of the R closed rounds of
    `conversation` receives (each row sums to 1).

    Which query tokens: all of the new message's tokens (its user text and the assistant header), not only the
    final one. Appendix B says "the final query token", but the paper's distribution P_q^l (Section 3.1, Eq. 1) and
    the selection Round Attention makes at L_w (Section 3.2, step 3) both sum over every token of q_n; the watershed
    should be where *that* quantity stops changing. One token is also a noisy sample on a small model.
    The softmax is over the earlier rounds' keys only (the message's own keys left out), as the selection sees them.
    """
    model = engine.model
    spans = engine.chat.round_spans(conversation)
    if not spans:
        raise KvchatError("a calibration chat needs at least one closed round before the new message")
    new_tokens = engine.chat.open_round_tokens(conversation, message)
    history = [t for span in spans for t in span]
    starts = torch.tensor([0] + [len(s) for s in spans[:-1]], dtype=torch.long).cumsum(0)
    cache = model.new_cache(len(history) + len(new_tokens))
    prefill(model, cache, history)
    start = cache.length
    positions = torch.arange(start, start + len(new_tokens))
    rot = model.rotations(positions)
    h = model.embed(torch.tensor(new_tokens, dtype=torch.long))
    rows = []
    for i, layer in enumerate(model.layers):
        # h is the hidden state entering layer i: its queries against the keys the earlier rounds left in layer i.
        rows.append(_mass(layer.queries(h, rot), cache.layer(i)[0, :, :start], starts))
        h = model.run_layers(h, positions, cache, start, layers=range(i, i + 1))
    dist = torch.stack(rows)
    return dist / dist.sum(dim=1, keepdim=True)  # exact normalisation against kernel rounding


def kl_curve(distributions: list[Tensor], eps: float = KL_EPSILON) -> Tensor:
    """[L] float64: for each layer l the mean over chats of (the mean over later layers l' > l of KL(P_l || P_l')),
    Appendix B's "average KL divergence between its attention vector and the corresponding vectors from all
    subsequent layers (j > i)", averaged over the sampled dialogues. The last layer has no later layer: 0 there
    (pick_watershed never reads it). Chats may have different round counts R."""
    if not distributions:
        raise ValueError("kl_curve needs at least one chat's distributions")
    n_layers = distributions[0].shape[0]
    total = torch.zeros(n_layers, dtype=torch.float64)
    for dist in distributions:
        if dist.dim() != 2 or dist.shape[0] != n_layers:
            raise ValueError(f"expected [{n_layers}, R] distributions, got {list(dist.shape)}")
        p = dist.double().clamp_min(eps)
        p = p / p.sum(dim=1, keepdim=True)
        logp = p.log()
        # kl[l, m] = sum_r p_l(r) (log p_l(r) - log p_m(r))
        kl = (p * logp).sum(1, keepdim=True) - p @ logp.T
        later = torch.triu(torch.ones(n_layers, n_layers, dtype=torch.bool), diagonal=1)
        counts = later.sum(1).clamp_min(1)
        total += (kl * later).sum(1) / counts
    return total / len(distributions)


def pick_watershed(curve) -> int:
    """L_w: the first significant local minimum of the KL curve (Appendix B), in [1, L-2].

    The last layer's value is not a divergence (it has no later layer) and is ignored; layers 0..L-2 are read.
    Layer i (1 <= i <= L-3) is a local minimum when it is below the layer before and not above the layer after;
    layer L-2 has no defined layer after it, so a curve that only falls there (monotone) has no minimum. It is
    significant when the curve has dropped to it by at least SIGNIFICANT_DROP of its range from the highest layer
    before it. Fallbacks, when no minimum qualifies: a flat curve (range below FLAT_RANGE of its largest value:
    every layer agrees as well as any other) gives the middle layer L // 2; any other curve (monotone, or minima
    that are all shallow) gives the first layer in [1, L-2] that is within half of those layers' range of their
    lowest value: where the bulk of the drop is over.
    """
    values = [float(v) for v in curve]
    n_layers = len(values)
    if n_layers < 3:
        raise KvchatError(f"a watershed layer needs a model of at least 3 layers; this one has {n_layers}")
    if any(not math.isfinite(v) for v in values):
        raise ValueError("the KL curve has a value that is not finite")
    defined = values[:-1]
    low, high = min(defined), max(defined)
    spread = high - low
    if spread <= FLAT_RANGE * max(abs(high), abs(low), 1e-12):
        return n_layers // 2
    last = n_layers - 2
    for i in range(1, last):
        is_minimum = defined[i] < defined[i - 1] and defined[i] <= defined[i + 1]
        if is_minimum and max(defined[:i]) - defined[i] >= SIGNIFICANT_DROP * spread:
            return i
    candidates = defined[1 : last + 1]
    floor, ceiling = min(candidates), max(candidates)
    return next(i for i in range(1, last + 1) if defined[i] <= floor + 0.5 * (ceiling - floor))


@dataclass
class Calibration:
    fingerprint: str
    model_name: str
    n_layers: int
    watershed: int
    curve: list[float]  # mean KL to the later layers, per layer (the last layer's 0 is a placeholder)
    chats: int
    source: str  # "memory-dialogues" | "mt_bench": where the calibration chats came from
    seed: int
    date: str  # ISO 8601, UTC
    version: int = CALIBRATION_VERSION
    rounds: list[int] = field(default_factory=list)  # closed rounds before the new message, per chat
    kl_watershed: int = -1  # the KL curve's first significant local minimum (Appendix B); watershed >= it
    agreement: dict[str, float] = field(default_factory=dict)  # layer checked -> share of sure tokens agreed on

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Calibration":
        """The calibration as stored; ValueError, TypeError or AttributeError when it does not hold together."""
        cal = cls(**raw)
        curve_ok = len(cal.curve) == cal.n_layers and all(isinstance(v, (int, float)) for v in cal.curve)
        if not (isinstance(cal.watershed, int) and 1 <= cal.watershed <= cal.n_layers - 2 and curve_ok):
            raise ValueError("inconsistent fields")
        return cal


def is_embedded_model(engine) -> bool:
    from kvchat.assets import DEFAULT_MODEL

    same_file = Path(engine.path).resolve() == DEFAULT_MODEL.resolve()
    return same_file or engine.metadata.get("general.name") == DEFAULT_MODEL.stem  # a copy keeps its name


def calibration_chats(engine, count: int = DEFAULT_CHATS, seed: int = DEFAULT_SEED,
                      phrasing: str = "train") -> tuple[str, list[tuple[Conversation, str]]]:
    """(source, [(closed chat, new message)]), deterministic from the seed.

    The embedded model knows only memory dialogues: held-out ones of MIN_ROUNDS..MAX_ROUNDS rounds, in `phrasing`'s
    sentences (dialogues.PHRASINGS), cut before their last question, which is the new message. Any other model gets
    MT-Bench chats of at least 10 rounds (the resume benchmark's builder) of 1-2k tokens, within half its context,
    with a fresh MT-Bench question as the new message.
    """
    if count < 1:
        raise KvchatError("calibration needs at least one chat")
    if is_embedded_model(engine):
        from kvchat.engine.data.dialogues import dialogues

        chats = []
        for dlg in dialogues("heldout", count, 7919 + seed, MIN_ROUNDS + 1, MAX_ROUNDS + 1, phrasing=phrasing):
            # make_dialogue always asks in one of the last two rounds, so a question round after round 0 exists
            q = max(question.round_index for question in dlg.questions)
            chats.append((Conversation(dlg.rounds[:q], dlg.system), dlg.rounds[q].user))
        return "memory-dialogues", chats
    from kvchat.engine.data.workloads import mt_bench_workload

    rng = random.Random(f"calibration:{seed}")
    cap = max(256, engine.config.context_length // 2)
    chats = []
    for n in range(count):
        target = min(cap, rng.randint(1024, 2048))
        wl = mt_bench_workload(engine.chat, "calibration", seed=seed * 1000 + n, target=target)
        chats.append((wl.conversation, wl.new_message))
    return "mt_bench", chats


def calibrate(engine, fingerprint: str, chats: int = DEFAULT_CHATS, seed: int = DEFAULT_SEED,
              progress: ProgressCallback | None = None) -> Calibration:
    """Measure the KL curve on `chats` calibration chats, read L_w off it and check it (not stored: see
    app.session.policies.ensure_calibration; `fingerprint` only labels it). Progress counts chats: one pass for the
    curve, one per layer checked."""
    if engine.config.n_layers < 3:  # refused before minutes of measuring, not after
        raise KvchatError(f"a watershed layer needs a model of at least 3 layers; this one has "
                          f"{engine.config.n_layers}")
    source, pairs = calibration_chats(engine, chats, seed)
    distributions = []
    for n, (conv, message) in enumerate(pairs):
        distributions.append(layer_round_distributions(engine, conv, message))
        if progress is not None:
            progress(n + 1, 2 * len(pairs))
    curve = kl_curve(distributions)
    kl_watershed = pick_watershed(curve)
    watershed, agreed = checked_watershed(engine, pairs, kl_watershed, progress)
    return Calibration(
        fingerprint=fingerprint, model_name=str(engine.metadata.get("general.name", "")) or Path(engine.path).stem,
        n_layers=engine.config.n_layers, watershed=watershed, curve=[round(float(v), 6) for v in curve],
        chats=len(pairs), source=source, seed=seed, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        rounds=[len(conv.rounds) for conv, _ in pairs], kl_watershed=kl_watershed,
        agreement={str(layer): round(a, 4) for layer, a in agreed.items()})


def checked_watershed(engine, pairs: list[tuple[Conversation, str]], first: int,
                      progress: ProgressCallback | None = None) -> tuple[int, dict[int, float]]:
    """(L_w, {layer: agreement}): the first layer from `first` up whose agreement reaches AGREEMENT; if none does
    (up to L - 2, the last layer that leaves one above it), the layer that agreed most."""
    references = [reference_reply(engine, conv, message) for conv, message in pairs]
    agreed: dict[int, float] = {}
    cfg = engine.config
    # Sliding-window layers (Gemma 3) cannot choose rounds: they see nothing older than their window.
    candidates = [i for i in range(1, cfg.n_layers - 1) if not cfg.window(i)]
    if not candidates:
        raise KvchatError("the model has no global attention layer below its last to choose rounds at")
    for layer in [i for i in candidates if i >= first] or candidates:
        done = len(pairs) * (1 + len(agreed))

        def step(n: int, total: int) -> None:
            if progress is not None:
                progress(done + n, done + total)

        agreed[layer] = agreement(engine, references, layer, step)
        if agreed[layer] >= AGREEMENT:
            return layer, agreed
    return max(agreed, key=lambda layer: (agreed[layer], -layer)), agreed


@dataclass
class ReferenceReply:
    history: list[list[int]]  # the closed rounds' tokens
    prompt: list[int]  # the new message and the assistant header
    reply: list[int]  # the full cache's greedy reply (at most CHECK_TOKENS)
    sure: list[bool]  # per reply token: the full cache gave it at least SURE probability


@torch.inference_mode()
def reference_reply(engine, conversation: Conversation, message: str) -> ReferenceReply:
    model, history = engine.model, engine.chat.round_spans(conversation)
    prompt = engine.chat.open_round_tokens(conversation, message)
    cache = model.new_cache(sum(map(len, history)) + len(prompt) + CHECK_TOKENS)
    prefill(model, cache, [t for span in history for t in span])
    logits, reply, sure = prefill(model, cache, prompt), [], []
    for _ in range(CHECK_TOKENS):
        probs = torch.softmax(logits.float(), dim=-1)
        token = int(probs.argmax())
        if token in engine.tokenizer.eog_ids:
            break
        reply.append(token)
        sure.append(float(probs[token]) >= SURE)
        logits = prefill(model, cache, [token])
    return ReferenceReply(history, prompt, reply, sure)


@torch.inference_mode()
def agreement(engine, references: list[ReferenceReply], watershed: int,
              progress: ProgressCallback | None = None) -> float:
    """Share of the references' sure tokens that Round Attention at `watershed` predicts too, fed the references'
    own replies (teacher forcing: one early difference does not count twice). Every round is read under the
    policy, as in a chat; 1.0 when no token is sure."""
    from kvchat.engine.kv.tiered import TieredKV
    from kvchat.engine.policies.round_attention import RoundAttention

    hits = count = 0
    for n, ref in enumerate(references):
        # Rechecks off: the check is of the choice at L_w itself, not of the safety net behind it.
        policy = RoundAttention(watershed=watershed, recheck_below=0)
        cache = TieredKV(engine.model, policy, len(ref.prompt) + CHECK_TOKENS)
        for span in ref.history:
            cache.prefill(span)
            cache.close_round()
        logits = cache.prefill(ref.prompt)
        for i, (token, sure) in enumerate(zip(ref.reply, ref.sure)):
            if i:
                logits = cache.step(ref.reply[i - 1])
            if sure:
                hits += int(logits.argmax()) == token
                count += 1
        if progress is not None:
            progress(n + 1, len(references))
    return hits / count if count else 1.0


def curve_lines(cal: Calibration) -> list[str]:
    """The curve as text, one line per layer, L_w marked."""
    lines = []
    for layer, value in enumerate(cal.curve):
        if layer == cal.n_layers - 1:
            lines.append(f"layer {layer:>3}  (no later layer)")
            continue
        marks = []
        if layer == cal.kl_watershed:
            marks.append("first significant minimum")
        if str(layer) in cal.agreement:
            marks.append(f"agrees with the full cache on {100 * cal.agreement[str(layer)]:.1f}% of sure tokens")
        if layer == cal.watershed:
            marks.append("watershed")
        mark = "  <- " + "; ".join(marks) if marks else ""
        lines.append(f"layer {layer:>3}  mean KL to later layers {value:.4f}{mark}")
    return lines


def plot_curve(cal: Calibration, path: Path) -> Path:
    """A PNG of the curve with L_w marked. Needs matplotlib (the `bench` extra): ImportError without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(cal.n_layers - 1))  # the last layer has no later layer to compare with
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(layers, cal.curve[:-1], marker="o", color="#1f77b4")
    if 0 <= cal.kl_watershed != cal.watershed:
        ax.axvline(cal.kl_watershed, color="#7f7f7f", linestyle=":",
                   label=f"first significant minimum (layer {cal.kl_watershed}): failed the check")
    ax.axvline(cal.watershed, color="#d62728", linestyle="--", label=f"watershed layer L_w = {cal.watershed}")
    ax.set_xlabel("layer l")
    ax.set_ylabel("mean KL(P_l || P_l'), l' > l")
    ax.set_title(f"{cal.model_name}: round attention across layers ({cal.chats} {cal.source} chats)", fontsize=9)
    ax.set_xticks(layers)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
