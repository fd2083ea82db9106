"""`kvchat bench`: how soon an old chat answers again, by every way of resuming it, next to the physical floor.

For each model and workload (a long chat plus a new message) the chat is prepared once: stored round by round as
the app stores it, and saved by llama.cpp as its own state file. Then each method runs in a fresh process with the
model already loaded and warmed up:

- prefill     re-read the whole chat from text (render, tokenize, prefill), then answer;
- kv-load     restore the chat's KV from our store (ChatSession.restore, loading every stored round), then answer;
- kv-split    the restore pipeline: the chat compacted for this machine (kvchat compact), its first rounds
              recomputed while the rest loads, as planned from this machine's measured profile, then answer;
- llama.cpp   llama.cpp's own state file (llama_state_load_file) on the same GGUF file, then answer;
- kv-merge    the chat stored with layer pairs merged (Krul; r_l = 0.5), restored as kv-load, then answer. On real
              models (embedded, gemma-3-270m) the user's path, `kvchat merge`: only pairs the model's check
              accepted, at Krul's gamma. On random weights, where neither the check nor the I-R test means
              anything, the check is off and gamma 0 (Algorithm 1's ranking of every layer): not a path any user
              gets, so its results say `merge_checked: false` and the tables call it "kv-merge (unchecked, γ=0)";
- policy:NAME restore as kv-load, then answer under the KV policy NAME (what the new message may attend to;
              krul is measured as kv-merge).
- policy:louiskv+lazy  louiskv's lazy resume: the units read, the rounds the message's layers choose brought in
              before its first token, the rest after it (app/session/lazy.py); only when named.

The first timed run follows an untimed one (the process's first use of the chat's shapes, kept apart as
`ttft_first_use_s`) and a page-cache drop of the chat's files (cold, where the OS allows it); the warm figure is the
median of the repeats after it. Time to first token runs from the start of the method to the first token of the
reply. The floor probes (disk read bandwidth with a cold cache, host-to-device bandwidth, matmul FLOP/s) run in the
same command.

This module is the parent (the plan, the child processes, the results JSON) and each child's entry point; the
children's work is in resume_engine.py (our engine: storing the chats, each method) and resume_llama.py
(llama.cpp's state file), what they share in resume_common.py, and the tables in resume_tables.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kvchat.app.bench import resume_engine, resume_llama
from kvchat.app.bench.resume_common import LLAMA_CPP, REPLY_TOKENS
from kvchat.app.bench.resume_tables import result_line
from kvchat.errors import KvchatError
from kvchat.storage.known_models import is_known_model, resolve_model

ENGINE_METHODS = ("prefill", "kv-load", "kv-split", "kv-merge")


def model_names() -> list[str]:
    """The embedded model, random-weight models of public shapes, and the known real models (storage.known_models:
    installed by an extra, assembled on first use)."""
    from kvchat.engine.train.synthetic import SHAPES
    from kvchat.storage.known_models import KNOWN_MODELS

    return ["embedded", *SHAPES, *KNOWN_MODELS]


def method_names() -> list[str]:
    from kvchat.engine.policies import POLICIES

    # policy:louiskv+lazy: louiskv's lazy resume (app/session/lazy.py), run only when named
    return [*ENGINE_METHODS, LLAMA_CPP, *(f"policy:{name}" for name in POLICIES if name != "krul"),
            "policy:louiskv+lazy"]


def default_methods() -> list[str]:
    """What runs when no method is named: every method but the round policies and kv-merge, which run when asked
    for (their quality is not at target yet, and each calibrates its model on first use)."""
    return [m for m in method_names() if not m.startswith("policy:round") and m not in ("kv-merge",
                                                                                        "policy:louiskv+lazy")]


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
    qtype: str = "BF16"  # the random-weight models' type (engine_speed.model_file): BF16 or Q4_K_M
    gpu_memory: int | None = None  # bytes each method child may allocate on the GPU (--gpu-memory); None: no cap



# ---------------------------------------------------------------- the parent: plan, children, results


def run_benchmark(plan: Plan, progress: Callable[[str], None] = lambda label: None,
                  log: Callable[[str], None] = lambda line: None,
                  checkpoint: Callable[[dict], None] = lambda results: None) -> dict:
    """Runs every child process and returns the results (what --json writes); `checkpoint` gets them after every
    workload, so a run stopped at a time limit keeps what it finished."""
    import torch
    from kvchat.app.bench import floor as fl
    from kvchat.app.bench.engine_speed import drop_page_cache, model_file
    from kvchat.app.bench.storage import _disk_read_mb_s

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
                     "dtype": str(dtype).removeprefix("torch."), "qtype": plan.qtype,
                     "gpu_memory": plan.gpu_memory},
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
            path = model_file(Path(plan.cache_dir or _default_cache()), model, plan.qtype)
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
                log(result_line(model, wl, m, row.get("floor")))
            checkpoint(results)
    return results


def _default_cache() -> Path:
    from kvchat.paths import data_dir

    return data_dir() / "bench-models"


def _config(d: dict):
    from kvchat.engine.gguf.config import ModelConfig

    return ModelConfig(**d)


def _machine(device) -> dict:
    import llama_cpp
    import torch

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": gpu or f"{os.cpu_count()}-core {platform.machine()} CPU", "gpu": gpu,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_build": "CUDA" if llama_cpp.llama_supports_gpu_offload() else "CPU"}


def _child(plan: Plan, spec: dict, folder: Path) -> dict:
    """Run one child process; its result, or {"status": "failed: <why>"}."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "device": plan.device, "repeats": plan.repeats, "seed": plan.seed,
            "workloads": plan.workloads, "budget_s": plan.llama_cpp_budget_s, "folder": str(folder),
            # the GPU memory budget binds the methods only: the setup prefills and stores each chat unbounded
            "gpu_memory": plan.gpu_memory if spec["kind"] == "method" else None,
            # where the budget tiers a chat: the watershed a policy:round...@W method names (random weights have no
            # calibration worth making), else the model's calibration
            "tiered_watershed": next((int(m.partition("@")[2]) for m in plan.methods
                                      if m.startswith("policy:round") and "@" in m), None)}
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



# ---------------------------------------------------------------- a child: `-m kvchat.app.bench.resume --child`


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    kind = spec["kind"]
    if kind == "llama-setup" or (kind != "setup" and spec["method"] == LLAMA_CPP):
        result = resume_llama.run_child(spec)
    else:
        result = resume_engine.run_child(spec)
    Path(spec["folder"], "result.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one child process of `kvchat bench` (internal)")
    parser.add_argument("--child", required=True, help="the spec.json the parent wrote")
    _child_main(parser.parse_args(argv).child)



if __name__ == "__main__":
    main()
