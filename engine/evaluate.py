"""Recall accuracy on held-out memory dialogues: the same chats, the same questions, for every KV policy.

Each chat is fed round by round into one KV cache. At a question round the open round (user message and the
assistant header) is prefilled under the policy and the reply generated greedily; it is correct when it equals the
expected reply exactly. The cache is then rolled back and the round appended with its expected reply, so every
policy sees the identical chat.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from kvchat.engine.chat_format import Conversation
from kvchat.engine.dialogues import Dialogue, dialogues
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.policies import KVPolicy
from kvchat.engine.tiered_kv import TieredKV


@dataclass
class Tally:
    questions: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.questions if self.questions else 0.0

    def add(self, ok: bool) -> None:
        self.questions += 1
        self.correct += int(ok)


@dataclass
class EvalResult:
    model: str
    policy: str
    device: str
    chats: int
    overall: Tally = field(default_factory=Tally)
    by_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_position: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_distance: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    tokens: int = 0
    seconds: float = 0.0
    min_chat_rounds: int = 0
    min_chat_tokens: int = 0
    mean_chat_tokens: float = 0.0
    failures: list[dict] = field(default_factory=list)
    # Tiered policies: device K/V over a full cache's, and rounds kept over rounds, at each question (means).
    kv_fractions: list[float] = field(default_factory=list)
    round_fractions: list[float] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.overall.accuracy

    def as_dict(self) -> dict:
        def table(t: dict[str, Tally]) -> dict:
            return {k: {"questions": v.questions, "correct": v.correct, "accuracy": round(v.accuracy, 4)}
                    for k, v in sorted(t.items(), key=lambda kv: _sort_key(kv[0]))}

        plain = ("model", "policy", "device", "chats", "tokens", "seconds", "min_chat_rounds", "min_chat_tokens",
                 "mean_chat_tokens", "failures")
        d = {k: getattr(self, k) for k in plain}
        if self.kv_fractions:
            d["device_kv_fraction"] = round(sum(self.kv_fractions) / len(self.kv_fractions), 4)
            d["rounds_kept_fraction"] = round(sum(self.round_fractions) / len(self.round_fractions), 4)
        return {"accuracy": round(self.accuracy, 4), "questions": self.overall.questions,
                "correct": self.overall.correct, **d, "tokens_per_second": round(self.tokens_per_second, 1),
                "by_kind": table(self.by_kind), "by_position": table(self.by_position),
                "by_distance": table(self.by_distance)}

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def reply_matches(got: str, expected: str) -> bool:
    """A recall answer counts when it is the expected reply exactly (surrounding whitespace aside)."""
    return got.strip() == expected.strip()


def _sort_key(label: str) -> tuple:
    digits = "".join(c for c in label.split("-")[0] if c.isdigit())
    return (int(digits), label) if digits else (0, label)


def heldout_chats(count: int, seed: int, min_rounds: int, max_rounds: int, engine: Engine | None = None,
                  min_tokens: int = 0) -> list[Dialogue]:
    """`count` held-out chats; with `engine` and `min_tokens`, only chats at least that long in its tokens
    (drawn from one deterministic stream, so the same arguments give the same chats)."""
    if engine is None or min_tokens <= 0:
        return dialogues("heldout", count, seed, min_rounds, max_rounds)
    chosen: list[Dialogue] = []
    for dlg in dialogues("heldout", 20 * count, seed, min_rounds, max_rounds):
        if sum(len(s) for s in engine.chat.round_spans(Conversation(dlg.rounds, dlg.system))) >= min_tokens:
            chosen.append(dlg)
            if len(chosen) == count:
                return chosen
    raise ValueError(f"too few held-out chats of {min_rounds}-{max_rounds} rounds reach {min_tokens} tokens")


def evaluate(engine: Engine, policy: KVPolicy, chats: list[Dialogue], max_new_tokens: int = 48,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    result = EvalResult(engine.path, policy.name, str(engine.device), len(chats))
    lengths, started = [], time.perf_counter()
    for n, dlg in enumerate(chats):
        lengths.append(_run_chat(engine, policy, dlg, max_new_tokens, result))
        if progress:
            progress(n + 1, len(chats))
    result.seconds = time.perf_counter() - started
    result.min_chat_rounds = min((len(d.rounds) for d in chats), default=0)
    result.min_chat_tokens = min(lengths, default=0)
    result.mean_chat_tokens = sum(lengths) / len(lengths) if lengths else 0.0
    return result


def _run_chat(engine: Engine, policy: KVPolicy, dlg: Dialogue, max_new: int, result: EvalResult) -> int:
    """Tiered policies run on a TieredKV, where every round (asked or not) is read under the policy, as in a chat."""
    chat = engine.chat
    tiered = policy.tiered
    cache = TieredKV(engine.model, policy, 4096) if tiered else engine.new_cache(4096)
    closed = chat.round_spans(Conversation(dlg.rounds, dlg.system))
    questions = {q.round_index: q for q in dlg.questions}
    round_starts: list[int] = []
    for i, rnd in enumerate(dlg.rounds):
        start = cache.length
        q = questions.get(i)
        if q is not None:
            prompt = chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
            visible = None if tiered else policy.visible_slots(cache, round_starts, prompt, model=engine.model)
            out = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(),
                           max_tokens=max_new, stop_tokens=engine.tokenizer.eog_ids,
                           stop_strings=chat.stop_strings, attend=visible)
            ok = reply_matches(out.text, rnd.assistant)
            for table, key in ((result.by_kind, q.kind), (result.by_position, q.position),
                               (result.by_distance, q.distance_bucket)):
                table[key].add(ok)
            result.overall.add(ok)
            result.tokens += len(prompt) + len(out.tokens)
            if tiered and round_starts:
                result.kv_fractions.append(cache.device_bytes() / cache.full_bytes())
                kept = len(set(cache.stats.chosen) | set(cache.stats.added) | set(cache.stats.found))
                result.round_fractions.append(kept / len(round_starts))
            if not ok and len(result.failures) < 20:
                result.failures.append({"question": rnd.user[-120:], "expected": rnd.assistant, "got": out.text})
            cache.truncate(start)
        round_starts.append(start)
        if tiered:
            cache.prefill(closed[i])
            cache.close_round()
        else:
            prefill(engine.model, cache, closed[i])
        result.tokens += len(closed[i])
    return cache.length
