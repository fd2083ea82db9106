"""`kvchat bench plot`: the PNG figures of docs/benchmarks.md, drawn from the JSON `kvchat bench --json` wrote (so
a GPU run's results can be plotted on any machine)."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.errors import KvchatError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise KvchatError("plotting needs matplotlib: pip install 'kvchat[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _ok_rows(results: dict):
    """(model, workload row, method result) for every method that ran."""
    for entry in results["models"]:
        for row in entry["workloads"]:
            for m in row.get("methods", []):
                if m.get("status") == "ok":
                    yield entry["model"], row, m


def plot_results(results_path: Path, out_dir: Path) -> list[Path]:
    try:
        results = json.loads(results_path.read_text())
        methods = results["settings"]["methods"]
        models = results["models"]
    except (OSError, ValueError, KeyError, TypeError):
        raise KvchatError(f"{results_path} is not the JSON of `kvchat bench --json`") from None
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = results_path.stem
    device = f"{results['machine']['device']}, {results['settings']['dtype']}, {results['date']}"
    rows = list(_ok_rows(results))
    written = []

    def save(fig, name: str) -> None:
        path = out_dir / f"{prefix}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    # Time to first token: one group of bars per (model, workload), the floor as a black tick.
    groups = [(e["model"], r) for e in models for r in e["workloads"] if not r.get("skipped")]
    if groups:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups)), 4.2))
        width = 0.8 / max(1, len(methods))
        for j, method in enumerate(methods):
            xs, ys = [], []
            for i, (_, r) in enumerate(groups):
                m = next((m for m in r["methods"] if m["method"] == method and m.get("status") == "ok"), None)
                if m:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(1000 * m["ttft_warm_s"])
            ax.bar(xs, ys, width, label=method, color=f"C{j}")  # fixed per method, even when it has no bars
        for i, (_, r) in enumerate(groups):
            if r.get("floor"):
                ax.hlines(1000 * r["floor"]["seconds"], i - 0.45, i + 0.45, colors="black", linewidth=2,
                          label="floor" if i == 0 else None)
        ax.set_xticks(range(len(groups)), [f"{m}\n{r['workload']} ({r['tokens']:,} tok)" for m, r in groups],
                      fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, warm (ms, log)")
        ax.set_title(f"Resuming a chat: time to first token\n{device}", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "ttft")

    # Bytes on disk per token, by method, per model (the workloads agree to a few percent; their median).
    by_model: dict[str, dict[str, list[float]]] = {}
    for model, _, m in rows:
        by_model.setdefault(model, {}).setdefault(m["method"], []).append(m["bytes_per_token"])
    if by_model:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        names = list(by_model)
        width = 0.8 / max(1, len(methods))
        for j, method in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i, n in enumerate(names) if method in by_model[n]]
            ys = [sorted(v)[len(v) // 2] for n in names if (v := by_model[n].get(method))]
            ax.bar(xs, ys, width, label=method, color=f"C{j}")  # fixed per method, even when it has no bars
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("bytes on disk per chat token")
        ax.set_title(f"What a saved chat costs on disk\n{device}", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "bytes-per-token")

    # Decode speed against context length, one line per (model, method).
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for model, row, m in rows:
        lines.setdefault((model, m["method"]), []).append((m["context"], m["decode_tok_s"]))
    if lines:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for (model, method), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {method}")
        ax.set_xscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"Decode speed after resuming\n{device}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "decode")

    gpu = [(model, row, m) for model, row, m in rows if m.get("peak_gpu_gib") is not None]
    if gpu:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for model, row, m in gpu:
            series.setdefault((model, m["method"]), []).append((row["tokens"], m["peak_gpu_gib"]))
        for (model, method), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {method}")
        ax.set_xscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("peak GPU memory (GiB)")
        ax.set_title(f"Peak GPU memory while resuming\n{device}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "peak-gpu")

    split = [(model, row, m) for model, row, m in rows if m["method"] == "kv-split" and "split_cold" in m]
    if split:
        # The restore pipeline's two streams per workload, cold and warm: how long each ran, and the restore.
        fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(split)), 4.2))
        labels, x = [], 0
        for model, row, m in split:
            for key, figures in (("cold", m["split_cold"]), ("warm", m)):
                ax.bar(x - 0.27, figures["split_compute_ms"], 0.27, color="C0",
                       label="recompute stream" if x == 0 else None)
                ax.bar(x, figures["split_load_ms"], 0.27, color="C1", label="load stream" if x == 0 else None)
                ax.bar(x + 0.27, figures["split_restore_ms"], 0.27, color="C2", label="restore" if x == 0 else None)
                labels.append(f"{model}\n{row['workload']} {key}")
                x += 1
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"kv-split: the two streams of a planned restore\n{device}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "streams")
    return written
