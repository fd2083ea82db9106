"""XKV against its baselines at several budgets, in one run of `kvchat eval --text`'s harness (app/bench/fidelity.py):
the full cache's logits are computed once per chat and every (policy, budget) pair is scored against them, so the
pairs differ only in how the budget is shared among the layers (all three score and select alike).

    python docs/probes/xkv_fidelity.py --model gemma-3-270m --lengths 2000,8000 --chats 2 --json out.json

Prints mean KL, top-1 agreement and the kept share per pair and length (docs/benchmarks.md, "XKV").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvchat.app.bench.fidelity import text_fidelity
from kvchat.engine.engine import Engine


def probe_engine(model: str | None, device: str, fp32: bool = False) -> tuple[str, Engine]:
    """(the model file, its engine): a GGUF file, a known model's short name (gemma-3-270m) or, without one, the
    embedded model. `fp32`: float32 activations over dequantized weights on any device (the CPU's default; on CUDA
    the default is bf16 over the 4-bit blocks, whose rounding would add to every policy's KL)."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.storage.known_models import is_known_model, resolve_model

    path = str(resolve_model(model)) if model and is_known_model(model) else model or str(DEFAULT_MODEL)
    if fp32:
        return path, Engine(path, device=device, dtype=torch.float32, quantized=False)
    return path, Engine(path, device=device)


def policy_spec(spec: str) -> tuple[str, dict]:
    """xkv or xkv:layer_weight=0.5 (options as `kvchat eval --option`, several joined by ';') -> (name, options)."""
    name, _, options = spec.partition(":")
    from kvchat.app.bench.eval_command import _parse_options

    return name, _parse_options(tuple(filter(None, options.split(";"))))


def make_probe_policy(spec: str, engine: Engine, budget: float, more: dict):
    """A policy as `kvchat eval` builds it (app.session.policies.build_policy: `xkv` with the model's calibrated
    layer costs, measured on its first use; `xkv:costs=equal` the paper's weights), or `xkv-costs:B=COSTS;...` (xkv
    with the layer costs given, COSTS "a/b/c" first global layer to last for each budget B)."""
    from kvchat.app.session.policies import build_policy

    name, _, rest = spec.partition(":")
    if name == "xkv-costs":
        return build_policy("xkv", engine, budget=budget, costs=rest, **more)
    name, options = policy_spec(spec)
    return build_policy(name, engine, budget=budget, **more, **options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or gemma-3-270m (default: the embedded model)")
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--chats", type=int, default=2)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--budgets", default="0.4,0.2,0.1")
    parser.add_argument("--policies", default="xkv,uniform,pyramid",
                        help="comma-separated; each NAME or NAME:key=value;key=value (e.g. xkv:layer_weight=0.5)")
    parser.add_argument("--progressive", action="store_true",
                        help="each policy with progressive=true (its slots chosen again as the reply goes)")
    parser.add_argument("--lookahead", type=int, default=None,
                        help="each policy's look-ahead (default: the policies' own, 16; 0: the window alone, as every "
                             "figure of docs/benchmarks.md's XKV section before \"XKV looking ahead\" was measured)")
    parser.add_argument("--seed", type=int, default=0, help="the first chat's MT-Bench seed (chat i has seed + i)")
    parser.add_argument("--keep-ahead", default=None, choices=["true", "false"],
                        help="whether the look-ahead's tokens are the reply's start where the forced reply takes them "
                             "(default: the policies' own, true; false: the choice alone, as measured before)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fp32", action="store_true",
                        help="float32 over dequantized weights on CUDA too (as on the CPU), not bf16 over 4-bit blocks")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path, engine = probe_engine(args.model, args.device, args.fp32)
    budgets = [float(b) for b in args.budgets.split(",")]
    more = {"progressive": True} if args.progressive else {}
    if args.lookahead is not None:
        more["lookahead"] = args.lookahead
    if args.keep_ahead is not None:
        more["keep_ahead"] = args.keep_ahead == "true"
    label = "+p" if args.progressive else ""
    makers = {f"{spec}{label}@{b:g}": (lambda spec=spec, b=b: make_probe_policy(spec, engine, b, more))
              for b in budgets for spec in args.policies.split(",")}
    print(f"model {path}  device {engine.device}  {args.chats} chats per length, up to {args.positions} positions",
          flush=True)
    every: dict = {}
    for length in [int(x) for x in args.lengths.split(",")]:  # each length printed (and saved) as it ends
        result = text_fidelity(engine, makers, [length], args.chats, args.positions, seed=args.seed,
                               progress=lambda what, done, total: print(f"\r{done}/{total} {what:<60}", end="",
                                                                         file=sys.stderr, flush=True))
        d = result.as_dict()
        print(file=sys.stderr)
        for skipped, why in d["skipped"].items():
            print(f"{skipped} tokens: skipped, {why}")
        for length_name, entry in d["lengths"].items():
            print(f"{length_name} tokens (chats of {', '.join(map(str, entry['chat_tokens']))}; "
                  f"{result.seconds:.0f} s):")
            for p in entry["policies"]:
                kept = f"  kept {p['kept_share']:.1%}, attention kept {p['retention']:.1%}" if "kept_share" in p else ""
                print(f"  {p['policy']:<14} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  ppl {p['ppl']:.3f} "
                      f"(full {p['ppl_full']:.3f}){kept}", flush=True)
        every = {**d, "lengths": {**every.get("lengths", {}), **d["lengths"]}}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(every, f, indent=2)


if __name__ == "__main__":
    main()
