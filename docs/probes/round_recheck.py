"""Recall of progressive top-1 selection at layer w plus rechecks, simulated with attention masks on a full cache
(only the asked round under the policy): a token whose top probability is below TAU is run again with every round
visible, and the rounds with at least THETA of its non-sink attention at any upper layer stay visible after it.
docs/benchmarks.md, "Recall with the checked watershed and rechecks".

    .venv/bin/python docs/probes/round_recheck.py W K TAU THETA CHATS [-v]   # e.g. 3 1 0.9 0.15 10
"""
import sys, time
import torch
from kvchat.engine.policies.round_attention import select_rounds
from probe_chats import ProgressiveDecode, Recall, asked_rounds, greedy, load, round_share

lw, k, tau, theta, n_chats = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
eng, chats = load(n_chats)
m, L = eng.model, eng.config.n_layers

def mass_at(layer, h, pos, a):
    return round_share(eng, layer, h, pos, a)

recall, t0 = Recall("-v" in sys.argv), time.time()
steps = falls = 0
for a in asked_rounds(eng, chats):
    pos = torch.arange(a.base, a.base + len(a.prompt))
    h = m.run_layers(m.embed(torch.tensor(a.prompt)), pos, a.cache, a.base, layers=range(lw + 1))
    chosen = set(select_rounds(mass_at(lw, h, pos, a), "topk", k)) | {0}
    at_prompt = set(chosen)
    hu = m.run_layers(h, pos, a.cache, a.base, layers=range(lw + 1, L), attend=a.slots(chosen, a.base))
    logits = m.head(hu[-1:])[-1]
    a.cache.length = a.base + len(a.prompt)

    def full_step(h0, p, s):
        hh = h0
        for layer in range(lw + 1, L):
            mass = mass_at(layer, hh, p, a)
            chosen.update((mass >= theta).nonzero().flatten().tolist())
            hh = m.run_layers(hh, p, a.cache, s, layers=range(layer, layer + 1))
        return m.head(hh)[-1]

    step = ProgressiveDecode(eng, a, lw, chosen, tau, full_step)

    first = int(logits.argmax())
    if torch.softmax(logits.float(), -1).max() < tau:
        falls += 1
        a.cache.length = a.base
        hh = h
        for layer in range(lw + 1, L):
            mass = mass_at(layer, hh, pos, a)
            chosen.update((mass >= theta).nonzero().flatten().tolist())
            hh = m.run_layers(hh, pos, a.cache, a.base, layers=range(layer, layer + 1))
        first = int(m.head(hh[-1:])[-1].argmax())
        a.cache.length = a.base + len(a.prompt)
    recall.add(a, greedy(eng, first, step), at_prompt, chosen)
    steps, falls = steps + step.steps, falls + step.rechecks
print(f"w={lw} k={k} tau={tau} theta={theta}: {recall.line()}; fallback steps {falls}/{steps}; {time.time() - t0:.0f} s")
