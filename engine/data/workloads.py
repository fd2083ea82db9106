"""Long chats for the resume benchmark (`kvchat bench`), built to a token target with the model's own tokenizer.

Random-weight and real models get chats from the MT-Bench user questions (assets/mt_bench, Apache-2.0, see its
SOURCE.md): each question's two turns in order, answered by the GPT-4 reference answer where MT-Bench has one and
otherwise by other reference answers, cut or joined to a realistic length. The embedded model knows nothing of
such chats, so it gets its held-out memory dialogues instead, cut before a question, with one recall question per
fact known there. Everything is deterministic given the seed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from kvchat.assets import ASSETS
from kvchat.engine.data.dialogues import dialogues
from kvchat.engine.text.chat_format import ChatFormat, Conversation, Round
from kvchat.errors import KvchatError

# Workload name -> target tokens of the chat before the new message.
WORKLOADS = {"2k": 2048, "8k": 8192, "32k": 32768}
MIN_ROUNDS, MAX_ROUNDS = 10, 100
SYSTEM_PROMPT = "You are a helpful assistant."
MT_BENCH = ASSETS / "mt_bench"


@dataclass
class Workload:
    name: str
    target_tokens: int
    conversation: Conversation  # the old chat: closed rounds only
    new_message: str  # what the user sends on reopening it (not in the chat)
    tokens: int  # the chat's tokens in the model's template
    source: str  # "mt_bench" | "memory-dialogues"
    expected_reply: str | None = None  # memory dialogues: the answer the new message must get
    recall: list[Round] = field(default_factory=list)  # memory dialogues: further questions with their answers

    @property
    def rounds(self) -> int:
        return len(self.conversation.rounds)


def parse_workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise KvchatError(f"unknown workload {unknown[0] if unknown else text!r} "
                          f"(accepted: {', '.join(WORKLOADS)})")
    return names


@lru_cache(maxsize=1)
def mt_bench() -> tuple[list[dict], dict[tuple[int, int], str]]:
    """The 80 questions, and GPT-4's reference answer by (question id, turn)."""
    questions = [json.loads(line) for line in (MT_BENCH / "question.jsonl").read_text().splitlines() if line]
    answers = {}
    for line in (MT_BENCH / "reference_answer_gpt-4.jsonl").read_text().splitlines():
        if line:
            row = json.loads(line)
            for turn, text in enumerate(row["choices"][0]["turns"]):
                answers[(row["question_id"], turn)] = text
    return questions, answers


def _cut(text: str, chars: int) -> str:
    """`text` shortened to about `chars` characters, at a sentence or line end where there is one."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    ends = [m.end() for m in re.finditer(r"[.!?:]\s|\n", head)]
    return head[: ends[-1]].rstrip() if ends and ends[-1] > chars // 2 else head.rstrip()


def _reply(rng: random.Random, own: str | None, pool: list[str], chars: int) -> str:
    """An assistant turn of about `chars` characters: the question's own reference answer when there is one, then
    other reference answers joined after it (long chats have long replies), cut at a sentence end."""
    parts = [own] if own else []
    while sum(len(p) + 2 for p in parts) < chars:
        parts.append(rng.choice(pool))
    return _cut("\n\n".join(parts), chars)


def mt_bench_workload(chat: ChatFormat, name: str, seed: int = 0, target: int | None = None) -> Workload:
    """A chat of MIN_ROUNDS..MAX_ROUNDS rounds whose tokens are within a few percent of the target."""
    target = target or WORKLOADS[name]
    questions, answers = mt_bench()
    pool = list(answers.values())
    encode = chat.tokenizer.encode
    chars_per_token = sum(map(len, pool)) / sum(len(encode(a, add_bos=False, special=False)) for a in pool)
    natural = sum(len(encode(a, add_bos=False, special=False)) for a in pool) / len(pool)
    rounds_goal = min(MAX_ROUNDS, max(MIN_ROUNDS, round(target / (natural + 60))))
    order = random.Random(f"mt_bench:{seed}").sample(questions, len(questions))
    # Short chats leave no room for MT-Bench's longest prompts (a pasted text to edit or extract from): ten rounds
    # of them alone would pass 2k tokens with some tokenizers.
    longest = 0.6 * target / MIN_ROUNDS
    fitting = [q for q in order if all(len(encode(u, add_bos=False, special=False)) <= longest for u in q["turns"])]
    turns = [(q, t) for q in fitting for t in (0, 1)]
    scale = 1.0
    for _ in range(8):  # adjust the reply length until the round count lands inside the bounds
        rng = random.Random(f"mt_bench-replies:{seed}:{name}")
        per_round = scale * target / rounds_goal
        rounds = []
        for q, t in turns[: MAX_ROUNDS + 20]:
            user = q["turns"][t]
            user_tokens = len(encode(user, add_bos=False, special=False))
            want = max(8.0, per_round - user_tokens - 12) * rng.uniform(0.6, 1.4)
            rounds.append(Round(user, _reply(rng, answers.get((q["question_id"], t)), pool,
                                             int(want * chars_per_token))))
        conv = Conversation(rounds, SYSTEM_PROMPT)
        spans = chat.round_spans(conv)
        total, best = 0, None
        for n, span in enumerate(spans, 1):
            total += len(span)
            if best is None or abs(total - target) < abs(best[1] - target):
                best = (n, total)
            if total > target:
                break
        if best is None:  # no question is short enough in this tokenizer's tokens
            break
        n, tokens = best
        if total < target:
            scale *= 1.25 * target / total
        elif n < MIN_ROUNDS:
            scale *= n / MIN_ROUNDS * 0.9
        elif n > MAX_ROUNDS:
            scale *= n / MAX_ROUNDS * 1.1
        else:
            used = {q["question_id"] for q, _ in turns[:n]}
            fresh = next(q for q in order if q["question_id"] not in used)
            return Workload(name, target, Conversation(rounds[:n], SYSTEM_PROMPT), fresh["turns"][0], tokens,
                            "mt_bench")
    raise KvchatError(f"cannot build a {name} chat of {MIN_ROUNDS}..{MAX_ROUNDS} rounds with this tokenizer")


def memory_workload(chat: ChatFormat, name: str, seed: int = 0, target: int | None = None) -> Workload:
    """A held-out memory dialogue cut right before the question round whose position is nearest the target; the
    question is the new message, and every fact known there is asked again for recall accuracy."""
    target = target or WORKLOADS[name]
    per_round = 46  # memory-dialogue rounds are about this long in the embedded model's tokens
    low = min(MAX_ROUNDS - 8, max(MIN_ROUNDS, int(target / per_round)))
    best = None
    for dlg in dialogues("heldout", 40, 1000 + seed, low + 2, min(MAX_ROUNDS, low + 12)):
        spans = chat.round_spans(Conversation(dlg.rounds, dlg.system))
        start = 0
        for i, span in enumerate(spans):
            if i >= MIN_ROUNDS and any(q.round_index == i for q in dlg.questions):
                if best is None or abs(start - target) < abs(best[2] - target):
                    best = (dlg, i, start)
            start += len(span)
        if best is not None and abs(best[2] - target) <= 0.05 * target:
            break
    if best is None:
        raise KvchatError(f"no held-out memory dialogue fits the {name} workload")
    dlg, q, tokens = best
    return Workload(name, target, Conversation(dlg.rounds[:q], dlg.system), dlg.rounds[q].user, tokens,
                    "memory-dialogues", expected_reply=dlg.rounds[q].assistant, recall=dlg.recall_rounds(q))


def build_workload(chat: ChatFormat, name: str, memory: bool, seed: int = 0) -> Workload:
    return memory_workload(chat, name, seed) if memory else mt_bench_workload(chat, name, seed)
