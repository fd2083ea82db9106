"""The children of `kvchat bench` (app/bench/resume.py) that run our engine: the setup child, which stores each
workload's chat round by round as the app does, and the method children (prefill, kv-load, kv-split, kv-merge and
policy:NAME), each timing a resume and its answer in a fresh process.

`run_child` is the parent's entry; the rest is how each method prepares its copy of the chat and what it reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from kvchat.app.bench.resume_common import (
    RECALL_TOKENS,
    REPLY_TOKENS,
    evict_files,
    left_resident,
    load_workload,
    recall_ok,
    summarize,
)
from kvchat.engine.timing import sync
from kvchat.errors import KvchatError
from kvchat.storage.pagecache import disk_bytes_read

MERGE_SHARE = 0.5  # kv-merge: r_l, the share of layers merged (at most)


def run_child(spec: dict) -> dict:
    """One child's work: the setup (spec kind "setup") or a method on a stored chat (kind "method")."""
    return _setup(spec) if spec["kind"] == "setup" else _run_engine(spec)


def _engine(spec):
    from kvchat.engine.engine import Engine

    return Engine(spec["path"], device=spec["device"])


def _setup(spec: dict) -> dict:
    """Build each workload's chat, prefill it once and store every round as the app does (one store per model, so
    the GGUF file is hashed once)."""
    from kvchat.app.session.layout import chat_groups
    from kvchat.app.session.saving import RoundSaver
    from kvchat.app.session.windows import WindowTrim
    from kvchat.app.session.writer import KVWriter
    from kvchat.engine.data.workloads import build_workload
    from kvchat.engine.generate import prefill
    from kvchat.storage.db import RoundRow, Store, now
    from kvchat.storage.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    engine = _engine(spec)
    load_s = time.perf_counter() - t0
    from kvchat.app.bench.floor import matmul_params

    out = Path(spec["out"])
    store = Store(out / "home")
    fp = model_fingerprint(Path(engine.path), store)
    cfg = engine.config
    result = {"status": "ok", "config": asdict(cfg), "params": matmul_params(cfg), "load_s": load_s,
              "workloads": {}}
    for name in spec["workloads"]:
        wl = build_workload(engine.chat, name, memory=spec["model"] == "embedded", seed=spec["seed"])
        conv = wl.conversation
        questions = [wl.new_message] + [r.user for r in wl.recall]
        longest = max(len(engine.chat.open_round_tokens(conv, q)) for q in questions)
        info = {"source": wl.source, "tokens": wl.tokens, "rounds": wl.rounds,
                "new_message_tokens": len(engine.chat.open_round_tokens(conv, wl.new_message)),
                "n_ctx": wl.tokens + longest + RECALL_TOKENS + 16}
        result["workloads"][name] = info
        if info["n_ctx"] > cfg.context_length:
            info["skipped"] = f"beyond the model's {cfg.context_length:,}-token context"
            continue
        spans = engine.chat.round_spans(conv)
        sid = store.create_session(title=f"bench {name}", model_fingerprint=fp, model_path=engine.path,
                                   system_prompt=conv.system)
        cache = engine.new_cache(wl.tokens + 8)
        prefill(engine.model, cache, [t for s in spans for t in s])
        writer, start, rows = KVWriter(store, fp), 0, []
        for i, (r, span) in enumerate(zip(conv.rounds, spans)):
            rows.append(RoundRow(i, r.user, r.assistant or "", start, start + len(span), now()))
            store.add_round(sid, rows[-1])
            start += len(span)
        # every round saved as the app saves one: its layer groups, sliding-window layers trimmed to what the
        # chat's end still reads
        RoundSaver(store, writer, sid, cfg, chat_groups(engine, None), WindowTrim(cfg)).store_all(cache, rows)
        writer.drain()
        if writer.errors:
            raise KvchatError(f"storing the {name} chat failed: {writer.errors[0]}")
        segs = store.segments(sid)
        info.update(kv_raw_bytes=sum(s["raw_size"] for s in segs), kv_disk_bytes=sum(s["byte_size"] for s in segs),
                    sid=sid, path=str(out / f"{name}.json"))
        (out / f"{name}.json").write_text(json.dumps({
            "name": name, "system": conv.system, "rounds": [[r.user, r.assistant] for r in conv.rounds],
            "new_message": wl.new_message, "expected_reply": wl.expected_reply,
            "recall": [[r.user, r.assistant] for r in wl.recall], "tokens": wl.tokens, "sid": sid,
            "n_ctx": info["n_ctx"], "kv_disk_bytes": info["kv_disk_bytes"], "home": str(out / "home")}))
        del cache
    return result


def _chat_files(home: Path) -> list[Path]:
    """The store's database and segment files: what resuming a chat reads. Not SQLite's WAL index (`-shm`): shared
    memory that each open connection maps, which no eviction drops while it is mapped and a resume never reads from
    the disk. (A run of 2026-11-29 on the H200 said its cold runs' files were not all evicted, while the lazy run's
    reads were all refused by the page cache: the runs record which files stayed, `cold_files_left_resident`.)"""
    return [p for p in home.rglob("*") if p.is_file() and not p.name.endswith("-shm")]


def _warm_up(engine) -> None:
    """One short prefill and decode: kernels, allocator and (on CUDA) graph capture paths are ready before timing."""
    from kvchat.engine.generate import generate

    prompt = engine.encode_prompt("Hello there, how are you today?")
    generate(engine.model, engine.new_cache(64), prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=4)
    sync(engine.device)


def _run_engine(spec: dict) -> dict:
    """prefill, kv-load or policy:NAME: the cold run, then the repeats, then (memory chats) the recall questions.
    Under a GPU memory budget (`kvchat bench --gpu-memory`) the chat is planned as the app plans it: a method whose
    full cache does not fit runs on the tiered cache as the app would (kv-load, kv-split, policy:loopserve) or is
    skipped (prefill, kv-merge: what they measure is the full cache), and nothing runs where nothing fits."""
    import torch
    from kvchat.app.session.chat import ChatSession
    from kvchat.engine.generate import generate, prefill
    from kvchat.engine.kv.host_resident import HostResidentKV
    from kvchat.engine.kv.tiered import TieredKV
    from kvchat.engine.text.chat_format import Conversation, Round
    from kvchat.errors import GPUMemoryError
    from kvchat.storage.db import Store

    method = spec["method"]
    os.environ["KVCHAT_HOME"] = load_workload(spec["workload"])["home"]  # the profile is kept with the bench's store
    try:
        budget = _budget(spec)
        engine = _engine(spec)
    except GPUMemoryError as exc:
        return {"status": f"skipped: {exc}", "memory_plan": {"kind": "refused", "message": str(exc)}}
    lazy = method.endswith(LAZY_SUFFIX)  # louiskv's lazy resume (app/session/lazy.py)
    policy = _policy(method.removesuffix(LAZY_SUFFIX), engine) if method.startswith("policy:") else None
    tiered = policy is not None and policy.tiered
    wl = load_workload(spec["workload"])
    chat, model = engine.chat, engine.model
    store = Store(Path(wl["home"]))
    memory_plan = None
    if budget is not None:
        memory_plan, policy = _memory_plan(engine, budget, store, wl, policy, spec.get("tiered_watershed"))
        if memory_plan["kind"] == "refused" or (memory_plan["kind"] == "tiered" and not tiered
                                                and method in ("prefill", "kv-merge")):
            why = memory_plan["message"] if memory_plan["kind"] == "refused" else \
                f"{method} needs the full cache, and {memory_plan['full_message']}"
            return {"status": f"skipped: {why}", "memory_plan": memory_plan}
        tiered = policy is not None and policy.tiered
    sid, planner, split = wl["sid"], None, {}
    host_resident = getattr(policy, "host_resident", False)
    # (a lazy resume needs every round stored, so its chat is kv-load's, not compacted)
    if method == "kv-split" or (policy is not None and not tiered and not host_resident and not lazy):
        # kv-split's chat and planner; a policy over the full cache is restored as the app restores its chats
        # (ChatService.wire: the machine's profile plans the restore, and the chat is compacted for it)
        sid, planner, split = _compacted_copy(store, engine, wl["sid"])
    elif method == "kv-merge":
        sid, split = _merged_copy(store, engine, wl["sid"], spec["model"])
    _warm_up(engine)

    def resume():
        """The cache holding the chat, its closed rounds, and where each round starts."""
        if method == "prefill":  # the chat's text from the store, as the app keeps it, read again from scratch
            text = Conversation([Round(r.user_text, r.assistant_text) for r in store.rounds(wl["sid"])],
                                store.session(wl["sid"])["system_prompt"])
            tokens = chat.conversation_tokens(text)
            cache = engine.new_cache(len(tokens) + 256)
            prefill(model, cache, tokens)
            return cache, text, None
        # the session under the method's policy, as the app's: its own cache where it has one (tiered, host memory),
        # and what it keeps with the chat (louiskv's units, read at the restore)
        session = ChatSession(store, engine, sid, policy=policy, planner=planner, lazy_resume=lazy)
        # lazily: the units read, the rest when the message's layers ask (the bench's first, untimed resume is
        # whole: it stores the units a chat kept under kv-load lacks)
        stats = session.restored if lazy and session.restore_lazily() else session.restore()
        if stats.tokens_recomputed:
            raise KvchatError(f"restore recomputed {stats.tokens_recomputed} tokens: {'; '.join(stats.notes)}")
        restores.append(stats)
        sessions.append(session)  # a tiered cache still reads upper layers through it: closed after the answer
        return session.cache, session.conversation(), [r.token_start for r in session.rounds]

    def answer(cache, closed, starts, text, max_tokens):
        prompt = chat.open_round_tokens(closed, text)
        # the history's tokens are not at hand here, which only krul needs (not a bench method)
        view = (policy.for_message(model, cache, starts, [], prompt) if policy is not None and not tiered
                else contextlib.nullcontext())
        answering = sessions[-1].answering() if sessions else contextlib.nullcontext()  # as ChatSession.send answers
        with view as attend, answering:
            return generate(model, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=max_tokens,
                            stop_tokens=engine.tokenizer.eog_ids, stop_strings=chat.stop_strings, attend=attend,
                            policy=policy)

    sessions: list[ChatSession] = []
    restores = []  # each ChatSession restore's stats, in order

    def close_sessions():
        for session in sessions:
            session.close()
        sessions.clear()

    if tiered:  # the chat stored as the round policy stores it: a lower and an upper segment per round
        split_stored_rounds(store, engine, wl["sid"], policy)
    if engine.device.type == "cuda":  # the peak of resuming and answering: not of the bench's own preparations
        torch.cuda.reset_peak_memory_stats(engine.device)

    # One untimed resume and answer first: the process's first run of this chat's shapes (kernel choices, the
    # allocator growing: 50-70 ms at 2k on the H200) is paid here, so the cold run measures what it is meant to, the
    # chat's files coming from the disk. Its time is kept apart.
    sync(engine.device)
    t0 = time.perf_counter()
    cache, closed, starts = resume()
    first_use_s = time.perf_counter() - t0 + answer(cache, closed, starts, wl["new_message"], 1).first_token_seconds
    close_sessions()
    del cache
    if lazy:  # that resume was whole (it stored what a chat kept under kv-load lacks): the lazy path's first run too
        cache, closed, starts = resume()
        answer(cache, closed, starts, wl["new_message"], 1)
        close_sessions()
        del cache
    runs = []
    for run in range(1 + spec["repeats"]):
        files = _chat_files(Path(wl["home"]))
        dropped = evict_files(files) if run == 0 else None
        resident = left_resident(files)[:5] if run == 0 and not dropped else []  # (what kept the cold run warm)
        sync(engine.device)
        disk_before = disk_bytes_read()
        t0 = time.perf_counter()
        cache, closed, starts = resume()
        t1 = time.perf_counter()
        counted = _retrieval_counts(policy)
        out = answer(cache, closed, starts, wl["new_message"], REPLY_TOKENS)
        runs.append({"ttft_s": t1 - t0 + out.first_token_seconds, "resume_s": t1 - t0, "tokens": out.tokens,
                     "message_ttft_s": out.first_token_seconds, "decode_setup_s": out.decode_setup_seconds,
                     "decode_tok_s": out.decode_tokens_per_second, "text": out.text, "page_cache_dropped": dropped,
                     "left_resident": resident,
                     **(_tiered_figures(cache, out) if isinstance(cache, TieredKV) else {}),
                     **(_host_figures(cache) if isinstance(cache, HostResidentKV) else {}),
                     **(_stream_figures(restores[-1]) if method == "kv-split" else {}),
                     **(_retrieval_figures(policy, counted) if counted is not None else {}),
                     **(_lazy_figures(sessions[-1], disk_before) if lazy and sessions else {})})
        close_sessions()
        del cache
    if os.environ.get("KVCHAT_BENCH_PROFILE"):  # where a warm and a cold resume's time goes (docs/gpu/)
        _profile_run(os.environ["KVCHAT_BENCH_PROFILE"], method, lambda: answer(*resume(), wl["new_message"], 1))
        close_sessions()
        evict_files(_chat_files(Path(wl["home"])))
        _profile_run(os.environ["KVCHAT_BENCH_PROFILE"], method, lambda: answer(*resume(), wl["new_message"], 1),
                     cold=True)
        close_sessions()
    if os.environ.get("KVCHAT_BENCH_MEMORY") and engine.device.type == "cuda":  # what the peak is made of (docs/gpu/)
        _memory_run(os.environ["KVCHAT_BENCH_MEMORY"], method, engine.device,
                    lambda: answer(*resume(), wl["new_message"], REPLY_TOKENS))
        close_sessions()
    result = summarize(runs, wl, engine.device)
    if "retrieval_choices" in runs[-1]:  # the last run's: the same chat and message each time
        result.update({k: v for k, v in runs[-1].items() if k.startswith("retrieval_")})
    if "lazy" in runs[-1]:  # likewise
        result.update({k: v for k, v in runs[-1].items() if k.startswith("lazy")})
        if len(runs) > 1:  # and where the cold run's time went (the first, from the disk), beside the warm one's
            result.update({f"cold_{k}": v for k, v in runs[0].items()
                           if k.startswith(("lazy_read_", "lazy_open_", "lazy_disk_")) or k == "lazy_complete_s"})
    result["ttft_first_use_s"] = first_use_s
    # the cold run's first token in its two parts: the chat opened (resume) and the message answered to its first
    # token, beside the warm runs' medians of the same (resume_warm_s, message_ttft_warm_s)
    result["resume_cold_s"], result["message_ttft_cold_s"] = runs[0]["resume_s"], runs[0]["message_ttft_s"]
    result["message_ttft_warm_s"] = statistics.median(r["message_ttft_s"] for r in runs[1:] or runs)
    if method == "kv-split":
        result.update(split)
        result["split_cold"] = {k: runs[0][k] for k in runs[0] if k.startswith("split_")}
        warm = runs[1:] or runs
        for key in warm[0]:
            if key.startswith("split_") and isinstance(warm[0][key], (int, float)):
                result[key] = statistics.median(r[key] for r in warm)
        result["split_plan"] = warm[-1]["split_plan"]
    if "host_stage_bytes" in runs[-1]:  # the last run's: the same chat and message each time
        result.update({k: v for k, v in runs[-1].items() if k.startswith("host_")})
    if tiered:
        warm = runs[1:] or runs
        for key in warm[0]:
            if key.startswith("tiered_"):
                result[key] = statistics.median(r[key] for r in warm)
        # The message sent once the background read of the upper layers is done (the user typed for a few seconds
        # after opening the chat): the picked rounds come from host memory.
        cache, closed, starts = resume()
        sessions[-1].wait_for_upper()
        out = answer(cache, closed, starts, wl["new_message"], REPLY_TOKENS)
        result["tiered_message_ttft_after_prefetch_s"] = out.first_token_seconds
        close_sessions()
    if wl["expected_reply"] is not None:
        cache, closed, starts = resume()
        base, correct = cache.length, 0
        asked = [(wl["new_message"], wl["expected_reply"])] + [(r.user, r.assistant) for r in wl["recall"]]
        for user, expected in asked:
            got = answer(cache, closed, starts, user, RECALL_TOKENS).text
            correct += recall_ok(got, expected)
            cache.truncate(base)
        result["recall"] = {"correct": correct, "questions": len(asked), "accuracy": correct / len(asked)}
        close_sessions()
    if method == "kv-merge":
        result.update(split)
    result["bytes_on_disk"] = 0 if method == "prefill" else split.get(
        "split_disk_bytes", split.get("merge_disk_bytes", wl["kv_disk_bytes"]))
    result["bytes_per_token"] = result["bytes_on_disk"] / wl["tokens"]
    if engine.device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        # what torch's allocator held at its peak: what the memory budget caps and the plan predicts
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(engine.device) / 2**30
    if memory_plan is not None:
        result["memory_plan"] = memory_plan
    return result


def _budget(spec: dict):
    """The GPU memory budget of a method child (`kvchat bench --gpu-memory`): torch's allocator capped before the
    model loads, which must fit (GPUMemoryError); None without a budget or off CUDA."""
    if spec.get("gpu_memory") is None:
        return None
    from kvchat.app.session.memory import check_weights, memory_budget

    budget = memory_budget(spec["device"], spec["gpu_memory"])
    check_weights(spec["path"], budget)
    return budget


LAZY_SUFFIX = "+lazy"


def _memory_run(folder: str, method: str, device, run, large: int = 64 << 20) -> None:
    """One more warm resume and answer, after the measured runs, with the CUDA allocator's history recorded: at the
    moment most memory was allocated, the blocks of `large` bytes or more still held, each with where in kvchat it
    was allocated (those allocated before the run: one line), written to FOLDER/memory-METHOD.txt."""
    import torch

    root = str(Path(__file__).resolve().parents[2])  # the package's files: the frames that say which of ours
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000, device=device)
    try:
        run()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    peak = torch.cuda.max_memory_allocated(device)
    most, held = blocks_at_peak(snapshot["device_traces"][device.index or 0], before, large)
    lines = [f"{method}: allocated before the run {before / 2**30:.2f} GiB, the run's peak {peak / 2**30:.2f} GiB "
             f"(traced {most / 2**30:.2f}); blocks of >= {large >> 20} MiB held at the peak, allocated in the run:"]
    for event in held:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in event.get("frames", [])
                  if f["filename"].startswith(root) or "/kvchat/" in f["filename"]][:6]
        lines.append(f"  {event['size'] / 2**20:9.1f} MiB  " + " <- ".join(frames))
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in method)
    Path(folder, f"memory-{name}.txt").write_text("\n".join(lines) + "\n")


def blocks_at_peak(events: list[dict], before: int, large: int) -> tuple[int, list[dict]]:
    """From a CUDA allocator trace (torch.cuda.memory._snapshot's device_traces[i]) and the bytes allocated before
    it began: the most bytes allocated at any moment, and the allocations of `large` bytes or more held then that the
    trace saw made, largest first."""
    live: dict[int, dict] = {}
    total = most = before
    at_most: list[dict] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > most:
            most, at_most = total, [e for e in live.values() if e["size"] >= large]
    return most, sorted(at_most, key=lambda e: -e["size"])


def _profile_run(folder: str, method: str, run, cold: bool = False) -> None:
    """One more resume and first token, after the measured runs, under cProfile: the main thread's functions by
    their own time (a GPU wait shows in the call that synced), written to FOLDER/profile-METHOD.txt (a cold run,
    the chat's files out of the page cache first: profile-cold-METHOD.txt)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in method)
    Path(folder, f"profile-{'cold-' if cold else ''}{name}.txt").write_text(text.getvalue())


def _lazy_figures(session, disk_before: int | None = None) -> dict:
    """What a lazy resume read before the message's first token: rounds and bytes (None where it was whole); and,
    where the OS counts them, the bytes the disk gave the process from before the open to then (the units, the
    frames' whole pages, any read-ahead: `lazy_disk_bytes_before_first_token`)."""
    rows = session.lazy_rows
    if rows is None:
        return {"lazy": False}
    disk = None if disk_before is None or rows.disk_read_by_first_token is None else \
        rows.disk_read_by_first_token - disk_before
    return {"lazy": True, "lazy_rounds_before_first_token": rows.rounds_before_first_token,
            "lazy_rounds": len(rows.rounds), "lazy_bytes_before_first_token": rows.bytes_before_first_token,
            "lazy_chat_bytes": rows.chat_bytes, "lazy_units_bytes": rows.units_bytes,
            "lazy_frames_before_first_token": rows.frames_read, "lazy_read_s": rows.read_s,
            **{f"lazy_read_{phase}_s": took for phase, took in rows.phase_s.items()},
            **{f"lazy_read_io_{part}": value for part, value in rows.io_detail.items()},
            **{f"lazy_open_{phase}_s": took for phase, took in session.lazy_open_s.items()},
            "lazy_complete_s": rows.complete_s, "lazy_disk_bytes_before_first_token": disk,
            "lazy_whole_restore": rows.whole_restore_because}


def _retrieval_counts(policy) -> tuple[int, int] | None:
    """A retrieval policy's (louiskv, quest) counters of choices made and tokens decoded so far, or None."""
    if not hasattr(policy, "selections"):
        return None
    return policy.selections, policy.decoded


def _retrieval_figures(policy, before: tuple[int, int]) -> dict:
    """What a retrieval policy chose during one answer: its choices (the one after the prefill included), the
    tokens it decoded, and the choices per decoded token (what a step's time beside its bytes goes to)."""
    choices, decoded = policy.selections - before[0], policy.decoded - before[1]
    return {"retrieval_choices": choices, "retrieval_decoded": decoded,
            "retrieval_choices_per_token": choices / decoded if decoded else None}


def _host_figures(cache) -> dict:
    """A host-resident chat's device K/V after its reply: the working set it decoded over, and the largest layer a
    message staged (engine.kv.host_resident)."""
    return {"host_working_set_bytes": cache.device_bytes(), "host_stage_bytes": cache.peak_stage_bytes}


def _memory_plan(engine, budget, store, wl: dict, policy, watershed: int | None = None) -> tuple[dict, object]:
    """How the workload's chat fits in the budget, as the app plans it (app.session.service.fitting_policy): the
    plan's figures, and the policy the method runs under (the tiered cache's where only it fits: the round policy
    at `watershed`, or at the model's calibration)."""
    from dataclasses import replace

    from kvchat.app.session.memory import plan_chat, plan_host_chat
    from kvchat.app.session.policies import build_policy
    from kvchat.engine.policies import BUDGET_POLICIES, make_policy

    rounds = store.rounds(wl["sid"])
    lengths = [r.token_end - r.token_start for r in rounds]
    new_tokens = wl["n_ctx"] - wl["tokens"]  # the longest question and its answer
    tiered = policy is not None and policy.tiered
    plan = plan_chat(engine, budget, wl["tokens"], new_tokens, lengths, policy.split if tiered else None)
    full_message = plan.message
    if plan.kind != "full" and policy is not None and policy.name in BUDGET_POLICIES:  # xkv: its K/V in host memory
        host = plan_host_chat(engine, budget, wl["tokens"], new_tokens, lengths, policy)
        if host.kind == "host":
            plan, policy = host, replace(policy, host_resident=True)
    if plan.kind == "tiered" and not tiered:
        policy = (build_policy("round", engine) if watershed is None  # calibrated on first use, as a chat's
                  else make_policy("round", engine, watershed=watershed))
        plan = plan_chat(engine, budget, wl["tokens"], new_tokens, lengths, policy.split)
    return {"kind": plan.kind, "budget_gib": plan.budget / 2**30, "needed_gib": plan.needed / 2**30,
            "kv_gib": plan.kv / 2**30, "message": plan.message, "full_message": full_message,
            "split": policy.split if policy is not None and policy.tiered else None,
            "host_resident": bool(getattr(policy, "host_resident", False))}, policy


def fixed_planner(profile):
    """The restore planner of this profile as it was measured, which does not learn from the restores it plans
    (ProfilePlanner.observe does, and saves what it learned to the bench's store): so every method of a workload
    plans with the same profile, and a method measured after kv-split is not restoring a chat compacted and planned
    by what kv-split's restores taught (2026-11-28: xkv's copy kept 114 MB more on disk than kv-split's for that)."""
    from kvchat.engine.restore.plan import plan_restore

    def plan(rounds, groups, background):
        return plan_restore(rounds, groups, profile, background)

    return plan


def _compacted_copy(store, engine, sid: str) -> tuple[str, object, dict]:
    """kv-split's chat: the stored chat forked (sharing its files) and compacted for this machine's profile
    (measured here once per model and kept in the bench's store), and the planner of that profile."""
    from kvchat.app.session.compaction import compact_session
    from kvchat.app.session.profile import ensure_profile
    from kvchat.storage.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    profile = ensure_profile(engine, model_fingerprint(Path(engine.path), store))
    profile_s = time.perf_counter() - t0
    fork = store.fork_session(sid, len(store.rounds(sid)), "kv-split")
    report = compact_session(store, fork, profile)
    return fork, fixed_planner(profile), {
        "split_disk_bytes": report.bytes_left, "split_compacted_rounds": len(report.rounds),
        "split_compacted_prefix": list(report.prefix), "split_profile_s": profile_s,
        "split_profile": profile.to_dict()}


def merge_settings(model: str) -> dict:
    """How kv-merge merges on `model`. On every real model (the embedded one, gemma-3-270m): as `kvchat merge` does
    for a user, only pairs the model's check accepted, chosen by Krul's I-R test at its gamma. On a random-weight
    shape: the check off and gamma 0 -- random weights attend almost uniformly, so no layer shows the I-R pattern and
    the statistics only rank pairs, at the share asked for. That is not a path any user gets: its figures are of
    speed and bytes only, and every table labels them "unchecked" (resume_tables.method_label)."""
    from kvchat.engine.policies.merge_selection import GAMMA
    from kvchat.engine.train.synthetic import SHAPES

    checked = model not in SHAPES
    return {"checked": checked, "gamma": GAMMA if checked else 0.0}


def _merged_copy(store, engine, sid: str, model: str) -> tuple[str, dict]:
    """kv-merge's chat: the stored chat forked and stored again with layer pairs merged (kvchat merge)."""
    from kvchat.app.session.chat import ChatSession
    from kvchat.app.session.merges import ChatMerges
    from kvchat.storage.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    fork = store.fork_session(sid, len(store.rounds(sid)), "kv-merge")
    how = merge_settings(model)
    checked = how["checked"]
    merges = ChatMerges(store, fork, engine, model_fingerprint(Path(engine.path), store), MERGE_SHARE,
                        checked=checked, gamma=how["gamma"])
    session = ChatSession(store, engine, fork, merges=merges)
    session.restore()
    merged = session.store_merged()
    session.close()
    if session.writer.errors:
        raise KvchatError(f"storing the merged chat failed: {session.writer.errors[0]}")
    return fork, {"merge_disk_bytes": sum(s["byte_size"] for s in store.segments(fork)), "merge_rounds": merged,
                  "merge_pairs": [str(p) for p in merges.pairs()], "merge_checked": checked,
                  "merge_gamma": how["gamma"],
                  # the pairs the model's check accepted (its merge calibration); None: no check (random weights)
                  "merge_check_accepted": [str(p) for p in merges.allowed] if checked else None,
                  "merge_share": MERGE_SHARE, "merge_s": time.perf_counter() - t0}


def _stream_figures(stats) -> dict:
    """What each stream of a planned restore did (kv-split)."""
    return {"split_tokens_planned": stats.tokens_planned, "split_tokens_loaded": stats.tokens_loaded,
            "split_compute_ms": stats.compute_ms, "split_compute_launch_ms": stats.compute_launch_ms,
            "split_load_ms": stats.load_ms, "split_gap_ms": stats.gap_ms,
            "split_restore_ms": stats.restore_ms, "split_predicted_ms": stats.predicted_ms or 0.0,
            "split_plan": stats.plan, **{f"split_phase_{k}_ms": v for k, v in stats.phases_ms.items()}}


def _policy(method: str, engine):
    """policy:NAME or policy:NAME@W (W: the watershed layer, instead of calibrating the model)."""
    from kvchat.app.session.policies import build_policy
    from kvchat.engine.policies import make_policy

    name, _, watershed = method.split(":", 1)[1].partition("@")
    if not watershed:
        return build_policy(name, engine)  # the model's calibration, made on first use
    if not watershed.isdigit():
        raise KvchatError(f"{method}: the watershed layer after @ must be a layer number")
    return make_policy(name, engine, watershed=int(watershed))


def split_stored_rounds(store, engine, sid: str, policy) -> None:
    """Store every round of the chat as the round policy does (a lower and an upper segment)."""
    from kvchat.app.session.chat import ChatSession

    session = ChatSession(store, engine, sid, policy=policy)
    session.restore()
    session.store_tiers()
    session.close()


def _tiered_figures(cache, out) -> dict:
    """What Round Attention kept and cost for the answer: TTFT shares, transfer, device K/V against the full cache."""
    st = cache.stats
    ttft_ms = 1000 * out.first_token_seconds
    return {"tiered_select_ms": st.select_ms, "tiered_transfer_ms": st.transfer_ms,
            "tiered_decode_select_ms": st.decode_select_ms,
            "tiered_transfer_mib": st.transfer_bytes / 2**20, "tiered_prefill_ms": ttft_ms,
            "tiered_prompt_transfer_ms": st.prompt_transfer_ms,
            # what delays the first token: selection and the prompt's transfer (not rounds brought in while decoding)
            "tiered_overhead_share": (st.select_ms + st.prompt_transfer_ms) / ttft_ms if ttft_ms else 0.0,
            "tiered_rounds": st.rounds, "tiered_chosen": len(st.chosen), "tiered_added": len(st.added),
            "tiered_rechecks": st.rechecks, "tiered_recheck_ms": st.recheck_ms, "tiered_found": len(st.found),
            "tiered_device_kv_mib": cache.device_bytes() / 2**20, "tiered_full_kv_mib": cache.full_bytes() / 2**20,
            "tiered_kv_fraction": cache.device_bytes() / cache.full_bytes()}
