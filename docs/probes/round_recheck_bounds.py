"""Rechecks from key summaries instead of every round's upper K/V (docs/benchmarks.md, "Cheap rechecks"): the same
walk as round_recheck.py (progressive top-1 at layer w, a token whose top probability is below TAU rechecked), but
the recheck scores every round from per-block key summaries with the queries the token already had (only the asked
round's own tokens and the rounds in view above w), brings in rounds whose estimated share reaches THETA at any
upper layer and runs the token again. It also counts the rounds the exact recheck (every round's keys and values in
view) would have found.

    .venv/bin/python docs/probes/round_recheck_bounds.py W TAU THETA CHATS BLOCK MODE   # e.g. 3 0.9 0.15 10 32 bound

MODE `bound`: per block the minimum and maximum of each key dimension, scored as the largest q . k they allow
(engine.kv.key_bounds); `mean`: the block's mean key, scored as q . mean (Jensen: under the real attention to a block
with one key that matches the query).
"""
import sys, time
import torch
from kvchat.engine.policies.round_attention import select_rounds
from probe_chats import ProgressiveDecode, Recall, asked_rounds, greedy, load, round_share

lw, tau, theta, n_chats, B = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
MODE = sys.argv[6]
eng, chats = load(n_chats)
m, L = eng.model, eng.config.n_layers


def mass_at(layer, h, pos, a):
    return round_share(eng, layer, h, pos, a)


def summaries(layer, a):
    k = a.cache.kv[layer, 0, :, :a.base].float()  # [Hkv, S, D]
    cs, ns, rs, b = [], [], [], a.bounds
    for r in range(len(a.starts)):
        for s in range(b[r], b[r + 1], B):
            blk = k[:, s:min(s + B, b[r + 1])]
            cs.append(torch.stack([blk.mean(1), blk.amin(1), blk.amax(1)], 0)); ns.append(blk.shape[1]); rs.append(r)
    return torch.stack(cs, 2), torch.tensor(ns, dtype=torch.float), torch.tensor(rs)


def estimate_at(layer, h, pos, a):
    q = m.layers[layer].queries(h, m.rope(pos)).float()  # [T, H, D]
    c, n, rs = summaries(layer, a)
    hkv = c.shape[1]
    qg = q[-1].view(hkv, q.shape[1] // hkv, -1)
    if MODE == "mean":
        dot = torch.einsum("grd,gbd->grb", qg, c[0])
    else:
        dot = torch.maximum(qg[:, :, None] * c[1][:, None], qg[:, :, None] * c[2][:, None]).sum(-1)
    p = torch.softmax(dot / q.shape[-1] ** 0.5 + n.log(), -1).sum((0, 1))
    mass = torch.zeros(len(a.starts)).index_add_(0, rs, p)
    mass[0] = 0
    return mass / mass.sum()


recall, t0 = Recall("-v" in sys.argv), time.time()
steps = rechecks = both = exact_found = est_found = 0
for a in asked_rounds(eng, chats):
    pos = torch.arange(a.base, a.base + len(a.prompt))
    h = m.run_layers(m.embed(torch.tensor(a.prompt)), pos, a.cache, a.base, layers=range(lw + 1))
    chosen = set(select_rounds(mass_at(lw, h, pos, a), "topk", 1)) | {0}
    at_prompt = set(chosen)
    hu = m.run_layers(h, pos, a.cache, a.base, layers=range(lw + 1, L), attend=a.slots(chosen, a.base))
    logits = m.head(hu[-1:])[-1]
    a.cache.length = a.base + len(a.prompt)

    def recheck(h0, p, s):
        global both, exact_found, est_found
        hh, found = h0, set()
        for layer in range(lw + 1, L):
            found.update((estimate_at(layer, hh, p, a) >= theta).nonzero().flatten().tolist())
            hh = m.run_layers(hh, p, a.cache, s, layers=range(layer, layer + 1), attend=a.slots(chosen, s))
        hx, exact = h0, set()
        for layer in range(lw + 1, L):
            exact.update((mass_at(layer, hx, p, a) >= 0.15).nonzero().flatten().tolist())
            hx = m.run_layers(hx, p, a.cache, s, layers=range(layer, layer + 1))
        exact -= chosen; found -= chosen
        exact_found += len(exact); est_found += len(found); both += len(exact & found)
        chosen.update(found)
        hh = m.run_layers(h0, p, a.cache, s, layers=range(lw + 1, L), attend=a.slots(chosen, s))
        return m.head(hh)[-1]

    step = ProgressiveDecode(eng, a, lw, chosen, tau, recheck)
    recall.add(a, greedy(eng, int(logits.argmax()), step), at_prompt, chosen)
    steps, rechecks = steps + step.steps, rechecks + step.rechecks
print(f"w={lw} {MODE} B={B} tau={tau} theta={theta}: {recall.line()}; rechecks {rechecks}/{steps}; rounds found: "
      f"exact {exact_found}, estimated {est_found}, both {both}; {time.time() - t0:.0f} s")
