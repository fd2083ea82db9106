"""`kvchat bench`: how soon an old chat answers again, by every way of resuming it, next to the physical floor.

For each model and workload (a long chat plus a new message) the chat is prepared once: stored round by round as
the app stores it, and saved by llama.cpp as its own state file. Then each method runs in a fresh process with the
model already loaded and warmed up:

- prefill     re-read the whole chat from text (render, tokenize, prefill), then answer;
- kv-load     restore the chat's KV from our store (ChatSession.restore, loading every stored round), then answer;
- kv-split    the restore pipeline: the chat compacted for this machine (kvchat compact), its first rounds
              recomputed while the rest loads, as planned from this machine's measured profile, then answer;
- llama.cpp   llama.cpp's own state file (llama_state_load_file) on the same GGUF file, then answer;
- kv-merge    the chat stored with layer pairs merged (Krul; r_l = 0.5: checked pairs on real models, Algorithm 1's
              own ranking of every layer on random weights, where neither the check nor the I-R test means
              anything), restored as kv-load, then answer;
- policy:NAME restore as kv-load, then answer under the KV policy NAME (what the new message may attend to;
              krul is measured as kv-merge).

The first timed run follows an untimed one (the process's first use of the chat's shapes, kept apart as
`ttft_first_use_s`) and a page-cache drop of the chat's files (cold, where the OS allows it); the warm figure is the
median of the repeats after it. Time to first token runs from the start of the method to the first token of the
reply. The floor probes (disk read bandwidth with a cold cache, host-to-device bandwidth, matmul FLOP/s) run in the
same command.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kvchat.errors import KvchatError
from kvchat.storage.known_models import is_known_model, resolve_model

ENGINE_METHODS = ("prefill", "kv-load", "kv-split", "kv-merge")
MERGE_SHARE = 0.5  # kv-merge: r_l, the share of layers merged (at most)
LLAMA_CPP = "llama.cpp"
REPLY_TOKENS = 32
RECALL_TOKENS = 48


def model_names() -> list[str]:
    """The embedded model, random-weight models of public shapes, and the known real models (storage.known_models:
    installed by an extra, assembled on first use)."""
    from kvchat.engine.train.synthetic import SHAPES
    from kvchat.storage.known_models import KNOWN_MODELS

    return ["embedded", *SHAPES, *KNOWN_MODELS]


def method_names() -> list[str]:
    from kvchat.engine.policies import POLICIES

    return [*ENGINE_METHODS, LLAMA_CPP, *(f"policy:{name}" for name in POLICIES if name != "krul")]


def default_methods() -> list[str]:
    """What runs when no method is named: every method but the round policies and kv-merge, which run when asked
    for (their quality is not at target yet, and each calibrates its model on first use)."""
    return [m for m in method_names() if not m.startswith("policy:round") and m != "kv-merge"]


def parse_names(text: str, accepted: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names or [text]:
        base, at, layer = name.partition("@")  # policy:NAME@W: a round policy at watershed layer W
        if at and base.startswith("policy:round") and base in accepted and layer.isdigit():
            continue
        if name not in accepted:
            raise KvchatError(f"unknown {what} {name!r} (accepted: {', '.join(accepted)})")
    return list(dict.fromkeys(names))


@dataclass
class Plan:
    models: list[str]
    workloads: list[str]
    methods: list[str]
    repeats: int = 3
    device: str | None = None
    cache_dir: Path | None = None  # random-weight models, kept between runs
    work_dir: Path | None = None  # stores and state files of this run
    llama_cpp_budget_s: float = 120.0  # per workload: more than this on llama.cpp is skipped, with the estimate
    disk_probe_bytes: int = 1 << 30
    child_timeout_s: float = 900.0
    seed: int = 0


# ---------------------------------------------------------------- the parent: plan, children, tables


def run_benchmark(plan: Plan, progress: Callable[[str], None] = lambda label: None,
                  log: Callable[[str], None] = lambda line: None,
                  checkpoint: Callable[[dict], None] = lambda results: None) -> dict:
    """Runs every child process and returns the results (what --json writes); `checkpoint` gets them after every
    workload, so a run stopped at a time limit keeps what it finished."""
    import torch

    from kvchat.app.bench.storage import _disk_read_mb_s
    from kvchat.app.bench.engine_speed import drop_page_cache, model_file
    from kvchat.app.bench import floor as fl

    work = Path(plan.work_dir or tempfile.mkdtemp(prefix="kvchat-bench-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(plan.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's default on each
    cold = drop_page_cache()
    disk = _disk_read_mb_s(work, plan.disk_probe_bytes)
    if isinstance(disk, tuple):  # newer probe: (one reader in order, many readers at once); the disk can do the best
        disk = max(disk)
    h2d = fl.host_to_device_gb_s(device)
    tflops = fl.matmul_tflops(device, dtype)
    progress("floor probes")
    log(f"floor probes: disk {disk:,.0f} MB/s ({'cold' if cold else 'page cache NOT dropped: not root'}), "
        f"host-to-device {'n/a (CPU)' if h2d is None else f'{h2d:,.1f} GB/s'}, matmul {tflops:,.2f} TFLOP/s "
        f"({str(dtype).removeprefix('torch.')})")
    results = {
        "benchmark": "resume", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": _machine(device),
        "settings": {"models": plan.models, "workloads": plan.workloads, "methods": plan.methods,
                     "repeats": plan.repeats, "reply_tokens": REPLY_TOKENS, "seed": plan.seed,
                     "llama_cpp_budget_s": plan.llama_cpp_budget_s, "device": str(device),
                     "dtype": str(dtype).removeprefix("torch.")},
        "floor_probes": {"disk_read_mb_s": disk, "disk_cold": cold, "host_to_device_gb_s": h2d,
                         "matmul_tflops": tflops, "dtype": str(dtype).removeprefix("torch.")},
        "models": [],
    }
    for model in plan.models:
        if model == "embedded":
            from kvchat.assets import DEFAULT_MODEL as path
        elif is_known_model(model):
            path = resolve_model(model)
        else:
            path = model_file(Path(plan.cache_dir or _default_cache()), model)
        out = work / model
        setup = _child(plan, {"kind": "setup", "model": model, "path": str(path), "out": str(out)}, out / "setup")
        progress(f"{model}: chats stored")
        entry = {"model": model, "path": str(path), "file_bytes": Path(path).stat().st_size,
                 "status": setup.get("status", "ok"), **{k: setup.get(k) for k in ("config", "params", "load_s")},
                 "workloads": []}
        results["models"].append(entry)
        llama = {}
        if LLAMA_CPP in plan.methods and entry["status"] == "ok":
            llama = _child(plan, {"kind": "llama-setup", "model": model, "path": str(path), "out": str(out)},
                           out / "llama-setup")
            progress(f"{model}: llama.cpp state saved")
        for wl in plan.workloads:
            info = setup.get("workloads", {}).get(wl, {"skipped": entry["status"]})
            row = {"workload": wl, **{k: v for k, v in info.items() if k != "path"}, "methods": []}
            entry["workloads"].append(row)
            if not info.get("skipped") and "kv_disk_bytes" in info:
                cfg = setup["config"]
                flops = fl.recompute_flops(_config(cfg), info["tokens"])
                row["floor"] = asdict(fl.resume_floor(info["kv_disk_bytes"], flops, disk, h2d, tflops))
            for method in plan.methods:
                if info.get("skipped"):
                    row["methods"].append({"method": method, "status": f"skipped: {info['skipped']}"})
                    progress(f"{model} {wl} {method}")
                    continue
                if method == LLAMA_CPP:
                    state = llama.get("workloads", {}).get(wl) or {"skipped": llama.get("status", "no state")}
                    if state.get("skipped"):
                        row["methods"].append({"method": method, "status": f"skipped: {state['skipped']}",
                                               **{k: v for k, v in state.items() if k != "skipped"}})
                        progress(f"{model} {wl} {method}")
                        continue
                spec = {"kind": "method", "method": method, "model": model, "path": str(path),
                        "workload": info["path"], "out": str(out)}
                if method == LLAMA_CPP:
                    spec["state"] = state
                result = _child(plan, spec, out / wl / method.replace(":", "-"))
                row["methods"].append({"method": method, **result})
                progress(f"{model} {wl} {method}")
            _compare(row)
            for m in row["methods"]:
                log(_line(model, wl, m, row.get("floor")))
            checkpoint(results)
    return results


def _default_cache() -> Path:
    from kvchat.paths import data_dir

    return data_dir() / "bench-models"


def _config(d: dict):
    from kvchat.engine.gguf.config import ModelConfig

    return ModelConfig(**d)


def _machine(device) -> dict:
    import torch

    import llama_cpp

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": gpu or f"{os.cpu_count()}-core {platform.machine()} CPU", "gpu": gpu,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_build": "CUDA" if llama_cpp.llama_supports_gpu_offload() else "CPU"}


def _child(plan: Plan, spec: dict, folder: Path) -> dict:
    """Run one child process; its result, or {"status": "failed: <why>"}."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "device": plan.device, "repeats": plan.repeats, "seed": plan.seed,
            "workloads": plan.workloads, "budget_s": plan.llama_cpp_budget_s, "folder": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec))
    result_path = folder / "result.json"
    result_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvchat.app.bench.resume", "--child", str(folder / "spec.json")],
                              capture_output=True, text=True, timeout=plan.child_timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: took over {plan.child_timeout_s:.0f} s"}
    (folder / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or not result_path.exists():
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"status": f"failed: {last[:300]}"}
    return json.loads(result_path.read_text())


def _compare(row: dict) -> None:
    """Greedy agreement with prefill (identical reply tokens), and each method's ratio to the floor."""
    ref = next((m for m in row["methods"] if m["method"] == "prefill" and m.get("status") == "ok"), None)
    floor = row.get("floor")
    for m in row["methods"]:
        if m.get("status") != "ok":
            continue
        if ref is not None:
            a, b = m["reply_tokens"], ref["reply_tokens"]
            m["agree_tokens"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            m["identical_to_prefill"] = a == b
        if floor:
            for key in ("cold", "warm"):
                m[f"floor_ratio_{key}"] = m[f"ttft_{key}_s"] / floor["seconds"]


def _line(model: str, wl: str, m: dict, floor: dict | None) -> str:
    if m.get("status") != "ok":
        return f"{model} {wl} {m['method']}: {m.get('status')}"
    ratio = f", x{m['floor_ratio_warm']:.1f} floor" if floor else ""
    plan = (f"; plan: {m['split_plan']} (recompute {m['split_compute_ms']:,.0f} ms, load {m['split_load_ms']:,.0f} "
            f"ms)" if "split_plan" in m else "")
    if "merge_pairs" in m:
        plan = f"; layers {', '.join(m['merge_pairs']) or 'none'} merged in {m['merge_rounds']} rounds"
    return (f"{model} {wl} {m['method']}: first token {1000 * m['ttft_cold_s']:,.0f} ms cold, "
            f"{1000 * m['ttft_warm_s']:,.0f} ms warm{ratio}; {m['bytes_per_token']:,.0f} B/token on disk; "
            f"decode {m['decode_tok_s']:,.1f} tok/s{_setup_words(m)}{plan}")


def _setup_words(m: dict) -> str:
    setup = m.get("decode_setup_warm_s")
    return f" (after {1000 * setup:,.0f} ms of setup)" if setup is not None else ""


# ---------------------------------------------------------------- markdown


def _ms(s: float | None) -> str:
    return "" if s is None else f"{1000 * s:,.0f} ms" if s >= 0.01 else f"{1000 * s:,.1f} ms"


def markdown(results: dict) -> str:
    m, p, s = results["machine"], results["floor_probes"], results["settings"]
    lines = [f"**{m['device']}, {s['dtype']}, {results['date']}** (torch {m['torch']}, llama-cpp-python "
             f"{m['llama_cpp_python']}, {m['llama_cpp_build']} build; warm = median of {s['repeats']}; reply "
             f"{s['reply_tokens']} greedy tokens)", "",
             f"Floor probes: disk read {p['disk_read_mb_s']:,.0f} MB/s "
             f"({'page cache dropped' if p['disk_cold'] else 'page cache NOT dropped'}), host-to-device "
             + ("n/a (no GPU)" if p["host_to_device_gb_s"] is None else f"{p['host_to_device_gb_s']:,.1f} GB/s")
             + f", matmul {p['matmul_tflops']:,.2f} TFLOP/s ({p['dtype']}).", ""]
    for entry in results["models"]:
        lines += [f"*{entry['model']}*" + ("" if entry.get("status", "ok") == "ok" else f": {entry['status']}"), "",
                  "| workload | method | first token, cold | warm | × floor (warm) | bytes on disk / token | "
                  "decode tok/s | peak GPU memory | greedy = prefill | recall |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in entry["workloads"]:
            if row.get("skipped"):
                lines.append(f"| {row['workload']} | all | {row['skipped']} | | | | | | | |")
                continue
            fl = row.get("floor")
            wl = f"{row['workload']} ({row['tokens']:,} tok, {row['rounds']} rounds)"
            if fl:
                lines.append(f"| {wl} | **floor** ({fl['bound']}-bound) | {_ms(fl['seconds'])} | | 1 | | | | | |")
            for mm in row["methods"]:
                if mm.get("status") != "ok":
                    lines.append(f"| {wl} | {mm['method']} | {mm['status']} | | | | | | | |")
                    continue
                gpu = "n/a (CPU)" if mm.get("peak_gpu_gib") is None else f"{mm['peak_gpu_gib']:.2f} GiB"
                if mm["method"] == LLAMA_CPP and mm.get("device") == "cuda":
                    gpu = "n/a (not torch)"
                agree = "" if "agree_tokens" not in mm else (
                    "yes" if mm["identical_to_prefill"] else f"no ({mm['agree_tokens']}/{len(mm['reply_tokens'])})")
                rec = mm.get("recall")
                recall = "" if not rec else f"{rec['correct']}/{rec['questions']}"
                ratio = f"{mm['floor_ratio_warm']:,.1f}" if "floor_ratio_warm" in mm else ""
                lines.append(f"| {wl} | {mm['method']} | {_ms(mm['ttft_cold_s'])} | {_ms(mm['ttft_warm_s'])} | "
                             f"{ratio} | {mm['bytes_per_token']:,.0f} | {mm['decode_tok_s']:,.1f} | {gpu} | "
                             f"{agree} | {recall} |")
        lines.append("")
        lines += _pipeline_table(entry)
    return "\n".join(lines)


def _pipeline_table(entry: dict) -> list[str]:
    """kv-split's two streams per workload, cold and warm (median), against kv-load and prefill of the same run."""
    rows = []
    for row in entry["workloads"]:
        by = {m["method"]: m for m in row.get("methods", []) if m.get("status") == "ok"}
        split = by.get("kv-split")
        if split is None:
            continue
        best = {k: min((by[m][f"ttft_{k}_s"] for m in ("kv-load", "prefill") if m in by), default=None)
                for k in ("cold", "warm")}
        for key, figures in (("cold", split["split_cold"]), ("warm", split)):
            ratio = "" if not best[key] else f"{split[f'ttft_{key}_s'] / best[key]:.2f}"
            bound = overlap_bound(by, row["tokens"], key)
            rows.append(f"| {row['workload']} ({row['tokens']:,} tok) | {key} | {figures['split_plan']} | "
                        f"{figures['split_compute_ms']:,.0f} ms | {figures['split_load_ms']:,.0f} ms | "
                        f"{figures['split_gap_ms']:,.0f} ms | {figures['split_predicted_ms']:,.0f} ms | "
                        f"{figures['split_restore_ms']:,.0f} ms | {ratio} | "
                        f"{'' if bound is None else f'{bound:.2f}'} |")
    if not rows:
        return []
    return ["*kv-split: the restore pipeline*", "",
            "| workload | page cache | plan | recompute stream | load stream | gap | predicted restore | restore | "
            "first token ÷ better of kv-load and prefill | the same at best (perfect overlap) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, ""]


def overlap_bound(by: dict[str, dict], tokens: int, key: str) -> float | None:
    """The lowest first token ÷ better of kv-load and prefill that any split could reach in this run (`key`: cold
    or warm): restore_plan.best_overlap_seconds of this run's own streams (recomputing everything: prefill's first
    token less a message's; loading everything: kv-load's, likewise), plus kv-split's message. The message over the
    restored chat is the same work for every method, so its time comes off both before they overlap."""
    from kvchat.engine.restore.plan import best_overlap_seconds

    if not all(m in by for m in ("prefill", "kv-load", "kv-split")):
        return None
    message = by["kv-load"]["message_ttft_warm_s"]
    recompute = by["prefill"][f"ttft_{key}_s"] - message
    load = by["kv-load"][f"ttft_{key}_s"] - message
    profile = by["kv-split"].get("split_profile") or {}
    linear, quadratic = profile.get("prefill_a", 1.0) * tokens, profile.get("prefill_b", 0.0) * tokens * tokens
    best = best_overlap_seconds(recompute, load, linear / (linear + quadratic)) + by["kv-split"]["message_ttft_warm_s"]
    return best / min(by["prefill"][f"ttft_{key}_s"], by["kv-load"][f"ttft_{key}_s"])


# ---------------------------------------------------------------- children


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    kind = spec["kind"]
    if kind == "setup":
        result = _setup(spec)
    elif kind == "llama-setup":
        result = _llama_setup(spec)
    elif spec["method"] == LLAMA_CPP:
        result = _run_llama(spec)
    else:
        result = _run_engine(spec)
    Path(spec["folder"], "result.json").write_text(json.dumps(result))


def _engine(spec):
    from kvchat.engine.engine import Engine

    return Engine(spec["path"], device=spec["device"])


def _setup(spec: dict) -> dict:
    """Build each workload's chat, prefill it once and store every round as the app does (one store per model, so
    the GGUF file is hashed once)."""
    from kvchat.app.session.chat import KVWriter, storage_groups, window_live_from, zero_unread_windows
    from kvchat.engine.generate import prefill
    from kvchat.engine.data.workloads import build_workload
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
        writer, start = KVWriter(store, fp), 0
        groups = storage_groups(cfg.n_layers, cfg.kv_bytes_per_token(engine.model.dtype.itemsize))  # as the app
        for i, (r, span) in enumerate(zip(conv.rounds, spans)):
            end = start + len(span)
            store.add_round(sid, RoundRow(i, r.user, r.assistant or "", start, end, now()))
            live = window_live_from(cfg, start, end, wl.tokens)  # sliding-window layers: as the app stores them
            for layers in groups:
                at = live if any(cfg.window(layer) for layer in layers) else start
                kv = zero_unread_windows(cache.read(layers, start, end), layers, cfg, start, at)
                writer.submit(sid, i, kv, layers, range(start, end), live_from=at)
            start = end
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


def _load_workload(path: str):
    from kvchat.engine.text.chat_format import Conversation, Round

    d = json.loads(Path(path).read_text())
    d["conversation"] = Conversation([Round(u, a) for u, a in d["rounds"]], d["system"])
    d["recall"] = [Round(u, a) for u, a in d["recall"]]
    return d


def _evict(paths: list[Path]) -> bool:
    """Push the chat's files out of the OS page cache, so the next read comes from the disk: the cold run."""
    from kvchat.storage.pagecache import evict

    return evict(paths)


def _chat_files(home: Path) -> list[Path]:
    """The store's database and segment files: what resuming a chat reads."""
    return [p for p in home.rglob("*") if p.is_file()]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(engine) -> None:
    """One short prefill and decode: kernels, allocator and (on CUDA) graph capture paths are ready before timing."""
    from kvchat.engine.generate import generate

    prompt = engine.encode_prompt("Hello there, how are you today?")
    generate(engine.model, engine.new_cache(64), prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=4)
    _sync(engine.device)


def _run_engine(spec: dict) -> dict:
    """prefill, kv-load or policy:NAME: the cold run, then the repeats, then (memory chats) the recall questions."""
    import torch

    from kvchat.app.session.chat import ChatSession
    from kvchat.engine.text.chat_format import Conversation, Round
    from kvchat.engine.generate import generate, prefill
    from kvchat.engine.policies import make_policy
    from kvchat.storage.db import Store

    from kvchat.engine.kv.tiered import TieredKV

    method = spec["method"]
    os.environ["KVCHAT_HOME"] = _load_workload(spec["workload"])["home"]  # the profile is kept with the bench's store
    engine = _engine(spec)
    policy = _policy(method, engine) if method.startswith("policy:") else None
    tiered = policy is not None and policy.tiered
    wl = _load_workload(spec["workload"])
    conv, chat, model = wl["conversation"], engine.chat, engine.model
    store = Store(Path(wl["home"]))
    sid, planner, split = wl["sid"], None, {}
    if method == "kv-split":
        sid, planner, split = _compacted_copy(store, engine, wl["sid"])
    elif method == "kv-merge":
        sid, split = _merged_copy(store, engine, wl["sid"], spec["model"])
    _warm_up(engine)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    def resume():
        """The cache holding the chat, its closed rounds, and where each round starts."""
        if method == "prefill":  # the chat's text from the store, as the app keeps it, read again from scratch
            text = Conversation([Round(r.user_text, r.assistant_text) for r in store.rounds(wl["sid"])],
                                store.session(wl["sid"])["system_prompt"])
            tokens = chat.conversation_tokens(text)
            cache = engine.new_cache(len(tokens) + 256)
            prefill(model, cache, tokens)
            return cache, text, None
        session = ChatSession(store, engine, sid, policy=policy if tiered else None, planner=planner)
        stats = session.restore()
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

    # One untimed resume and answer first: the process's first run of this chat's shapes (kernel choices, the
    # allocator growing: 50-70 ms at 2k on the H200) is paid here, so the cold run measures what it is meant to, the
    # chat's files coming from the disk. Its time is kept apart.
    _sync(engine.device)
    t0 = time.perf_counter()
    cache, closed, starts = resume()
    first_use_s = time.perf_counter() - t0 + answer(cache, closed, starts, wl["new_message"], 1).first_token_seconds
    close_sessions()
    del cache
    runs = []
    for run in range(1 + spec["repeats"]):
        dropped = _evict(_chat_files(Path(wl["home"]))) if run == 0 else None
        _sync(engine.device)
        t0 = time.perf_counter()
        cache, closed, starts = resume()
        t1 = time.perf_counter()
        out = answer(cache, closed, starts, wl["new_message"], REPLY_TOKENS)
        runs.append({"ttft_s": t1 - t0 + out.first_token_seconds, "resume_s": t1 - t0, "tokens": out.tokens,
                     "message_ttft_s": out.first_token_seconds, "decode_setup_s": out.decode_setup_seconds,
                     "decode_tok_s": out.decode_tokens_per_second, "text": out.text, "page_cache_dropped": dropped,
                     **(_tiered_figures(cache, out) if isinstance(cache, TieredKV) else {}),
                     **(_stream_figures(restores[-1]) if method == "kv-split" else {})})
        close_sessions()
        del cache
    result = _summarize(runs, wl, engine.device)
    result["ttft_first_use_s"] = first_use_s
    result["message_ttft_warm_s"] = statistics.median(r["message_ttft_s"] for r in runs[1:] or runs)
    if method == "kv-split":
        result.update(split)
        result["split_cold"] = {k: runs[0][k] for k in runs[0] if k.startswith("split_")}
        warm = runs[1:] or runs
        for key in warm[0]:
            if key.startswith("split_") and isinstance(warm[0][key], (int, float)):
                result[key] = statistics.median(r[key] for r in warm)
        result["split_plan"] = warm[-1]["split_plan"]
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
            correct += _recall_ok(got, expected)
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
    return result


def _compacted_copy(store, engine, sid: str) -> tuple[str, object, dict]:
    """kv-split's chat: the stored chat forked (sharing its files) and compacted for this machine's profile
    (measured here once per model and kept in the bench's store), and the planner of that profile."""
    from kvchat.app.session.compaction import compact_session
    from kvchat.app.session.profile import ensure_profile, profile_planner
    from kvchat.storage.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    profile = ensure_profile(engine, model_fingerprint(Path(engine.path), store))
    profile_s = time.perf_counter() - t0
    fork = store.fork_session(sid, len(store.rounds(sid)), "kv-split")
    report = compact_session(store, fork, profile)
    return fork, profile_planner(profile), {
        "split_disk_bytes": report.bytes_left, "split_compacted_rounds": len(report.rounds),
        "split_compacted_prefix": list(report.prefix), "split_profile_s": profile_s,
        "split_profile": profile.to_dict()}


def _merged_copy(store, engine, sid: str, model: str) -> tuple[str, dict]:
    """kv-merge's chat: the stored chat forked and stored again with layer pairs merged (kvchat merge)."""
    from kvchat.app.session.chat import ChatSession
    from kvchat.app.session.merges import ChatMerges
    from kvchat.engine.train.synthetic import SHAPES
    from kvchat.storage.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    fork = store.fork_session(sid, len(store.rounds(sid)), "kv-merge")
    checked = model not in SHAPES
    # Random weights attend almost uniformly, so no layer shows Krul's I-R pattern and the statistics only rank
    # pairs (gamma 0): the figures are of speed and bytes, at the share asked for.
    merges = ChatMerges(store, fork, engine, model_fingerprint(Path(engine.path), store), MERGE_SHARE,
                        checked=checked, **({} if checked else {"gamma": 0.0}))
    session = ChatSession(store, engine, fork, merges=merges)
    session.restore()
    merged = session.store_merged()
    session.close()
    if session.writer.errors:
        raise KvchatError(f"storing the merged chat failed: {session.writer.errors[0]}")
    return fork, {"merge_disk_bytes": sum(s["byte_size"] for s in store.segments(fork)), "merge_rounds": merged,
                  "merge_pairs": [str(p) for p in merges.pairs()], "merge_checked": checked,
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
    from kvchat.engine.policies import make_policy

    name, _, watershed = method.split(":", 1)[1].partition("@")
    if not watershed:
        return make_policy(name, engine)
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


def _recall_ok(got: str, expected: str) -> bool:
    from kvchat.app.bench.evaluate import reply_matches

    return reply_matches(got, expected)


def _summarize(runs: list[dict], wl: dict, device) -> dict:
    warm = runs[1:] or runs
    return {"status": "ok", "device": device.type, "context": wl["tokens"], "reply_tokens": runs[0]["tokens"],
            "reply_text": runs[0]["text"], "runs_agree": all(r["tokens"] == runs[0]["tokens"] for r in runs),
            "ttft_cold_s": runs[0]["ttft_s"], "ttft_warm_s": statistics.median(r["ttft_s"] for r in warm),
            "ttft_runs_s": [r["ttft_s"] for r in runs], "resume_warm_s": statistics.median(r["resume_s"] for r in warm),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in warm),
            # between the first token and the decode (capturing its graphs), in neither figure above
            **({"decode_setup_warm_s": statistics.median(r["decode_setup_s"] for r in warm)}
               if "decode_setup_s" in runs[0] else {}),
            "cold_files_evicted": bool(runs[0]["page_cache_dropped"])}


# ---------------------------------------------------------------- llama.cpp


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

    from kvchat.engine.text.chat_format import ChatFormat, chat_template
    from kvchat.engine.gguf.reader import GGUFFile
    from kvchat.engine.text.tokenizer import Tokenizer

    tok = Tokenizer(spec["path"])
    chat = ChatFormat(tok, chat_template(GGUFFile(spec["path"]).metadata))
    out, result = Path(spec["out"]), {"status": "ok", "workloads": {}}
    chats = {n: _load_workload(str(out / f"{n}.json")) for n in spec["workloads"] if (out / f"{n}.json").exists()}
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

    from kvchat.engine.text.chat_format import ChatFormat, chat_template
    from kvchat.engine.gguf.reader import GGUFFile
    from kvchat.engine.text.tokenizer import Tokenizer

    state = spec["state"]
    wl = _load_workload(spec["workload"])
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
        dropped = _evict([Path(state["file"])]) if run == 0 else None
        t0 = time.perf_counter()
        resume()
        t1 = time.perf_counter()
        prompt = chat.open_round_tokens(conv, wl["new_message"])
        tokens, first, rate = _llama_greedy(llm, prompt, REPLY_TOKENS, eog, t0)
        runs.append({"ttft_s": first, "resume_s": t1 - t0, "tokens": tokens, "decode_tok_s": rate,
                     "text": _text(tok, [t for t in tokens if t not in eog], chat.stop_strings), "page_cache_dropped": dropped})
    import torch

    result = _summarize(runs, wl, torch.device("cuda" if llama_cpp.llama_supports_gpu_offload() else "cpu"))
    if wl["expected_reply"] is not None:
        base = resume()
        asked = [(wl["new_message"], wl["expected_reply"])] + [(r.user, r.assistant) for r in wl["recall"]]
        correct = 0
        for user, expected in asked:
            tokens, _, _ = _llama_greedy(llm, chat.open_round_tokens(conv, user), RECALL_TOKENS, eog,
                                         time.perf_counter())
            text = _text(tok, [t for t in tokens if t not in eog], chat.stop_strings)
            correct += _recall_ok(text, expected)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one child process of `kvchat bench` (internal)")
    parser.add_argument("--child", required=True, help="the spec.json the parent wrote")
    _child_main(parser.parse_args(argv).child)


if __name__ == "__main__":
    main()
