"""Recall of prompt-time top-k plus decode-time selection at layer w, simulated with attention masks on a full cache
(only the asked round under the policy). Decode modes: none, topN (the N rounds of most mass per token), thrX
(rounds with at least X of the non-sink mass). -v prints each miss with the rounds that held the value.

    .venv/bin/python docs/probes/round_progressive.py W K MODE CHATS [SKIP] [-v]   # e.g. 3 0.1 top1 10
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
lw = int(sys.argv[1]); k = float(sys.argv[2]); dec = sys.argv[3]; nchats = int(sys.argv[4]); skip = int(sys.argv[5]) if len(sys.argv) > 5 else 0
chats = heldout_chats(nchats + skip, 0, 44, 52, eng, 2000)[skip:]
verbose = "-v" in sys.argv

def mass_at(h, pos, cache, start, starts):
    q = m.layers[lw].queries(h, m.rope(pos))
    return round_mass_ref(q, cache.kv[lw, 0, :, :start], torch.tensor(starts))

def pick_dec(md):
    md = md.clone(); md[0] = 0; md = md / md.sum()
    if dec == "none": return set()
    if dec.startswith("top"): return set(torch.topk(md, min(int(dec[3:]), md.numel())).indices.tolist())
    if dec.startswith("thr"): return set((md >= float(dec[3:])).nonzero().flatten().tolist()) | {int(md.argmax())}
    raise SystemExit(dec)

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
            pos = torch.arange(base, base + len(prompt))
            h = m.run_layers(m.embed(torch.tensor(prompt)), pos, cache, base, layers=range(lw + 1))
            ms = mass_at(h, pos, cache, base, starts)
            ms[0] = 0; ms = ms / ms.sum()
            chosen = set(select_rounds(ms, "topk", k)) | {0}
            prompt_chosen = set(chosen)
            vis = lambda end: torch.cat([torch.arange(bounds[r], bounds[r + 1]) for r in sorted(chosen)] + [torch.arange(base, end)])
            h = m.run_layers(h, pos, cache, base, layers=range(lw + 1, L), attend=vis(base))
            cache.length = base + len(prompt)
            tok = int(m.head(h[-1:])[-1].argmax())
            out = []
            for _ in range(48):
                if tok in eng.tokenizer.eog_ids: break
                out.append(tok)
                s = cache.length; p = torch.tensor([s])
                hh = m.run_layers(m.embed(torch.tensor([tok])), p, cache, s, layers=range(lw + 1))
                chosen |= pick_dec(mass_at(hh, p, cache, base, starts))
                hh = m.run_layers(hh, p, cache, s, layers=range(lw + 1, L), attend=vis(s))
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
print(f"lw={lw} k={k} dec={dec}: recall {ok}/{tot} = {ok/tot:.3f}; kept {sum(frac)/len(frac):.3f}; fails {fails}; {time.time()-t0:.0f}s")
