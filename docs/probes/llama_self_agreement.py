"""How often llama.cpp's top token agrees with itself on gemma-3-270m's own file when only its summation order
changes (issue 18's ≥ 99% top-1 target against llama.cpp): weight repacking on and off (`use_extra_bufts`), a
batch or one token at a time; and our engine (llama.cpp numerics) against each.

    python docs/probes/llama_self_agreement.py [TOKENS] [--prose]   # CPU; ~2 minutes on 2 cores for 1,100 tokens

--prose: MT-Bench's reference answers as plain text (no chat template) instead of a chat; also prints the agreement
where llama.cpp's top two logits are further apart than a margin (the disagreements are near-ties).
"""

from __future__ import annotations

import json
import os
import sys

import llama_cpp
import llama_cpp.llama_cpp
import numpy as np
import torch
from llama_cpp import Llama

from kvchat.engine.engine import Engine
from kvchat.app.bench.parity import ours_logits
from kvchat.engine.text.tokenizer import quiet_llama_logs
from kvchat.engine.data.workloads import MT_BENCH, mt_bench_workload
from kvchat.storage.known_models import resolve_model


def llama_logits(path, tokens: list[int], repack: bool, one_by_one: bool = False) -> np.ndarray:
    bindings = llama_cpp.llama_cpp  # where Llama() gets its default model parameters (the submodule)
    default = bindings.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = repack
        return p

    bindings.llama_model_default_params = params
    try:
        quiet_llama_logs()
        n = len(tokens)
        llm = Llama(model_path=str(path), n_ctx=n + 8, n_batch=n + 8, n_ubatch=n + 8, logits_all=True,
                    n_threads=os.cpu_count(), type_k=0, type_v=0, flash_attn=False, verbose=False)
        if one_by_one:
            for t in tokens:
                llm.eval([t])
        else:
            llm.eval(tokens)
        return np.array(llm.scores[:n], dtype=np.float32)
    finally:
        bindings.llama_model_default_params = default


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--prose"]
    target = int(args[0]) if args else 1100
    path = resolve_model("gemma-3-270m")
    engine = Engine(path, device="cpu", dtype=torch.float32, numerics="llama.cpp")
    if "--prose" in sys.argv:
        answers = [json.loads(line) for line in (MT_BENCH / "reference_answer_gpt-4.jsonl").read_text().splitlines()]
        text = "\n\n".join(turn for a in answers for turn in a["choices"][0]["turns"])
        tokens = engine.tokenizer.encode(text, add_bos=True, special=False)[:target]
    else:
        work = mt_bench_workload(engine.chat, "probe", seed=0, target=target)
        tokens = [t for span in engine.chat.round_spans(work.conversation) for t in span][:target]
    ours = ours_logits(engine, tokens)
    runs = {"repacked": llama_logits(path, tokens, True), "plain": llama_logits(path, tokens, False),
            "plain, one token at a time": llama_logits(path, tokens, False, one_by_one=True)}
    agree = lambda a, b: float((a.argmax(-1) == b.argmax(-1)).mean())  # noqa: E731
    print(f"{len(tokens)} tokens")
    for name, logits in runs.items():
        print(f"kvchat vs llama.cpp {name}: {agree(ours, logits):.1%}")
    print(f"llama.cpp repacked vs plain: {agree(runs['repacked'], runs['plain']):.1%}")
    print(f"llama.cpp plain, batched vs one token at a time: "
          f"{agree(runs['plain'], runs['plain, one token at a time']):.1%}")
    top2 = np.sort(runs["repacked"], -1)[:, -2:]
    for margin in (0.1, 0.2, 0.5):
        far = top2[:, 1] - top2[:, 0] > margin
        same = lambda a: float((a.argmax(-1) == runs["repacked"].argmax(-1))[far].mean())  # noqa: E731
        print(f"top two > {margin} apart ({far.mean():.1%} of positions): kvchat {same(ours):.1%}, "
              f"llama.cpp plain {same(runs['plain']):.1%}")


if __name__ == "__main__":
    main()
