"""What the round-selection probes share: the engine and held-out chats of `kvchat eval`, a walk over their asked
rounds with a full cache holding the chat before each, greedy decoding, and a recall tally that explains misses."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.text.chat_format import Conversation
from kvchat.engine.data.dialogues import Dialogue, Question
from kvchat.engine.engine import Engine
from kvchat.app.bench.evaluate import heldout_chats, reply_matches
from kvchat.engine.generate import prefill
from kvchat.engine.kv.cache import KVCache

torch.set_grad_enabled(False)


def load(n_chats: int, skip: int = 0) -> tuple[Engine, list[Dialogue]]:
    engine = Engine(DEFAULT_MODEL, device="cpu")
    return engine, heldout_chats(n_chats + skip, 0, 44, 52, engine, 2000)[skip:]


@dataclass
class Asked:
    dlg: Dialogue
    index: int  # the round that asks
    question: Question
    prompt: list[int]  # the user message and the assistant header
    tokens: list[int]  # the whole round, expected reply included
    cache: KVCache  # the chat before the round; anything written past `base` is dropped after
    starts: list[int]  # the earlier rounds' first slots
    base: int

    @property
    def bounds(self) -> list[int]:
        return self.starts + [self.base]

    def sources(self, value: str) -> list[int]:
        """Earlier rounds whose text holds the value."""
        return [j for j in range(self.index) if value in self.dlg.rounds[j].user or value in self.dlg.rounds[j].assistant]

    def slots(self, rounds, end: int) -> torch.Tensor:
        """Cache slots of `rounds` and of the asked round's tokens before `end`."""
        b = self.bounds
        return torch.cat([torch.arange(b[r], b[r + 1]) for r in sorted(rounds)] + [torch.arange(self.base, end)])


def asked_rounds(engine: Engine, chats: list[Dialogue]) -> Iterator[Asked]:
    for dlg in chats:
        closed = engine.chat.round_spans(Conversation(dlg.rounds, dlg.system))
        cache, starts = engine.new_cache(4096), []
        questions = {q.round_index: q for q in dlg.questions}
        for i, rnd in enumerate(dlg.rounds):
            if i in questions:
                base = cache.length
                prompt = engine.chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
                yield Asked(dlg, i, questions[i], prompt, closed[i], cache, list(starts), base)
                cache.truncate(base)
            starts.append(cache.length)
            prefill(engine.model, cache, closed[i])


def greedy(engine: Engine, first: int, step: Callable[[int], int], max_tokens: int = 48) -> str:
    """Decode from `first`; `step(token)` runs one token and returns the next."""
    out, token = [], first
    for _ in range(max_tokens):
        if token in engine.tokenizer.eog_ids:
            break
        out.append(token)
        token = step(token)
    return engine.tokenizer.decode(out)


class Recall:
    def __init__(self, verbose: bool = False):
        self.asked = self.correct = 0
        self.kept: list[float] = []
        self.misses: Counter = Counter()
        self.verbose = verbose

    def add(self, a: Asked, got: str, at_prompt: set[int], kept: set[int]) -> None:
        expected = a.dlg.rounds[a.index].assistant
        good = reply_matches(got, expected)
        self.asked += 1
        self.correct += good
        self.kept.append(len(kept) / len(a.starts))
        if not good:
            self.misses[a.question.kind] += 1
            if self.verbose:
                sources = {v: a.sources(v) for v in a.question.values}
                print(f"{a.question.kind:9} d={a.question.distance:2} sources={sources} prompt={sorted(at_prompt)} "
                      f"all={sorted(kept)}\n   expected={expected!r}\n   got={got!r}")

    def line(self) -> str:
        return (f"recall {self.correct}/{self.asked} = {self.correct / self.asked:.3f}; "
                f"rounds kept {sum(self.kept) / len(self.kept):.3f}; misses {dict(self.misses)}")


def round_share(engine: Engine, layer: int, h: torch.Tensor, pos: torch.Tensor, a: Asked) -> torch.Tensor:
    """Each earlier round's share of the attention of the tokens at `pos` (hidden states h entering `layer`) at that
    layer, the first round (the attention sink) left out: [R], summing to 1."""
    from kvchat.kernels.round_scores import round_mass_ref

    m = engine.model
    mass = round_mass_ref(m.layers[layer].queries(h, m.rope(pos)), a.cache.kv[layer, 0, :, :a.base],
                          torch.tensor(a.starts))
    mass[0] = 0
    return mass / mass.sum()


class ProgressiveDecode:
    """One greedy step per call: layers up to lw see every round and name the round of most mass (kept from then on),
    the upper layers see the kept rounds; a token whose top probability is below tau gets its logits from
    `recheck(h0, positions, slot)` (h0: its hidden state after layer lw) instead."""

    def __init__(self, engine: Engine, a: Asked, lw: int, chosen: set[int], tau: float, recheck: Callable):
        self.engine, self.a, self.lw, self.chosen, self.tau, self.recheck = engine, a, lw, chosen, tau, recheck
        self.steps = self.rechecks = 0

    def __call__(self, token: int) -> int:
        from kvchat.engine.policies.round_attention import select_rounds

        m, a, lw = self.engine.model, self.a, self.lw
        s = a.cache.length
        p = torch.tensor([s])
        h0 = m.run_layers(m.embed(torch.tensor([token])), p, a.cache, s, layers=range(lw + 1))
        self.chosen.update(select_rounds(round_share(self.engine, lw, h0, p, a), "topk", 1))
        hh = m.run_layers(h0, p, a.cache, s, layers=range(lw + 1, m.cfg.n_layers), attend=a.slots(self.chosen, s))
        logits = m.head(hh)[-1]
        self.steps += 1
        if torch.softmax(logits.float(), -1).max() < self.tau:
            self.rechecks += 1
            logits = self.recheck(h0, p, s)
        a.cache.length = s + 1
        return int(logits.argmax())
