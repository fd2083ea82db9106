"""`kvchat bench`'s words and tables: the log line of each method's result as it finishes, and the markdown of a
whole run (what `--markdown` writes and the command prints), from the results JSON alone."""

from __future__ import annotations

from kvchat.app.bench.resume_common import LLAMA_CPP


def method_label(m: dict) -> str:
    """A method's name as the log and the tables show it. kv-merge says which path its figure came from: "checked"
    is what `kvchat merge` does for a user (only pairs the model's check accepted); "unchecked, γ=0" is the
    random-weight benchmarks' path (check off, Krul's I-R test off), never a figure of what a user gets. A method
    the GPU memory budget put on the tiered cache says so."""
    if (m.get("memory_plan") or {}).get("kind") == "tiered" and not m["method"].startswith("policy:round"):
        return f"{m['method']} (tiered: GPU memory)"
    if m.get("method") != "kv-merge" or "merge_checked" not in m:
        return m["method"]
    if m["merge_checked"]:
        return "kv-merge (checked)"
    return f"kv-merge (unchecked, γ={m.get('merge_gamma', 0.0):g})"


def result_line(model: str, wl: str, m: dict, floor: dict | None) -> str:
    if m.get("status") != "ok":
        return f"{model} {wl} {m['method']}: {m.get('status')}"
    ratio = f", x{m['floor_ratio_warm']:.1f} floor" if floor else ""
    plan = (f"; plan: {m['split_plan']} (recompute {m['split_compute_ms']:,.0f} ms, load {m['split_load_ms']:,.0f} "
            f"ms)" if "split_plan" in m else "")
    if "merge_pairs" in m:
        plan = f"; layers {', '.join(m['merge_pairs']) or 'none'} merged in {m['merge_rounds']} rounds"
        if m.get("merge_check_accepted") is not None:
            plan += f" (the check accepted {', '.join(m['merge_check_accepted']) or 'no pair'})"
    return (f"{model} {wl} {method_label(m)}: first token {1000 * m['ttft_cold_s']:,.0f} ms cold, "
            f"{1000 * m['ttft_warm_s']:,.0f} ms warm{ratio}; {m['bytes_per_token']:,.0f} B/token on disk; "
            f"decode {m['decode_tok_s']:,.1f} tok/s{_setup_words(m)}{plan}")


def _setup_words(m: dict) -> str:
    setup = m.get("decode_setup_warm_s")
    return f" (after {1000 * setup:,.0f} ms of setup)" if setup is not None else ""



def _ms(s: float | None) -> str:
    return "" if s is None else f"{1000 * s:,.0f} ms" if s >= 0.01 else f"{1000 * s:,.1f} ms"


def markdown(results: dict) -> str:
    m, p, s = results["machine"], results["floor_probes"], results["settings"]
    lines = [f"**{m['device']}, {s['dtype']}, {results['date']}** (torch {m['torch']}, llama-cpp-python "
             f"{m['llama_cpp_python']}, {m['llama_cpp_build']} build; warm = median of {s['repeats']}; reply "
             f"{s['reply_tokens']} greedy tokens"
             + (f"; random models in {s['qtype']}" if s.get("qtype", "BF16") != "BF16" else "")
             + (f"; GPU memory budget {s['gpu_memory'] / 2**30:g} GiB" if s.get("gpu_memory") else "") + ")", "",
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
                if mm.get("memory_plan") and mm.get("peak_reserved_gib") is not None:  # against the plan
                    gpu += (f" ({mm['peak_reserved_gib']:.2f} reserved, {mm['memory_plan']['needed_gib']:.2f} "
                            f"planned)")
                if mm["method"] == LLAMA_CPP and mm.get("device") == "cuda":
                    gpu = "n/a (not torch)"
                agree = "" if "agree_tokens" not in mm else (
                    "yes" if mm["identical_to_prefill"] else f"no ({mm['agree_tokens']}/{len(mm['reply_tokens'])})")
                rec = mm.get("recall")
                recall = "" if not rec else f"{rec['correct']}/{rec['questions']}"
                ratio = f"{mm['floor_ratio_warm']:,.1f}" if "floor_ratio_warm" in mm else ""
                lines.append(f"| {wl} | {method_label(mm)} | {_ms(mm['ttft_cold_s'])} | {_ms(mm['ttft_warm_s'])} | "
                             f"{ratio} | {mm['bytes_per_token']:,.0f} | {mm['decode_tok_s']:,.1f} | {gpu} | "
                             f"{agree} | {recall} |")
        lines.append("")
        lines += _merge_lines(entry)
        lines += _pipeline_table(entry)
    return "\n".join(lines)


def _merge_lines(entry: dict) -> list[str]:
    """kv-merge's bytes on disk against kv-load's of the same chat, each labelled with the path it came from."""
    out = []
    for row in entry["workloads"]:
        by = {m["method"]: m for m in row.get("methods", []) if m.get("status") == "ok"}
        merge, load = by.get("kv-merge"), by.get("kv-load")
        if merge is None or load is None or not load["bytes_on_disk"]:
            continue
        accepted = merge.get("merge_check_accepted")
        check = "" if accepted is None else f"; the check accepted {', '.join(accepted) or 'no pair'}"
        ratio = merge["bytes_on_disk"] / load["bytes_on_disk"]
        pairs = ", ".join(merge.get("merge_pairs") or []) or "none"
        out.append(f"- {row['workload']}: {method_label(merge)} stores {ratio:.3f}× kv-load's bytes (layers {pairs} "
                   f"merged in {merge.get('merge_rounds', 0)} rounds{check})")
    return [*out, ""] if out else []


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
