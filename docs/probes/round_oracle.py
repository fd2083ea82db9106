"""An oracle for decode-time retrieval at every upper layer (it reads every round's upper keys, which the tiered
cache does not hold on the device): a round is brought in when a decoded token's query at some upper layer would
give it at least TAU of the non-sink attention (-m: heads averaged; -hmax: the strongest head), or, without -m,
when a page of P keys could reach a logit within TAU of the best resident key (Quest's per-channel bound).

    .venv/bin/python docs/probes/round_oracle.py W K TAU P CHATS -m      # e.g. 2 0.1 0.15 1 10 -m
"""
import sys, math, time, torch
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.evaluate import heldout_chats, reply_matches
from kvchat.engine.chat_format import Conversation
from kvchat.engine.generate import prefill
from kvchat.kernels.round_scores import round_mass_ref
from kvchat.engine.policies.round_attention import select_rounds

torch.set_grad_enabled(False)
eng = Engine(DEFAULT_MODEL, device="cpu")
m, L = eng.model, eng.config.n_layers
cfg = eng.config
lw = int(sys.argv[1]); k = float(sys.argv[2]); tau = float(sys.argv[3]); P = int(sys.argv[4]); nchats = int(sys.argv[5])
w_top1 = "-w1" in sys.argv; mass_mode = "-m" in sys.argv; verbose = "-v" in sys.argv; prompt_ret = "-p" in sys.argv
chats = heldout_chats(nchats, 0, 44, 52, eng, 2000)
D = cfg.head_dim if hasattr(cfg, "head_dim") else 32

def page_bounds(keys, bounds):
    """keys [Hkv, S, D]; -> list per round of (min [Hkv, np, D], max [Hkv, np, D])"""
    out = []
    for r in range(len(bounds) - 1):
        kk = keys[:, bounds[r]:bounds[r+1]].float()
        n = kk.shape[1]; pad = (-n) % P
        if pad:
            kk_min = torch.cat([kk, kk[:, -1:].expand(-1, pad, -1)], 1)
        else:
            kk_min = kk
        kk_min = kk_min.view(kk.shape[0], -1, P, kk.shape[2])
        out.append((kk_min.amin(2), kk_min.amax(2)))
    return out

def retrieve_mass(q, layer, cache, bounds, chosen, base, s, pb):
    Hkv = cache.kv.shape[2]; H = q.shape[1]; rep = H // Hkv
    keys = cache.kv[layer, 0, :, :s].float().repeat_interleave(rep, 0)
    p = torch.softmax(torch.einsum("thd,hsd->ths", q.float() / math.sqrt(q.shape[-1]), keys), -1)  # T H S
    per = torch.stack([p[..., bounds[r]:bounds[r+1]].sum(-1) for r in range(len(bounds) - 1)], -1)
    per = per.amax(1) if "-hmax" in sys.argv else per.mean(1)
    per[:, 0] = 0
    return {r for r in (per >= tau).any(0).nonzero().flatten().tolist() if r not in chosen}

def retrieve(q, layer, cache, bounds, chosen, base, s, pb):
    if mass_mode: return retrieve_mass(q, layer, cache, bounds, chosen, base, s, pb)
    """q [T, H, D] at `layer`; returns rounds to add."""
    Hkv = cache.kv.shape[2]; H = q.shape[1]; rep = H // Hkv
    qf = q.float() / math.sqrt(q.shape[-1])
    keys = cache.kv[layer, 0].float()
    vis = torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in sorted(chosen)] + [torch.arange(base, s)])
    kv = keys[:, vis].repeat_interleave(rep, 0)  # H S D
    best = torch.einsum("thd,hsd->ths", qf, kv).amax(-1)  # T H
    add = set()
    for r in range(len(bounds) - 1):
        if r in chosen: continue
        lo, hi = pb[layer][r]  # Hkv np D
        lo, hi = lo.repeat_interleave(rep, 0), hi.repeat_interleave(rep, 0)  # H np D
        ub = torch.maximum(torch.einsum("thd,hpd->thpd", qf, lo), torch.einsum("thd,hpd->thpd", qf, hi)).sum(-1).amax(-1)  # T H
        if bool((ub >= best - tau).any()):
            add.add(r)
    return add

tot = ok = 0; frac = []; fails = {}
t0 = time.time()
for dlg in chats:
    closed = eng.chat.round_spans(Conversation(dlg.rounds, dlg.system))
    cache, starts = eng.new_cache(4096), []
    qs = {q.round_index: q for q in dlg.questions}
    for i, rnd in enumerate(dlg.rounds):
        q = qs.get(i)
        if q is not None:
            base = cache.length
            prompt = eng.chat.open_round_tokens(Conversation(dlg.rounds[:i], dlg.system), rnd.user)
            bounds = starts + [base]
            pb = {l: page_bounds(cache.kv[l, 0, :, :base], bounds) for l in range(lw + 1, L)}
            pos = torch.arange(base, base + len(prompt))
            h = m.run_layers(m.embed(torch.tensor(prompt)), pos, cache, base, layers=range(lw + 1))
            ms = round_mass_ref(m.layers[lw].queries(h, m.rope(pos)), cache.kv[lw, 0, :, :base], torch.tensor(starts))
            ms[0] = 0; ms = ms / ms.sum()
            chosen = set(select_rounds(ms, "topk", k)) | {0}
            prompt_chosen = set(chosen)
            vis = lambda end: torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in sorted(chosen)] + [torch.arange(base, end)])
            for l in range(lw + 1, L):
                if prompt_ret:
                    chosen |= retrieve(m.layers[l].queries(h, m.rope(pos)), l, cache, bounds, chosen, base, base, pb)
                h = m.run_layers(h, pos, cache, base, layers=range(l, l + 1), attend=vis(base))
            cache.length = base + len(prompt)
            tok = int(m.head(h[-1:])[-1].argmax())
            out = []
            for _ in range(48):
                if tok in eng.tokenizer.eog_ids: break
                out.append(tok)
                s = cache.length; p = torch.tensor([s])
                hh = m.run_layers(m.embed(torch.tensor([tok])), p, cache, s, layers=range(lw + 1))
                if w_top1:
                    md = round_mass_ref(m.layers[lw].queries(hh, m.rope(p)), cache.kv[lw, 0, :, :base], torch.tensor(starts)); md[0] = 0
                    chosen.add(int(md.argmax()))
                for l in range(lw + 1, L):
                    chosen |= retrieve(m.layers[l].queries(hh, m.rope(p)), l, cache, bounds, chosen, base, s, pb)
                    hh = m.run_layers(hh, p, cache, s, layers=range(l, l + 1), attend=vis(s))
                cache.length = s + 1
                tok = int(m.head(hh)[-1].argmax())
            text = eng.tokenizer.decode(out)
            good = reply_matches(text, rnd.assistant)
            tot += 1; ok += good; frac.append(len(chosen) / len(starts))
            if not good:
                src = {v: [j for j in range(i) if v in dlg.rounds[j].user or v in dlg.rounds[j].assistant] for v in q.values}
                fails[q.kind] = fails.get(q.kind, 0) + 1
                if verbose:
                    print(f"{q.kind:9} d={q.distance:2} src={src} prompt={sorted(prompt_chosen)} all={sorted(chosen)}\n   exp={rnd.assistant!r}\n   got={text!r}")
            cache.truncate(base)
        starts.append(cache.length)
        prefill(m, cache, closed[i])
print(f"lw={lw} k={k} tau={tau} P={P} w1={w_top1} p={prompt_ret}: recall {ok}/{tot} = {ok/tot:.3f}; kept {sum(frac)/len(frac):.3f}; fails {fails}; {time.time()-t0:.0f}s")
