"""Where does the embedded model look a fact up? For each asked value of the held-out chats (teacher-forced), the
rank of the round holding it by attention mass, per layer: from the message's tokens (sum-prompt), from the reply
token that predicts the value's first piece (sum-step: heads summed; max-step: the strongest head); "#": numbers only.
Prints layer: top-1 / top-3 / values. docs/benchmarks.md, "Why round selection misses on the embedded model".

    .venv/bin/python docs/probes/round_sources.py 10     # the first 10 held-out chats of `kvchat eval`
"""
import sys, math, torch
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.evaluate import heldout_chats
from kvchat.engine.chat_format import Conversation
from kvchat.engine.generate import prefill

torch.set_grad_enabled(False)
eng = Engine(DEFAULT_MODEL, device="cpu")
m, L = eng.model, eng.config.n_layers
chats = heldout_chats(int(sys.argv[1]), 0, 44, 52, eng, 2000)

def head_mass(q, k, bounds):
    T, H, D = q.shape; rep = H // k.shape[0]
    keys = k.float().repeat_interleave(rep, 0)
    p = torch.softmax(torch.einsum("thd,hsd->hts", q.float(), keys) / math.sqrt(D), -1)  # H T S
    return torch.stack([p[:, :, bounds[r]:bounds[r+1]].sum(-1) for r in range(len(bounds)-1)], -1)  # H T R

stats = {}
def rec(key, rank):
    s = stats.setdefault(key, [0, 0, 0]); s[0] += rank == 0; s[1] += rank < 3; s[2] += 1
for dlg in chats:
    closed = eng.chat.round_spans(Conversation(dlg.rounds, dlg.system))
    cache, starts = eng.new_cache(4096), []
    qs = {q.round_index: q for q in dlg.questions}
    for i, rnd in enumerate(dlg.rounds):
        q = qs.get(i)
        if q is not None:
            base = cache.length
            toks = closed[i]
            prompt = eng.chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
            assert toks[:len(prompt)] == prompt
            pos = torch.arange(base, base + len(toks))
            bounds = starts + [base]
            h = m.embed(torch.tensor(toks)); rot = m.rope(pos)
            rep_ids = toks[len(prompt):]
            reply = eng.tokenizer.decode(rep_ids)
            steps = {}
            for v in q.values:
                c = reply.find(v)
                if c < 0: continue
                t0 = next(t for t in range(len(rep_ids)) if len(eng.tokenizer.decode(rep_ids[:t+1])) > c)
                steps[v] = len(prompt) + t0 - 1
            hh = h
            for l in range(L):
                qq = m.layers[l].queries(hh, rot)
                hm = head_mass(qq, cache.kv[l, 0, :, :base], bounds)  # H T R
                for v in q.values:
                    src = [j for j in range(i) if v in dlg.rounds[j].user or v in dlg.rounds[j].assistant]
                    if not src or v not in steps: continue
                    step = steps[v]
                    for name, sc in (("sum-prompt", hm[:, :len(prompt)].sum((0, 1))),
                                     ("sum-step", hm[:, step].sum(0)),
                                     ("max-step", hm[:, step].max(0).values),
                                     ("sum-reply", hm[:, len(prompt)-1:step+1].sum((0, 1)))):
                        sc = sc.clone(); sc[0] = -1
                        order = torch.argsort(sc, descending=True).tolist()
                        rank = min(order.index(j) for j in src)
                        rec((name + ("#" if v[0].isdigit() else ""), l), rank)
                hh = m.run_layers(hh, pos, cache, base, layers=range(l, l + 1))
            cache.truncate(base)
        starts.append(cache.length)
        prefill(m, cache, closed[i])
for name in [n + t for n in ("sum-prompt", "sum-step", "max-step") for t in ("", "#")]:
    print(name.ljust(11), " ".join(f"L{l}:{stats[(name,l)][0]}/{stats[(name,l)][1]}/{stats[(name,l)][2]}" for l in range(L)))
