"""Recall accuracy on held-out memory dialogues: the same chats, the same questions, for every KV policy.

Each chat is fed round by round into one KV cache, in one of two modes:

- **app** ("as the app answers", the headline): the model answers every round, greedily and under the generation
  guard as a user gets it, and its own reply stays in the chat, settled into the cache as `ChatSession.send` does.
  A wrong early reply is in the chat that later questions are asked in, as it would be for a user.
- **compare** ("policy comparison"): only question and out-of-scope rounds are answered; the cache is then rolled
  back and the round appended with its *expected* reply, so every policy sees the identical chat. This isolates
  what a KV policy costs, but it feeds the model answers it may not have given: in about a third of held-out
  questions the expected reply is already in the chat as an earlier expected reply.

A question counts when the reply equals the expected one exactly. Recall is reported per question kind, position,
distance and phrasing family, apart for *repeated* questions (the same expected reply was an earlier round's) and
for questions whose values training chats also use (weekdays and months). Every question is also scored on **exact
copy**: whether each value it asks for is in the reply byte for byte and whole (`copies_value`: not part of a longer
word or number), whatever the words around it; per value kind (a slot's pool, or a told-once item's kind) and
length. Told-once chats (engine/data/told_once.py: random values; app/bench/written_eval.py: the hand-written set),
whose replies' wording is free, are judged on it. Out-of-scope prompts (greetings, thanks, requests, questions
about something never told) are scored too: a reply counts as polite when it is one of the demo model's fixed short
replies. `sample_replies` samples replies at a temperature with the guard off, to count the ones that loop or run
past the cap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from kvchat.app.bench.written_eval import written_chats
from kvchat.app.session.chat import settled_prefix
from kvchat.engine.data.dialogues import POLITE_REPLIES, Dialogue, Question, dialogues, slot_for
from kvchat.engine.data.told_once import MIN_DISTANCE, ToldOnceQuestion, copies_value, random_value_chats
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate, prefill
from kvchat.engine.kv.tiered import TieredKV
from kvchat.engine.policies import KVPolicy
from kvchat.engine.reply_guard import ReplyGuard, repeating_tail
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.errors import ContextOverflowError

# How a chat is fed: the model's own replies kept (what a user gets), or the expected ones fed back.
MODES = ("app", "compare")
MODE_TITLES = {"app": "as the app answers", "compare": "policy comparison"}
# The report sets: four held-out seeds drawn at random on 2026-11-26 (Python's `secrets`), after every set looked
# at before (0-7) had been used to choose something. Each shipped model gets one figure on them, taken once it is
# chosen; nothing is ever chosen on them. `kvchat eval --report` runs them; the default --seed 0 is a development
# set. docs/embedded-model.md ("Which sets chose what") keeps the record.
REPORT_SEEDS = (53296, 87351, 387785, 874335)


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
    # "first": the expected reply was no earlier round's; "repeated": it was (the same question asked again).
    by_repeat: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    # "held-out": every value is one training chats never use; "seen-in-training": a weekday or month.
    by_values: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    # app mode: the replies to every other round (statements, small talk) equal to the chat's expected reply.
    other_replies: Tally = field(default_factory=Tally)
    # Out-of-scope prompts: `correct` counts polite replies (one of POLITE_REPLIES), per kind and in all.
    out_of_scope: Tally = field(default_factory=Tally)
    out_of_scope_by_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    out_of_scope_expected: int = 0  # the very reply the chat expected (e.g. "You haven't told me that yet.")
    longest_other_reply: int = 0  # tokens of the longest out-of-scope reply that was not a polite one
    longest_reply: int = 0  # tokens of the longest reply of all
    stop_reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phrasing: str = "train"
    mode: str = "app"
    tokens: int = 0
    seconds: float = 0.0
    min_chat_rounds: int = 0
    min_chat_tokens: int = 0
    mean_chat_tokens: float = 0.0
    failures: list[dict] = field(default_factory=list)
    # app mode: chats whose own replies outgrew the model's context before they ended ({"chat", "round", "tokens"});
    # their questions from there on count as not answered (recall and exact copy), not as an end of the eval
    context_full: list[dict] = field(default_factory=list)
    # Tiered policies: device K/V over a full cache's, and rounds kept over rounds, at each question (means).
    kv_fractions: list[float] = field(default_factory=list)
    round_fractions: list[float] = field(default_factory=list)
    merged_fractions: list[float] = field(default_factory=list)  # Krul: share of layers merged, at each question
    # Exact copy: a question counts when every value it asks for is in the reply byte for byte (copies_value); per
    # value, by its kind (a slot's pool, or a told-once item's kind) and by its length in characters.
    exact_copy: Tally = field(default_factory=Tally)
    exact_copy_by_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    exact_copy_by_length: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))

    @property
    def accuracy(self) -> float:
        return self.overall.accuracy

    def as_dict(self) -> dict:
        def table(t: dict[str, Tally]) -> dict:
            return {k: {"questions": v.questions, "correct": v.correct, "accuracy": round(v.accuracy, 4)}
                    for k, v in sorted(t.items(), key=lambda kv: _sort_key(kv[0]))}

        plain = ("model", "policy", "device", "mode", "phrasing", "chats", "tokens", "seconds", "min_chat_rounds",
                 "min_chat_tokens", "mean_chat_tokens", "longest_reply", "failures", "context_full")
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
                "by_asked": table(self.by_asked), "by_repeat": table(self.by_repeat),
                "by_values": table(self.by_values),
                "exact_copy": {"questions": self.exact_copy.questions, "correct": self.exact_copy.correct,
                               "accuracy": round(self.exact_copy.accuracy, 4),
                               "by_kind": table(self.exact_copy_by_kind),
                               "by_length": table(self.exact_copy_by_length)},
                **({"other_replies": {"replies": self.other_replies.questions,
                                      "as_expected": self.other_replies.correct}} if self.mode == "app" else {}),
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


def value_kinds(q: Question) -> tuple[str, ...]:
    """The kind of each value `q` asks for: a told-once question's own, else its slot's pool ("names", ...)."""
    if isinstance(q, ToldOnceQuestion):
        return (q.value_kind,) * len(q.values)
    return tuple(slot_for(k).field for k in q.keys)


def length_bucket(value: str) -> str:
    n = len(value)
    return "1-4 chars" if n <= 4 else "5-8 chars" if n <= 8 else "9-16 chars" if n <= 16 else "17+ chars"


def _sort_key(label: str) -> tuple:
    digits = "".join(c for c in label.split("-")[0] if c.isdigit())
    return (int(digits), label) if digits else (0, label)


def report_chats(count: int, min_rounds: int, max_rounds: int, engine: Engine | None = None, min_tokens: int = 0,
                 phrasing: str = "heldout") -> list[Dialogue]:
    """`count` held-out chats from each report set (REPORT_SEEDS), in order."""
    return [dlg for seed in REPORT_SEEDS
            for dlg in heldout_chats(count, seed, min_rounds, max_rounds, engine, min_tokens, phrasing)]


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


def told_once_eval_chats(phrasing: str, values: str, count: int | None, seed: int, min_rounds: int,
                         max_rounds: int, min_distance: int = MIN_DISTANCE) -> list[Dialogue]:
    """Told-once chats: with phrasing "written" the hand-written set (all of it, or its first `count` chats), else
    `count` chats of random values in `phrasing`'s templates (`values` "random")."""
    if phrasing == "written":
        if values != "heldout":
            raise ValueError("the written set has its own values: --values random is for the generator's phrasings")
        return written_chats(seed, min_rounds, max_rounds, min_distance, count)
    if values != "random":
        raise ValueError(f"told-once chats of {phrasing} phrasing take random values, not {values}")
    return random_value_chats(count or 1, seed, min_rounds, max_rounds, min_distance, phrasing)


def evaluate(engine: Engine, policy: KVPolicy, chats: list[Dialogue], max_new_tokens: int = 64,
             progress: Callable[[int, int], None] | None = None, guard: ReplyGuard = ReplyGuard(),
             mode: str = "app") -> EvalResult:
    """Recall over `chats` under `policy`, in `mode` (MODES: "app" keeps the model's own replies, "compare" feeds
    the expected ones back)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (accepted: {', '.join(MODES)})")
    result = EvalResult(engine.path, policy.name, str(engine.device), len(chats), mode=mode)
    result.phrasing = chats[0].phrasing if chats else "train"
    lengths, started = [], time.perf_counter()
    for n, dlg in enumerate(chats):
        lengths.append(_run_chat(engine, policy, dlg, max_new_tokens, result, guard, own_replies=mode == "app",
                                 number=n))
        if progress:
            progress(n + 1, len(chats))
    result.seconds = time.perf_counter() - started
    result.min_chat_rounds = min((len(d.rounds) for d in chats), default=0)
    result.min_chat_tokens = min(lengths, default=0)
    result.mean_chat_tokens = sum(lengths) / len(lengths) if lengths else 0.0
    return result


def _run_chat(engine: Engine, policy: KVPolicy, dlg: Dialogue, max_new: int, result: EvalResult,
              guard: ReplyGuard, own_replies: bool, number: int = 0) -> int:
    """Tiered policies run on a TieredKV, where every round (asked or not) is read under the policy, as in a chat.
    With `own_replies` every round is answered and its reply kept; else only the scored rounds are answered, and
    rolled back to the expected reply. A chat whose own replies outgrow the model's context stops there: its
    questions from that round on count as not answered (`EvalResult.context_full` says which chat and where)."""
    try:
        return _run_rounds(engine, policy, dlg, max_new, result, guard, own_replies)
    except _ContextFull as full:
        result.context_full.append({"chat": number, "round": full.round, "tokens": full.tokens})
        for i in range(full.round, len(dlg.rounds)):
            _score_unanswered(result, dlg, i)
        return full.tokens


class _ContextFull(Exception):
    def __init__(self, round_index: int, tokens: int):
        super().__init__(round_index, tokens)
        self.round, self.tokens = round_index, tokens


def _score_unanswered(result: EvalResult, dlg: Dialogue, i: int) -> None:
    """Round i of a chat that stopped before it: a question counts as missed (recall and exact copy), an
    out-of-scope prompt as not answered politely."""
    for q in dlg.questions:
        if q.round_index == i:
            values = "seen-in-training" if q.values_seen_in_training else "held-out"
            earlier = {r.assistant.strip() for r in dlg.rounds[:i]}
            repeat = "repeated" if dlg.rounds[i].assistant.strip() in earlier else "first"
            for table, key in ((result.by_kind, q.kind), (result.by_position, q.position),
                               (result.by_distance, q.distance_bucket), (result.by_stated, q.stated),
                               (result.by_asked, q.asked), (result.by_repeat, repeat), (result.by_values, values)):
                table[key].add(False)
            result.overall.add(False)
            result.exact_copy.add(False)
            for value, kind in zip(q.values, value_kinds(q)):
                result.exact_copy_by_kind[kind].add(False)
                result.exact_copy_by_length[length_bucket(value)].add(False)
            return
    for o in dlg.out_of_scope:
        if o.round_index == i:
            result.out_of_scope.add(False)
            result.out_of_scope_by_kind[o.kind].add(False)
            return


def _run_rounds(engine: Engine, policy: KVPolicy, dlg: Dialogue, max_new: int, result: EvalResult,
                guard: ReplyGuard, own_replies: bool) -> int:
    chat = engine.chat
    tiered = policy.tiered
    cache = TieredKV(engine.model, policy, 4096) if tiered else \
        policy.chat_cache(engine.model, 4096) or engine.new_cache(4096)  # host-resident: the policy's own
    questions = {q.round_index: q for q in dlg.questions}
    out_of_scope = {o.round_index: o.kind for o in dlg.out_of_scope}
    rounds: list[Round] = []  # the chat so far, as the model sees it
    round_starts: list[int] = []
    history: list[int] = []
    expected_before: set[str] = set()  # the expected replies of the rounds so far: a question's among them repeats
    for i, rnd in enumerate(dlg.rounds):
        start = cache.length
        q = questions.get(i)
        scored = q is not None or i in out_of_scope
        undo = out = None
        have: list[int] = []
        if scored or own_replies:
            prompt = chat.open_round_tokens(Conversation(rounds, dlg.system), rnd.user)
            if not tiered:  # the history as the policy gives it to a new message (Krul: merged layers)
                undo = policy.prepare(engine.model, cache, round_starts, history)
                if hasattr(policy, "last_pairs") and round_starts:
                    result.merged_fractions.append(2 * len(policy.last_pairs) / engine.config.n_layers)
            visible = None if tiered else policy.visible_slots(cache, round_starts, prompt, model=engine.model)
            try:
                out = generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(),
                               max_tokens=max_new, stop_tokens=engine.tokenizer.eog_ids,
                               stop_strings=chat.stop_strings, attend=visible, policy=policy,
                               **engine.guarding(guard))
            except ContextOverflowError:
                if undo is not None:
                    undo()
                raise _ContextFull(i, cache.length + len(prompt)) from None
            ok = reply_matches(out.text, rnd.assistant)
            result.stop_reasons[out.stop_reason] += 1
            result.longest_reply = max(result.longest_reply, len(out.tokens))
            result.tokens += len(prompt) + len(out.tokens)
            have = prompt + out.tokens[:-1]  # what generation computed K/V for (the last token was never fed)
        if q is None and i in out_of_scope:
            _score_out_of_scope(result, out_of_scope[i], rnd.user, out, ok)
        elif q is not None:
            repeat = "repeated" if rnd.assistant.strip() in expected_before else "first"
            values = "seen-in-training" if q.values_seen_in_training else "held-out"
            for table, key in ((result.by_kind, q.kind), (result.by_position, q.position),
                               (result.by_distance, q.distance_bucket), (result.by_stated, q.stated),
                               (result.by_asked, q.asked), (result.by_repeat, repeat), (result.by_values, values)):
                table[key].add(ok)
            result.overall.add(ok)
            copied = [copies_value(out.text, v) for v in q.values]
            result.exact_copy.add(all(copied))
            for value, kind, hit in zip(q.values, value_kinds(q), copied):
                result.exact_copy_by_kind[kind].add(hit)
                result.exact_copy_by_length[length_bucket(value)].add(hit)
            if tiered and round_starts:
                result.kv_fractions.append(cache.device_bytes() / cache.full_bytes())
                kept = len(set(cache.stats.chosen) | set(cache.stats.added) | set(cache.stats.found))
                result.round_fractions.append(kept / len(round_starts))
            # a told-once reply's wording is free: it fails when it does not copy the value
            if (not all(copied) if isinstance(q, ToldOnceQuestion) else not ok) and len(result.failures) < 20:
                result.failures.append({"question": rnd.user[-120:], "expected": rnd.assistant, "got": out.text,
                                        "exact_copy": all(copied)})
        elif out is not None:
            result.other_replies.add(ok)
        expected_before.add(rnd.assistant.strip())
        rounds.append(Round(rnd.user, out.text if own_replies else rnd.assistant))
        closed = chat.round_spans(Conversation(rounds, dlg.system))[-1]
        # As ChatSession settles a round: keep the K/V generation computed where they are the closed round's
        # tokens, compute the rest; a rolled-back round keeps nothing of its reply.
        common = settled_prefix(have, closed) if own_replies else 0
        if cache.length != start + common:
            cache.truncate(start + common)
        if undo is not None:
            undo()
        round_starts.append(start)
        history += closed
        if tiered:
            if common < len(closed):
                cache.prefill(closed[common:])
            cache.close_round()
        elif common < len(closed):
            prefill(engine.model, cache, closed[common:])
        result.tokens += len(closed) - common
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
