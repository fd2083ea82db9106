"""Where does the embedded model look a fact up? For each asked value of the held-out chats (teacher-forced), the
rank of the round holding it by attention mass, per layer: from the message's tokens (sum-prompt), from the reply
token that predicts the value's first piece (sum-step: heads summed; max-step: the strongest head); "#": numbers only.
Prints layer: top-1 / top-3 / values. docs/benchmarks.md, "Why round selection misses on the embedded model".

    .venv/bin/python docs/probes/round_sources.py 10     # the first 10 held-out chats of `kvchat eval`
"""
import math
import sys
from collections import defaultdict

import torch

from probe_chats import asked_rounds, load

eng, chats = load(int(sys.argv[1]))
m, L = eng.model, eng.config.n_layers


def head_mass(q, k, bounds):
    """Per head, query row and round: attention mass [H, T, R]."""
    rep = q.shape[1] // k.shape[0]
    keys = k.float().repeat_interleave(rep, 0)
    p = torch.softmax(torch.einsum("thd,hsd->hts", q.float(), keys) / math.sqrt(q.shape[-1]), -1)
    return torch.stack([p[:, :, bounds[r]:bounds[r + 1]].sum(-1) for r in range(len(bounds) - 1)], -1)


def value_rows(a) -> dict[str, int]:
    """Each asked value -> the row of the round's tokens whose query predicts the value's first piece."""
    reply_ids = a.tokens[len(a.prompt):]
    reply = eng.tokenizer.decode(reply_ids)
    rows = {}
    for v in a.question.values:
        at = reply.find(v)
        if at >= 0:
            first = next(t for t in range(len(reply_ids)) if len(eng.tokenizer.decode(reply_ids[:t + 1])) > at)
            rows[v] = len(a.prompt) + first - 1
    return rows


hits = defaultdict(lambda: [0, 0, 0])  # (measure, layer) -> [top-1, top-3, values]
for a in asked_rounds(eng, chats):
    assert a.tokens[:len(a.prompt)] == a.prompt
    pos = torch.arange(a.base, a.base + len(a.tokens))
    h, rot, rows = m.embed(torch.tensor(a.tokens)), m.rope(pos), value_rows(a)
    for layer in range(L):
        mass = head_mass(m.layers[layer].queries(h, rot), a.cache.kv[layer, 0, :, :a.base], a.bounds)
        for v, row in rows.items():
            sources = a.sources(v)
            if not sources:
                continue
            for name, score in (("sum-prompt", mass[:, :len(a.prompt)].sum((0, 1))), ("sum-step", mass[:, row].sum(0)),
                                ("max-step", mass[:, row].max(0).values)):
                score = score.clone()
                score[0] = -1  # the first round (the attention sink) is always kept
                order = torch.argsort(score, descending=True).tolist()
                rank = min(order.index(j) for j in sources)
                tally = hits[(name + ("#" if v[0].isdigit() else ""), layer)]
                tally[0] += rank == 0
                tally[1] += rank < 3
                tally[2] += 1
        h = m.run_layers(h, pos, a.cache, a.base, layers=range(layer, layer + 1))
for name in [n + t for n in ("sum-prompt", "sum-step", "max-step") for t in ("", "#")]:
    print(name.ljust(11), " ".join(f"L{layer}:{'/'.join(map(str, hits[(name, layer)]))}" for layer in range(L)))
