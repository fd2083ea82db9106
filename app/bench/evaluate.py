"""Recall accuracy on held-out memory dialogues: the same chats, the same questions, for every KV policy.

Each chat is fed round by round into one KV cache. At a question round the open round (user message and the
assistant header) is prefilled under the policy and the reply generated greedily, under the generation guard as a
user gets it; it is correct when it equals the expected reply exactly. The cache is then rolled back and the round
appended with its expected reply, so every policy sees the identical chat.

Recall is reported per question kind, position, distance, and phrasing family (how the fact was told, how the
question was asked). Out-of-scope prompts (greetings, thanks, requests, questions about something never told) are
scored too: a reply counts as polite when it is one of the demo model's fixed short replies. `sample_replies`
samples replies at a temperature with the guard off, to count the ones that loop or run past the cap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from kvchat.engine.data.dialogues import POLITE_REPLIES, Dialogue, dialogues
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.kv.tiered import TieredKV
from kvchat.engine.policies import KVPolicy
from kvchat.engine.reply_guard import ReplyGuard, repeating_tail
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import Conversation


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
    by_stated: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_asked: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    # Out-of-scope prompts: `correct` counts polite replies (one of POLITE_REPLIES), per kind and in all.
    out_of_scope: Tally = field(default_factory=Tally)
    out_of_scope_by_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    out_of_scope_expected: int = 0  # the very reply the chat expected (e.g. "You haven't told me that yet.")
    longest_other_reply: int = 0  # tokens of the longest out-of-scope reply that was not a polite one
    longest_reply: int = 0  # tokens of the longest reply of all
    stop_reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phrasing: str = "train"
    tokens: int = 0
    seconds: float = 0.0
    min_chat_rounds: int = 0
    min_chat_tokens: int = 0
    mean_chat_tokens: float = 0.0
    failures: list[dict] = field(default_factory=list)
    # Tiered policies: device K/V over a full cache's, and rounds kept over rounds, at each question (means).
    kv_fractions: list[float] = field(default_factory=list)
    round_fractions: list[float] = field(default_factory=list)
    merged_fractions: list[float] = field(default_factory=list)  # Krul: share of layers merged, at each question

    @property
    def accuracy(self) -> float:
        return self.overall.accuracy

    def as_dict(self) -> dict:
        def table(t: dict[str, Tally]) -> dict:
            return {k: {"questions": v.questions, "correct": v.correct, "accuracy": round(v.accuracy, 4)}
                    for k, v in sorted(t.items(), key=lambda kv: _sort_key(kv[0]))}

        plain = ("model", "policy", "device", "phrasing", "chats", "tokens", "seconds", "min_chat_rounds",
                 "min_chat_tokens", "mean_chat_tokens", "longest_reply", "failures")
        d = {k: getattr(self, k) for k in plain}
        if self.kv_fractions:
            d["device_kv_fraction"] = round(sum(self.kv_fractions) / len(self.kv_fractions), 4)
            d["rounds_kept_fraction"] = round(sum(self.round_fractions) / len(self.round_fractions), 4)
        if self.merged_fractions:
            d["merged_layer_fraction"] = round(sum(self.merged_fractions) / len(self.merged_fractions), 4)
        return {"accuracy": round(self.accuracy, 4), "questions": self.overall.questions,
                "correct": self.overall.correct, **d, "tokens_per_second": round(self.tokens_per_second, 1),
                "by_kind": table(self.by_kind), "by_position": table(self.by_position),
                "by_distance": table(self.by_distance), "by_stated": table(self.by_stated),
                "by_asked": table(self.by_asked),
                "out_of_scope": {"prompts": self.out_of_scope.questions, "polite": self.out_of_scope.correct,
                                 "polite_rate": round(self.out_of_scope.accuracy, 4),
                                 "expected_reply": self.out_of_scope_expected,
                                 "longest_other_reply_tokens": self.longest_other_reply,
                                 "by_kind": table(self.out_of_scope_by_kind)},
                "stop_reasons": dict(sorted(self.stop_reasons.items()))}

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
                  min_tokens: int = 0, phrasing: str = "train") -> list[Dialogue]:
    """`count` held-out chats (held-out values, in `phrasing`'s sentences); with `engine` and `min_tokens`, only
    chats at least that long in its tokens (drawn from one deterministic stream, so the same arguments give the
    same chats)."""
    if engine is None or min_tokens <= 0:
        return dialogues("heldout", count, seed, min_rounds, max_rounds, phrasing)
    chosen: list[Dialogue] = []
    for dlg in dialogues("heldout", 20 * count, seed, min_rounds, max_rounds, phrasing):
        if sum(len(s) for s in engine.chat.round_spans(Conversation(dlg.rounds, dlg.system))) >= min_tokens:
            chosen.append(dlg)
            if len(chosen) == count:
                return chosen
    raise ValueError(f"too few held-out chats of {min_rounds}-{max_rounds} rounds reach {min_tokens} tokens")


def evaluate(engine: Engine, policy: KVPolicy, chats: list[Dialogue], max_new_tokens: int = 64,
             progress: Callable[[int, int], None] | None = None, guard: ReplyGuard = ReplyGuard()) -> EvalResult:
    result = EvalResult(engine.path, policy.name, str(engine.device), len(chats))
    result.phrasing = chats[0].phrasing if chats else "train"
    lengths, started = [], time.perf_counter()
    for n, dlg in enumerate(chats):
        lengths.append(_run_chat(engine, policy, dlg, max_new_tokens, result, guard))
        if progress:
            progress(n + 1, len(chats))
    result.seconds = time.perf_counter() - started
    result.min_chat_rounds = min((len(d.rounds) for d in chats), default=0)
    result.min_chat_tokens = min(lengths, default=0)
    result.mean_chat_tokens = sum(lengths) / len(lengths) if lengths else 0.0
    return result


def _run_chat(engine: Engine, policy: KVPolicy, dlg: Dialogue, max_new: int, result: EvalResult,
              guard: ReplyGuard) -> int:
    """Tiered policies run on a TieredKV, where every round (asked or not) is read under the policy, as in a chat."""
    chat = engine.chat
    tiered = policy.tiered
    cache = TieredKV(engine.model, policy, 4096) if tiered else engine.new_cache(4096)
    closed = chat.round_spans(Conversation(dlg.rounds, dlg.system))
    questions = {q.round_index: q for q in dlg.questions}
    out_of_scope = {o.round_index: o.kind for o in dlg.out_of_scope}
    round_starts: list[int] = []
    history: list[int] = []
    for i, rnd in enumerate(dlg.rounds):
        start = cache.length
        q = questions.get(i)
        undo = None
        if q is not None or i in out_of_scope:
            prompt = chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
            if not tiered:  # the history as the policy gives it to a new message (Krul: merged layers)
                undo = policy.prepare(engine.model, cache, round_starts, history)
                if hasattr(policy, "last_pairs") and round_starts:
                    result.merged_fractions.append(2 * len(policy.last_pairs) / engine.config.n_layers)
            visible = None if tiered else policy.visible_slots(cache, round_starts, prompt, model=engine.model)
            out = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(),
                           max_tokens=max_new, stop_tokens=engine.tokenizer.eog_ids,
                           stop_strings=chat.stop_strings, attend=visible, policy=policy, **engine.guarding(guard))
            ok = reply_matches(out.text, rnd.assistant)
            result.stop_reasons[out.stop_reason] += 1
            result.longest_reply = max(result.longest_reply, len(out.tokens))
            result.tokens += len(prompt) + len(out.tokens)
        if q is None and i in out_of_scope:
            _score_out_of_scope(result, out_of_scope[i], rnd.user, out, ok)
        elif q is not None:
            for table, key in ((result.by_kind, q.kind), (result.by_position, q.position),
                               (result.by_distance, q.distance_bucket), (result.by_stated, q.stated),
                               (result.by_asked, q.asked)):
                table[key].add(ok)
            result.overall.add(ok)
            if tiered and round_starts:
                result.kv_fractions.append(cache.device_bytes() / cache.full_bytes())
                kept = len(set(cache.stats.chosen) | set(cache.stats.added) | set(cache.stats.found))
                result.round_fractions.append(kept / len(round_starts))
            if not ok and len(result.failures) < 20:
                result.failures.append({"question": rnd.user[-120:], "expected": rnd.assistant, "got": out.text})
        if q is not None or i in out_of_scope:
            cache.truncate(start)
            if undo is not None:
                undo()
        round_starts.append(start)
        history += closed[i]
        if tiered:
            cache.prefill(closed[i])
            cache.close_round()
        else:
            prefill(engine.model, cache, closed[i])
        result.tokens += len(closed[i])
    return cache.length


def _score_out_of_scope(result: EvalResult, kind: str, prompt: str, out, expected: bool) -> None:
    polite = out.text.strip() in POLITE_REPLIES
    result.out_of_scope.add(polite)
    result.out_of_scope_by_kind[kind].add(polite)
    result.out_of_scope_expected += int(expected)
    if not polite:
        result.longest_other_reply = max(result.longest_other_reply, len(out.tokens))
        if len(result.failures) < 40:
            result.failures.append({"out_of_scope": kind, "prompt": prompt[-120:], "got": out.text})


@dataclass
class SampledReplies:
    """Replies sampled at a temperature with the guard off, where the chats ask or prompt something."""

    replies: int = 0
    temperature: float = 0.0
    reply_cap: int = 0
    looped: int = 0  # replies in which some stretch repeats as the guard would stop it
    over_cap: int = 0  # replies still going at the model's reply cap
    longest: int = 0  # tokens of the longest reply (generation ran to twice the cap)
    examples: list[str] = field(default_factory=list)  # a few of the replies that looped or ran on

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("replies", "temperature", "reply_cap", "looped", "over_cap",
                                              "longest", "examples")}


def sample_replies(engine: Engine, chats: list[Dialogue], count: int, temperature: float = 0.8, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> SampledReplies:
    """`count` replies sampled at `temperature` at the question and out-of-scope rounds of `chats` (in turn, as
    many chats as it takes), each allowed twice the model's reply cap with the guard off: how often the model
    itself loops or runs on, which the guard would stop."""
    guard = ReplyGuard()
    cap = guard.cap_for(engine.metadata) or 0
    out = SampledReplies(temperature=temperature, reply_cap=cap)
    chat = engine.chat
    for dlg in chats:
        cache = engine.new_cache(4096)
        closed = chat.round_spans(Conversation(dlg.rounds, dlg.system))
        asked = {q.round_index for q in dlg.questions} | {o.round_index for o in dlg.out_of_scope}
        for i, rnd in enumerate(dlg.rounds):
            if i in asked and out.replies < count:
                start = cache.length
                prompt = chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
                sampling = SamplingParams(temperature, seed=seed * 1_000_003 + out.replies)
                reply = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(),
                                 max_tokens=2 * cap, sampling=sampling, stop_tokens=engine.tokenizer.eog_ids,
                                 stop_strings=chat.stop_strings)
                _count_sample(out, reply.tokens, reply.text, guard, cap)
                cache.truncate(start)
            prefill(engine.model, cache, closed[i])
        if progress:
            progress(out.replies, count)
        if out.replies >= count:
            break
    return out


def _count_sample(out: SampledReplies, tokens: list[int], text: str, guard: ReplyGuard, cap: int) -> None:
    out.replies += 1
    out.longest = max(out.longest, len(tokens))
    looped = any(repeating_tail(tokens[:n], guard.min_repeats, guard.max_period, guard.min_span)
                 for n in range(guard.min_span, len(tokens) + 1))
    over = len(tokens) > cap
    out.looped += int(looped)
    out.over_cap += int(over)
    if (looped or over) and len(out.examples) < 10:
        out.examples.append(text[:200])
