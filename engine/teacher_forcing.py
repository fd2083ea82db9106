"""Teacher forcing a chat's last reply through a KV policy: the next-token logits a policy gives at each position of
a known reply, which `kvchat eval --text` (app/bench/fidelity.py) compares with the full cache's and XKV's layer-cost
calibration (engine/calibrate/layer_costs.py) measures each layer's budget by.

The history is read round by round (a tiered policy's cache closes each round, as in a chat), the last round's
prompt is prefilled under the policy, and then the reply's own tokens are fed one decode step at a time through the
policy's decode path (its CUDA graphs, progressive selection and rechecks included), so what is measured is what a
user's reply would be computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.data.workloads import mt_bench_workload
from kvchat.engine.generate import decode_steps, prefill
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.tiered import TieredKV
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.text.chat_format import Conversation
from kvchat.errors import KvchatError


@dataclass
class TextChat:
    """One chat's teacher-forcing material: the history's rounds, the last round's prompt, its reply tokens."""

    name: str
    history: list[list[int]]
    prompt: list[int]
    reply: list[int]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.history)) + len(self.prompt) + len(self.reply)

    @property
    def history_tokens(self) -> int:
        return sum(map(len, self.history))


def text_chats(engine, length: int, count: int, max_positions: int, seed: int = 0) -> list[TextChat]:
    """`count` MT-Bench chats of about `length` tokens (chat i from seed `seed` + i), each cut to at most
    `max_positions` tokens of its last reply (the MT-Bench reference answer)."""
    chats = []
    for i in range(count):
        work = mt_bench_workload(engine.chat, f"text-{length}-{i}", seed=seed + i, target=length)
        conv = work.conversation
        spans = engine.chat.round_spans(conv)
        head = Conversation(conv.rounds[:-1], conv.system)
        prompt = engine.chat.open_round_tokens(head, conv.rounds[-1].user)
        last = spans[-1]
        if last[: len(prompt)] != prompt or len(last) <= len(prompt):
            raise KvchatError(f"the chat template splits the last round of a {length}-token chat unevenly")
        chats.append(TextChat(work.name, spans[:-1], prompt, last[len(prompt):][:max_positions]))
    return chats


def history_cache(engine, chat: TextChat) -> KVCache:
    """The full cache of `chat`'s history alone, for `forced_logits` to run many policies from without reading the
    history again (a plain cache: no rings, which a prompt and reply would overwrite)."""
    cache = engine.model.new_cache(chat.tokens + 8)
    for span in chat.history:
        prefill(engine.model, cache, span)
    return cache


@torch.inference_mode()
def forced_logits(engine, policy: KVPolicy, chat: TextChat, read: KVCache | None = None) -> torch.Tensor:
    """The next-token logits [len(reply), V] (float32, on the model's device) at each reply position, the reply's
    tokens fed through the policy's decode path one at a time.

    `read`: the history already read (`history_cache`), for a policy that runs on a plain cache (not tiered, no
    cache of its own) and changes no history slot (a layer-budget policy); it is left holding the history again."""
    model, n = engine.model, len(chat.reply)
    capacity = chat.tokens + 8
    round_starts: list[int] = []  # a plain cache's, where each history round begins
    visible, undo = None, None
    if policy.tiered:
        if read is not None:
            raise ValueError("a tiered policy reads the history round by round into its own cache")
        cache = TieredKV(model, policy, capacity)
        for span in chat.history:
            cache.prefill(span)
            cache.close_round()
        rows = [cache.prefill(chat.prompt)]
    else:
        if read is not None and (not _leaves_history_alone(policy) or read.length != chat.history_tokens
                                 or read.ring_size):
            raise ValueError("a read history is for the full cache or a layer budget on a plain cache, and must "
                             "hold the chat's history")
        cache = read if read is not None else (policy.chat_cache(model, capacity) or model.new_cache(capacity))
        round_starts = _round_starts(chat.history)
        if read is None:
            for span in chat.history:
                prefill(model, cache, span)
        undo = policy.prepare(model, cache, round_starts, [t for span in chat.history for t in span])
    try:
        if not policy.tiered:
            visible = policy.visible_slots(cache, round_starts, chat.prompt, model=model)
            rows = [prefill(model, cache, chat.prompt, attend=visible)]
        # the prompt's view of the history goes on as it grows (restricted views); graphs, tiered steps otherwise
        step = decode_steps(model, cache, n, capacity, visible, first=chat.history_tokens, policy=policy)
        for token in chat.reply[:-1]:
            rows.append(step(token).clone())
    finally:
        if undo is not None:  # a model-wide setting (LoopServe's sparse prefill) ends with the chat
            undo()
        if read is not None:
            read.truncate(chat.history_tokens)
    return torch.stack(rows).float()


def position_kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) at each position of next-token logits [n, V] -> [n] (rounding can dip a hair below 0: clamped)."""
    ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
    return (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0)


def _leaves_history_alone(policy: KVPolicy) -> bool:
    """The policies a read history is shared by: the full cache and the layer budgets on the device (they read the
    history and write only after it; a host-resident one keeps a cache of its own)."""
    from kvchat.engine.policies.budgets import LayerBudgetPolicy
    from kvchat.engine.policies.full import FullKV

    return isinstance(policy, FullKV) or (isinstance(policy, LayerBudgetPolicy) and not policy.host_resident)


def _round_starts(history: list[list[int]]) -> list[int]:
    starts, at = [], 0
    for span in history:
        starts.append(at)
        at += len(span)
    return starts
