"""Recall of prompt-time top-k plus decode-time selection at layer w, simulated with attention masks on a full cache
(only the asked round under the policy). Decode modes: none, topN (the N rounds of most mass per token), thrX
(rounds with at least X of the non-sink mass). -v prints each miss with the rounds that held the value.

    .venv/bin/python docs/probes/round_progressive.py W K MODE CHATS [SKIP] [-v]   # e.g. 3 0.1 top1 10
"""
import sys
import time

import torch

from kvchat.engine.policies.round_attention import select_rounds
from kvchat.kernels.round_scores import round_mass_ref
from probe_chats import Recall, asked_rounds, greedy, load

lw, k, mode, n_chats = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
skip = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5].isdigit() else 0
eng, chats = load(n_chats, skip)
m, L = eng.model, eng.config.n_layers


def mass_at(h, pos, a):
    """Per-round mass at the watershed, the first round left out and the rest renormalized."""
    mass = round_mass_ref(m.layers[lw].queries(h, m.rope(pos)), a.cache.kv[lw, 0, :, :a.base], torch.tensor(a.starts))
    mass[0] = 0
    return mass / mass.sum()


def picked_while_decoding(mass):
    if mode == "none":
        return set()
    if mode.startswith("top"):
        return set(torch.topk(mass, min(int(mode[3:]), mass.numel())).indices.tolist())
    if mode.startswith("thr"):
        return set((mass >= float(mode[3:])).nonzero().flatten().tolist()) | {int(mass.argmax())}
    raise SystemExit(f"unknown decode mode {mode}")


recall, t0 = Recall("-v" in sys.argv), time.time()
for a in asked_rounds(eng, chats):
    pos = torch.arange(a.base, a.base + len(a.prompt))
    h = m.run_layers(m.embed(torch.tensor(a.prompt)), pos, a.cache, a.base, layers=range(lw + 1))
    chosen = set(select_rounds(mass_at(h, pos, a), "topk", k)) | {0}
    at_prompt = set(chosen)
    h = m.run_layers(h, pos, a.cache, a.base, layers=range(lw + 1, L), attend=a.slots(chosen, a.base))
    a.cache.length = a.base + len(a.prompt)

    def step(token):
        s = a.cache.length
        p = torch.tensor([s])
        hh = m.run_layers(m.embed(torch.tensor([token])), p, a.cache, s, layers=range(lw + 1))
        chosen.update(picked_while_decoding(mass_at(hh, p, a)))
        hh = m.run_layers(hh, p, a.cache, s, layers=range(lw + 1, L), attend=a.slots(chosen, s))
        a.cache.length = s + 1
        return int(m.head(hh)[-1].argmax())

    recall.add(a, greedy(eng, int(m.head(h[-1:])[-1].argmax()), step), at_prompt, chosen)
print(f"w={lw} k={k} decode={mode}: {recall.line()}; {time.time() - t0:.0f} s")
