"""An oracle for decode-time retrieval at every upper layer (it reads every round's upper keys, which the tiered
cache does not hold on the device): a round is brought in when a decoded token's query at some upper layer would
give it at least TAU of the non-sink attention (-m: heads averaged; -hmax: the strongest head), or, without -m,
when a page of P keys could reach a logit within TAU of the best resident key (Quest's per-channel bound).
-w1 also adds the top round at the watershed per token; -p retrieves for the prompt's tokens too.

    .venv/bin/python docs/probes/round_oracle.py W K TAU P CHATS -m      # e.g. 2 0.1 0.15 1 10 -m
"""
import math
import sys
import time

import torch

from kvchat.engine.policies.round_attention import select_rounds
from kvchat.kernels.round_scores import round_mass_ref
from probe_chats import Recall, asked_rounds, greedy, load

lw, k, tau, page, n_chats = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
flags = set(sys.argv[6:])
eng, chats = load(n_chats)
m, L = eng.model, eng.config.n_layers


def page_bounds(keys, bounds):
    """Per round, per page of `page` keys: the keys' per-channel min and max [Hkv, pages, D]."""
    out = []
    for r in range(len(bounds) - 1):
        kk = keys[:, bounds[r]:bounds[r + 1]].float()
        pad = (-kk.shape[1]) % page
        if pad:
            kk = torch.cat([kk, kk[:, -1:].expand(-1, pad, -1)], 1)
        kk = kk.view(kk.shape[0], -1, page, kk.shape[2])
        out.append((kk.amin(2), kk.amax(2)))
    return out


def by_mass(q, layer, a, chosen, end):
    """Rounds not chosen that would get at least tau of the attention (the first round's share left out)."""
    rep = q.shape[1] // a.cache.kv.shape[2]
    keys = a.cache.kv[layer, 0, :, :end].float().repeat_interleave(rep, 0)
    p = torch.softmax(torch.einsum("thd,hsd->ths", q.float() / math.sqrt(q.shape[-1]), keys), -1)  # T H S
    b = a.bounds
    per = torch.stack([p[..., b[r]:b[r + 1]].sum(-1) for r in range(len(b) - 1)], -1)  # T H R
    per = per.amax(1) if "-hmax" in flags else per.mean(1)
    per[:, 0] = 0
    return {r for r in (per >= tau).any(0).nonzero().flatten().tolist() if r not in chosen}


def by_bound(q, layer, a, chosen, end, bounds_of):
    """Rounds not chosen with a page whose bound comes within tau of the best resident logit."""
    rep = q.shape[1] // a.cache.kv.shape[2]
    qf = q.float() / math.sqrt(q.shape[-1])
    resident = a.cache.kv[layer, 0][:, a.slots(chosen, end)].float().repeat_interleave(rep, 0)  # H S D
    best = torch.einsum("thd,hsd->ths", qf, resident).amax(-1)  # T H
    add = set()
    for r, (lo, hi) in enumerate(bounds_of[layer]):
        if r in chosen:
            continue
        lo, hi = lo.repeat_interleave(rep, 0), hi.repeat_interleave(rep, 0)  # H pages D
        bound = torch.maximum(torch.einsum("thd,hpd->thpd", qf, lo), torch.einsum("thd,hpd->thpd", qf, hi))
        if bool((bound.sum(-1).amax(-1) >= best - tau).any()):
            add.add(r)
    return add


def retrieve(h, pos, layer, a, chosen, end, bounds_of):
    q = m.layers[layer].queries(h, m.rope(pos))
    return by_mass(q, layer, a, chosen, end) if "-m" in flags else by_bound(q, layer, a, chosen, end, bounds_of)


recall, t0 = Recall("-v" in flags), time.time()
for a in asked_rounds(eng, chats):
    bounds_of = {} if "-m" in flags else {l: page_bounds(a.cache.kv[l, 0, :, :a.base], a.bounds) for l in range(lw + 1, L)}
    pos = torch.arange(a.base, a.base + len(a.prompt))
    h = m.run_layers(m.embed(torch.tensor(a.prompt)), pos, a.cache, a.base, layers=range(lw + 1))
    mass = round_mass_ref(m.layers[lw].queries(h, m.rope(pos)), a.cache.kv[lw, 0, :, :a.base], torch.tensor(a.starts))
    mass[0] = 0
    chosen = set(select_rounds(mass / mass.sum(), "topk", k)) | {0}
    at_prompt = set(chosen)
    for l in range(lw + 1, L):
        if "-p" in flags:
            chosen |= retrieve(h, pos, l, a, chosen, a.base, bounds_of)
        h = m.run_layers(h, pos, a.cache, a.base, layers=range(l, l + 1), attend=a.slots(chosen, a.base))
    a.cache.length = a.base + len(a.prompt)

    def step(token):
        s = a.cache.length
        p = torch.tensor([s])
        hh = m.run_layers(m.embed(torch.tensor([token])), p, a.cache, s, layers=range(lw + 1))
        if "-w1" in flags:
            md = round_mass_ref(m.layers[lw].queries(hh, m.rope(p)), a.cache.kv[lw, 0, :, :a.base], torch.tensor(a.starts))
            md[0] = 0
            chosen.add(int(md.argmax()))
        for l in range(lw + 1, L):
            chosen.update(retrieve(hh, p, l, a, chosen, s, bounds_of))
            hh = m.run_layers(hh, p, a.cache, s, layers=range(l, l + 1), attend=a.slots(chosen, s))
        a.cache.length = s + 1
        return int(m.head(hh)[-1].argmax())

    recall.add(a, greedy(eng, int(m.head(h[-1:])[-1].argmax()), step), at_prompt, chosen)
print(f"w={lw} k={k} tau={tau} page={page} {' '.join(sorted(flags))}: {recall.line()}; {time.time() - t0:.0f} s")
