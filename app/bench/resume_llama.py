"""The children of `kvchat bench` (app/bench/resume.py) that run llama.cpp: the setup child evaluates each chat
once and saves llama.cpp's own state file; the method child loads that file into the same GGUF model and answers,
timed as our engine's methods are (resume_engine.py)."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from kvchat.app.bench.resume_common import RECALL_TOKENS, REPLY_TOKENS, evict_files, load_workload, recall_ok, summarize
from kvchat.errors import KvchatError


def run_child(spec: dict) -> dict:
    """One child's work: save the state files (spec kind "llama-setup") or resume from one (the llama.cpp method)."""
    return _llama_setup(spec) if spec["kind"] == "llama-setup" else _run_llama(spec)


def _llama(path: str, n_ctx: int):
    import llama_cpp

    from kvchat.engine.text.tokenizer import quiet_llama_logs

    quiet_llama_logs()
    # use_mmap off: the weights stay in process memory, so a page-cache drop (the cold run) hits only the state file.
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_gpu_layers=-1 if llama_cpp.llama_supports_gpu_offload()
                           else 0, logits_all=False, use_mmap=False, n_threads=os.cpu_count(), verbose=False)


def _last_logits(llm):
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def _llama_greedy(llm, prompt: list[int], max_tokens: int, eog: frozenset[int], started: float):
    """Evaluate the prompt after what llm holds, then greedy tokens; (tokens, seconds to the first, decode tok/s)."""
    llm.eval(prompt)
    token = int(_last_logits(llm).argmax())
    first = time.perf_counter() - started
    tokens, t0 = [token], time.perf_counter()
    while token not in eog and len(tokens) < max_tokens:
        llm.eval([token])
        token = int(_last_logits(llm).argmax())
        tokens.append(token)
    rate = (len(tokens) - 1) / (time.perf_counter() - t0) if len(tokens) > 1 else 0.0
    return tokens, first, rate


def _llama_setup(spec: dict) -> dict:
    """llama.cpp evaluates each chat once and saves its own state file; chats it would take too long on are skipped
    with the estimate (the CPU build on a large model)."""
    import llama_cpp

    from kvchat.engine.gguf.reader import GGUFFile
    from kvchat.engine.text.chat_format import ChatFormat, chat_template
    from kvchat.engine.text.tokenizer import Tokenizer

    tok = Tokenizer(spec["path"])
    chat = ChatFormat(tok, chat_template(GGUFFile(spec["path"]).metadata))
    out, result = Path(spec["out"]), {"status": "ok", "workloads": {}}
    chats = {n: load_workload(str(out / f"{n}.json")) for n in spec["workloads"] if (out / f"{n}.json").exists()}
    if not chats:
        return result
    # One llama.cpp context for every workload of the model (loading an 8B file takes a while on the CPU build);
    # the method runs load each state file into a context of the same size.
    n_ctx = max(wl["n_ctx"] for wl in chats.values())
    t0 = time.perf_counter()
    llm = _llama(spec["path"], n_ctx)
    load_s = time.perf_counter() - t0
    too_long = None
    for name, wl in sorted(chats.items(), key=lambda kv: kv[1]["tokens"]):
        if too_long:
            result["workloads"][name] = {"skipped": f"{too_long} already would not fit the budget"}
            continue
        tokens = chat.conversation_tokens(wl["conversation"])
        llm.n_tokens = 0
        probe = min(256, len(tokens))
        t0 = time.perf_counter()
        llm.eval(tokens[:probe])
        per_token = (time.perf_counter() - t0) / probe
        t0 = time.perf_counter()
        llm.eval([1])
        step_s = time.perf_counter() - t0
        llm.n_tokens = probe
        # Prefill (attention makes long chats slower than linear: the factor is a rough allowance), then each
        # method run: the new message and the reply, in a fresh process that loads the model again.
        estimate = (per_token * len(tokens) * (1 + len(tokens) / 8192)
                    + (1 + spec["repeats"]) * (REPLY_TOKENS * step_s + 64 * per_token) + load_s)
        if estimate > spec["budget_s"]:
            result["workloads"][name] = {"skipped": f"would take ~{estimate:,.0f} s on the "
                                         f"{'CUDA' if llama_cpp.llama_supports_gpu_offload() else 'CPU'} build "
                                         f"(budget {spec['budget_s']:.0f} s)"}
            too_long = name
            continue
        t0 = time.perf_counter()
        llm.eval(tokens[probe:])
        prefill_s = time.perf_counter() - t0
        file = out / f"{name}.llama-state"
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)
        if not llama_cpp.llama_state_save_file(llm._ctx.ctx, str(file).encode(), ids, len(tokens)):
            raise KvchatError(f"llama.cpp could not save its state to {file}")
        result["workloads"][name] = {"file": str(file), "state_bytes": file.stat().st_size, "n_ctx": n_ctx,
                                     "tokens": len(tokens), "prefill_s": prefill_s + per_token * probe}
    return result


def _run_llama(spec: dict) -> dict:
    import llama_cpp

    from kvchat.engine.gguf.reader import GGUFFile
    from kvchat.engine.text.chat_format import ChatFormat, chat_template
    from kvchat.engine.text.tokenizer import Tokenizer

    state = spec["state"]
    wl = load_workload(spec["workload"])
    tok = Tokenizer(spec["path"])
    chat = ChatFormat(tok, chat_template(GGUFFile(spec["path"]).metadata))
    llm = _llama(spec["path"], state["n_ctx"])
    llm.eval(tok.encode("Hello there, how are you today?", add_bos=tok.add_bos))  # warm-up
    _last_logits(llm).argmax()
    conv, eog = wl["conversation"], tok.eog_ids

    def resume() -> int:
        ids = (llama_cpp.llama_token * state["n_ctx"])()
        count = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(llm._ctx.ctx, state["file"].encode(), ids, state["n_ctx"],
                                               ctypes.byref(count)):
            raise KvchatError(f"llama.cpp could not load its state file {state['file']}")
        llm.input_ids[: count.value] = ids[: count.value]
        llm.n_tokens = count.value
        return count.value

    runs = []
    for run in range(1 + spec["repeats"]):
        dropped = evict_files([Path(state["file"])]) if run == 0 else None
        t0 = time.perf_counter()
        resume()
        t1 = time.perf_counter()
        prompt = chat.open_round_tokens(conv, wl["new_message"])
        tokens, first, rate = _llama_greedy(llm, prompt, REPLY_TOKENS, eog, t0)
        runs.append({"ttft_s": first, "resume_s": t1 - t0, "tokens": tokens, "decode_tok_s": rate,
                     "text": _text(tok, [t for t in tokens if t not in eog], chat.stop_strings), "page_cache_dropped": dropped})
    import torch

    result = summarize(runs, wl, torch.device("cuda" if llama_cpp.llama_supports_gpu_offload() else "cpu"))
    if wl["expected_reply"] is not None:
        base = resume()
        asked = [(wl["new_message"], wl["expected_reply"])] + [(r.user, r.assistant) for r in wl["recall"]]
        correct = 0
        for user, expected in asked:
            tokens, _, _ = _llama_greedy(llm, chat.open_round_tokens(conv, user), RECALL_TOKENS, eog,
                                         time.perf_counter())
            text = _text(tok, [t for t in tokens if t not in eog], chat.stop_strings)
            correct += recall_ok(text, expected)
            llm.n_tokens = base  # the next eval drops what this answer added to llama.cpp's cache
        result["recall"] = {"correct": correct, "questions": len(asked), "accuracy": correct / len(asked)}
    result["bytes_on_disk"] = state["state_bytes"]
    result["bytes_per_token"] = state["state_bytes"] / wl["tokens"]
    result["llama_cpp_prefill_s"] = state["prefill_s"]
    return result


def _text(tok, tokens: list[int], stops: tuple[str, ...]) -> str:
    decoder = tok.stream_decoder()
    text = "".join(decoder.feed(t) for t in tokens) + decoder.flush()
    for s in stops:
        text = text.split(s)[0]
    return text
