"""`kvchat bench` and its subcommands (and, through app/bench/eval_command.py, `kvchat eval`): the commands of the
benchmark and eval harnesses. The harnesses (the other modules of app/bench/) measure; the commands parse options,
print and write the JSON.

`register` adds them to the `kvchat` group, as app/chats.py does for the chat commands; app/cli.py calls it and
passes its own model option and device and model resolution, so every command takes --model and --device alike.
Every import of torch, the engine or a harness is inside a command, so `kvchat --help` imports none of them.
"""

from __future__ import annotations

import json

import click

from kvchat.app.bench import eval_command
from kvchat.app.chats import parse_gpu_memory

# `bench engine --qtype`: BF16 and app/bench/engine_speed.py's QTYPES (named here: importing that module imports torch)
BENCH_QTYPES = ["BF16", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


class _MethodsOption(click.Option):
    """`bench --methods`, whose help names every method and the default ones from the benchmark's own lists, so a new
    method is never left out of it; read only when the help is shown (the lists import torch)."""

    def get_help_record(self, ctx: click.Context):
        from kvchat.app.bench.resume import default_methods, method_names

        import textwrap

        text = (f"Comma-separated, of: {', '.join(method_names())} (a round policy also as policy:NAME@W, at "
                f"watershed layer W). Default: {', '.join(default_methods())}.")
        # Wrapped here, never inside a name (click's own wrapping splits "kv-split" at its hyphen); "\b": as is.
        lines = textwrap.wrap(text, 44, break_on_hyphens=False, break_long_words=False)
        self.help = "\b\n" + "\n".join(lines)
        return super().get_help_record(ctx)


def _shares(text: str, option: str) -> list[float]:
    """Comma-separated shares, each in (0, 1]; a one-line error naming `option` otherwise."""
    from kvchat.errors import KvchatError

    try:
        shares = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"{option} takes comma-separated shares, not {text!r}") from None
    if not shares or not all(0 < x <= 1 for x in shares):
        raise KvchatError(f"{option} takes shares in (0, 1], not {text!r}")
    return shares


def register(main: click.Group, model_option, to_device, resolve_model) -> None:
    """Add `eval` and the `bench` group to `main`. `model_option` decorates a command with --model; `to_device`
    turns a --device value into a torch device (None: the default) and refuses an unknown or absent one;
    `resolve_model` is the --model callback, for an option that defaults to no model."""
    eval_command.register(main, model_option, to_device)

    @main.group(invoke_without_command=True)
    @click.option("--models", default="embedded,qwen2.5-0.5b,llama-3.2-1b,llama-3.1-8b", show_default=True,
                  help="Comma-separated: embedded, random-weight models shaped like public ones, and/or gemma-3-270m "
                       "(real weights: the gemma extra).")
    @click.option("--workloads", default="2k,8k,32k", show_default=True,
                  help="Comma-separated chat lengths (memory dialogues on the embedded model, MT-Bench chats "
                       "otherwise).")
    @click.option("--methods", default=None, cls=_MethodsOption, help="Comma-separated resume methods.")
    @click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
                  help="Warm runs after the cold one (the warm figure is their median).")
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the random models are kept (default: $KVCHAT_HOME/bench-models).")
    @click.option("--work-dir", type=click.Path(file_okay=False), default=None,
                  help="Where this run's chat stores and state files go (default: a new temporary folder).")
    @click.option("--llama-cpp-budget", default=120.0, show_default=True, type=click.FloatRange(min=0),
                  help="Seconds llama.cpp may take per workload; longer ones are skipped with the estimate.")
    @click.option("--disk-probe-mib", default=1024, show_default=True, type=click.IntRange(min=16),
                  help="Size of the file the disk read bandwidth is measured on.")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the results here.")
    @click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
                  help="Write the tables here (markdown).")
    @click.option("--qtype", "resume_qtype", default="BF16", show_default=True, type=click.Choice(["BF16", "Q4_K_M"]),
                  help="The random-weight models' type (built once into --cache-dir; the embedded and known models "
                       "keep their own).")
    @click.option("--gpu-memory", "gpu_memory", default=None, metavar="SIZE", callback=parse_gpu_memory,
                  help="GPU memory each kvchat method may use (8GiB, 12GiB; default: unlimited), planned as the app "
                       "plans a chat: a chat whose K/V does not fit whole runs on the tiered cache (kv-load, "
                       "kv-split: at the watershed a policy:round@W method names, else the model's calibration), or "
                       "its method is skipped (prefill, kv-merge); llama.cpp is not bound by it.")
    @click.pass_context
    def bench(ctx, models, workloads, methods, repeats, device, cache_dir, work_dir, llama_cpp_budget, disk_probe_mib,
              json_path, markdown_path, resume_qtype, gpu_memory) -> None:
        """Benchmarks that print numbers (record them in docs/benchmarks.md with device and date).

        Without a subcommand: the resume benchmark. Time to the first token of a new message in an old chat, by
        re-prefilling it, loading its KV from our store, llama.cpp's state file and every KV policy, each in a fresh
        process; bytes on disk per token, decode speed, peak GPU memory, agreement with prefill, recall accuracy on
        the embedded model, and the machine's floor (disk, host-to-device, matmul) measured in the same run.
        """
        if ctx.invoked_subcommand is not None:
            return
        from pathlib import Path

        from kvchat.app.bench.resume import Plan, default_methods, method_names, model_names, parse_names, run_benchmark
        from kvchat.app.bench.resume_tables import markdown
        from kvchat.engine.data.workloads import parse_workloads

        plan = Plan(models=parse_names(models, model_names(), "model"), workloads=parse_workloads(workloads),
                    methods=parse_names(methods, method_names(), "method") if methods else default_methods(),
                    repeats=repeats, device=str(to_device(device)) if device else None,
                    cache_dir=Path(cache_dir) if cache_dir else None, work_dir=Path(work_dir) if work_dir else None,
                    llama_cpp_budget_s=llama_cpp_budget, disk_probe_bytes=disk_probe_mib << 20, qtype=resume_qtype,
                    gpu_memory=gpu_memory)
        steps = 1 + sum(1 + (1 if "llama.cpp" in plan.methods else 0) + len(plan.workloads) * len(plan.methods)
                        for _ in plan.models)
        from kvchat.app.cli_progress import counted_progress

        done = 0
        with counted_progress(f"kvchat bench: {steps} steps") as shown:
            def progress(label: str) -> None:
                nonlocal done
                done = min(done + 1, steps)
                shown(done, steps)  # each step's label is in the log lines above the bar

            def save(results: dict) -> None:  # after every workload too: a run stopped at a time limit keeps its rows
                if json_path:
                    Path(json_path).write_text(json.dumps(results, indent=2))
                if markdown_path:
                    Path(markdown_path).write_text(markdown(results) + "\n")

            results = run_benchmark(plan, progress=progress, log=lambda line: click.echo(line, err=True),
                                    checkpoint=save)
        save(results)
        click.echo(markdown(results))

    @bench.command("plot")
    @click.argument("results", type=click.Path(exists=True, dir_okay=False))
    @click.option("-o", "--out", "out_dir", default="docs/plots", show_default=True, type=click.Path(file_okay=False),
                  help="Folder for the PNG files.")
    def bench_plot(results, out_dir) -> None:
        """PNG plots (matplotlib) from the JSON that `kvchat bench --json` wrote."""
        from pathlib import Path

        from kvchat.app.bench.plots import plot_results

        for path in plot_results(Path(results), Path(out_dir)):
            click.echo(str(path))

    @bench.command("engine")
    @click.option("--shape", "shapes", multiple=True, default=["llama-3.2-1b", "llama-3.1-8b"], show_default=True,
                  help="Random-weight model shaped like a public one (repeatable).")
    @click.option("--context", "contexts", default="1024,8192", show_default=True, callback=_int_list,
                  help="Context lengths for prefill and decode.")
    @click.option("--qtype", default="BF16", show_default=True, type=click.Choice(BENCH_QTYPES),
                  help="The random model's weight type: BF16, or that file quantized by llama.cpp's quantizer "
                       "(built once into --cache-dir).")
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the random models are kept (default: $KVCHAT_HOME/bench-models).")
    @click.option("--cold", is_flag=True, help="Drop the OS page cache before each load (Linux, root).")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
    @click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
                  callback=lambda ctx, param, value: None if value is None else resolve_model(ctx, param, value),
                  help="A GGUF file or known short name to measure instead of the random shapes (a model with "
                       "sliding-window layers is measured with them in rings as well).")
    @click.option("--weights", type=click.Choice(["auto", "quantized", "quantized-float", "dequantized", "both",
                                                   "all"]), default="auto", show_default=True,
                  help="Keep a quantized file's matrices in their GGUF blocks on the device (quantized: the decode "
                       "products quantize x to int8 and take integer dot products where the type has such a kernel; "
                       "quantized-float: every one dequantizes in registers in float), dequantize them at load "
                       "(bf16), or measure several in one run (both: dequantized and quantized; all: the three; "
                       "auto: quantized on CUDA).")
    def bench_engine(shapes, contexts, qtype, device, cache_dir, cold, json_path, model_path, weights) -> None:
        """Load time, prefill and decode tokens/s and KV cache memory of the bare engine, on random models of real
        shapes or on --model."""
        from pathlib import Path

        from kvchat.app.bench.engine_speed import as_dict, bench_file, bench_shape
        from kvchat.engine.train.synthetic import SHAPES
        from kvchat.errors import KvchatError
        from kvchat.paths import data_dir

        # (quantized, int8 activations) per measured engine
        kinds = {"auto": [(None, True)], "quantized": [(True, True)], "quantized-float": [(True, False)],
                 "dequantized": [(False, True)], "both": [(False, True), (True, True)],
                 "all": [(False, True), (True, False), (True, True)]}[weights]
        if model_path is not None:
            path = Path(model_path)
            results = [as_dict(bench_file(path, path.name, "file", contexts, to_device(device), log=click.echo,
                                          cold=cold, quantized=q, int8_activations=a)) for q, a in kinds]
            if json_path:
                Path(json_path).write_text(json.dumps(results, indent=2))
            return
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown:
            raise KvchatError(f"unknown shape {unknown[0]!r} (accepted: {', '.join(SHAPES)})")
        folder = Path(cache_dir) if cache_dir else data_dir() / "bench-models"
        results = [as_dict(bench_shape(folder, s, contexts, qtype, to_device(device), log=click.echo, cold=cold,
                                       quantized=q, int8_activations=a)) for s in shapes for q, a in kinds]
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=2))

    @bench.command("loopserve")
    @model_option
    @click.option("--shape", default=None, help="A random-weight model shaped like a public one instead of --model "
                                                "(speed only: random attention is nearly uniform).")
    @click.option("--context", "contexts", default="8192,32768,65536", show_default=True, callback=_int_list,
                  help="Context lengths (tokens).")
    @click.option("--alpha", default=0.955, show_default=True, type=click.FloatRange(min=0.0, max=1.0, min_open=True),
                  help="The attention mass the prefill's chosen lines keep.")
    @click.option("--budget", default=1024, show_default=True, type=click.IntRange(min=1),
                  help="Input slots each KV head decodes over.")
    @click.option("--densities", default="0.02,0.05,0.1", show_default=True,
                  help="Kernel figures: densities of synthetic lines (comma-separated shares of the keys).")
    @click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the random models are kept (default: $KVCHAT_HOME/bench-models).")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
    def bench_loopserve(model_path, shape, contexts, alpha, budget, densities, repeats, device, cache_dir,
                        json_path) -> None:
        """LoopServe: sparse against dense prefill (the kernel at set densities, and the model's whole prefill under
        its online selection), progressive against full-cache decode; each pair in the same run."""
        from pathlib import Path

        from kvchat.app.bench.engine_speed import model_file
        from kvchat.app.bench.loopserve import as_dict, attention_figures, bench_model
        from kvchat.engine.engine import Engine
        from kvchat.engine.train.synthetic import SHAPES
        from kvchat.errors import KvchatError
        from kvchat.paths import data_dir

        shares = _shares(densities, "--densities")
        if shape is not None and shape not in SHAPES:
            raise KvchatError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
        path = model_file(Path(cache_dir) if cache_dir else data_dir() / "bench-models", shape) if shape else model_path
        engine = Engine(path, device=to_device(device))
        cfg = engine.config
        click.echo(f"{shape or path}: {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, head size {cfg.head_dim}, "
                   f"{engine.device}")
        kernel = []
        if engine.device.type == "cuda":
            for context in contexts:
                f = attention_figures(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, context, shares, engine.device,
                                      dtype=engine.dtype)
                kernel.append(f)
                parts = ", ".join(f"{s['density']:.3f}: {s['median_s'] * 1e3:.1f} ms ({s['speedup']:.2f}x)"
                                  for s in f["sparse"])
                click.echo(f"  attention of one layer, {context} tokens: dense {f['dense']['median_s'] * 1e3:.1f} ms; "
                           f"sparse at density {parts}")
        figures = as_dict(bench_model(engine, contexts, repeats, log=click.echo, alpha=alpha, budget=budget))
        figures["attention"] = kernel
        figures["shape"] = shape
        if json_path:
            Path(json_path).write_text(json.dumps(figures, indent=2))

    @bench.command("xkv")
    @model_option
    @click.option("--shape", default=None, help="A random-weight model shaped like a public one instead of --model "
                                                "(speed only: random attention is nearly uniform).")
    @click.option("--qtype", default="BF16", show_default=True, type=click.Choice(BENCH_QTYPES),
                  help="With --shape: the file's type (quantized types run in their blocks on CUDA).")
    @click.option("--context", "contexts", default="8192,32768", show_default=True, callback=_int_list,
                  help="Context lengths (tokens).")
    @click.option("--budgets", default="0.4,0.2,0.1", show_default=True,
                  help="Shares of the K/V each reply reads (comma-separated, each in (0, 1]).")
    @click.option("--decode-tokens", default=128, show_default=True, type=click.IntRange(min=1))
    @click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the random models are kept (default: $KVCHAT_HOME/bench-models).")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
    def bench_xkv(model_path, shape, qtype, contexts, budgets, decode_tokens, repeats, device, cache_dir,
                  json_path) -> None:
        """XKV: decode over per-layer budgets (xkv through slot lists and over its working set, uniform at the same
        budget, and xkv with the chat in host memory, its message streamed through the device) against the full
        cache, with the bytes each step reads, the speed-up those bytes bound, and the K/V each holds on the
        device; each in the same run."""
        from pathlib import Path

        from kvchat.app.bench.engine_speed import model_file
        from kvchat.app.bench.xkv import as_dict, bench_model
        from kvchat.engine.engine import Engine
        from kvchat.engine.train.synthetic import SHAPES
        from kvchat.errors import KvchatError
        from kvchat.paths import data_dir

        shares = _shares(budgets, "--budgets")
        if shape is not None and shape not in SHAPES:
            raise KvchatError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
        cache = Path(cache_dir) if cache_dir else data_dir() / "bench-models"
        path = model_file(cache, shape, qtype) if shape else model_path
        engine = Engine(path, device=to_device(device))
        click.echo(f"{shape or path} {qtype if shape else ''}: {engine.device}")
        figures = as_dict(bench_model(engine, contexts, shares, repeats, log=click.echo, decode_tokens=decode_tokens))
        figures["shape"], figures["qtype"] = shape, qtype if shape else None
        if json_path:
            Path(json_path).write_text(json.dumps(figures, indent=2))

    @bench.command("parity")
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
                  help="Engine dtype (default: float32 on cpu, bfloat16 on cuda).")
    @click.option("--numerics", default=None, type=click.Choice(["llama.cpp", "exact"]),
                  help="Round activations as llama.cpp does (default on cpu/float32) or not.")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
    def bench_parity(device, dtype, numerics, json_path) -> None:
        """Our engine against llama.cpp on the reference models: logit error and agreeing greedy tokens."""
        import tempfile
        from dataclasses import asdict
        from pathlib import Path

        import torch

        from kvchat.app.bench.parity import compare, self_consistency
        from kvchat.engine.engine import Engine
        from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT, make_model

        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, spec in REFERENCE_MODELS.items():
                path = make_model(Path(tmp) / f"{name}.gguf", **spec)
                p = compare(path, REFERENCE_PROMPT, device=to_device(device),
                            dtype=getattr(torch, dtype) if dtype else None, numerics=numerics)
                own = self_consistency(path, Engine(path, device="cpu").encode_prompt(REFERENCE_PROMPT), p.greedy_steps)
                rows.append({"model": name, **asdict(p), "llama_cpp_decode_vs_batch": own})
                click.echo(f"{name:<24} {p.device:<6} {p.dtype:<9} {p.numerics:<9} rel. error {p.relative_error:.2e}  "
                           f"greedy {p.greedy_agreeing}/{p.greedy_steps}  llama.cpp decode vs its batch {own:.1e}")
        if json_path:
            Path(json_path).write_text(json.dumps(rows, indent=2))

    @bench.command("storage")
    @model_option
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=64),
                  help="Chat length (capped by the model's context).")
    @click.option("--shape", default=None, help="Use a random-weight model of this shape instead (see bench engine).")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Where random models are kept (default: $KVCHAT_HOME/bench-models).")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
    def bench_storage(model_path, device, tokens, shape, cache_dir, json_path) -> None:
        """Bytes on disk per token, decode stall while saving, and restore time against the disk's bandwidth."""
        from pathlib import Path

        from kvchat.app.bench.engine_speed import model_file
        from kvchat.app.bench.storage import as_dict
        from kvchat.app.bench.storage import bench_storage as run
        from kvchat.engine.train.synthetic import SHAPES
        from kvchat.errors import KvchatError
        from kvchat.paths import data_dir

        if shape is not None:
            if shape not in SHAPES:
                raise KvchatError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
            model_path = str(model_file(Path(cache_dir) if cache_dir else data_dir() / "bench-models", shape))
        figures = run(model_path, to_device(device), tokens, log=click.echo)
        if json_path:
            Path(json_path).write_text(json.dumps(as_dict(figures), indent=2))

    @bench.command("first-token")
    @model_option
    @click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
    @click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1))
    def bench_first_token(model_path, device, repeats) -> None:
        """Time to the first reply token of a short chat, from a cold start of the engine and with it loaded."""
        import statistics
        import time

        from kvchat.engine.engine import Engine
        from kvchat.engine.generate import generate
        from kvchat.engine.text.chat_format import Conversation, Round

        started = time.perf_counter()
        engine = Engine(model_path, device=to_device(device))
        load = time.perf_counter() - started
        conv = Conversation([Round("My name is Ada and I live in Lisbon.", "Nice to meet you, Ada."),
                             Round("Where do I live?")], system="You are a helpful assistant.")
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            prompt = sum(engine.chat.round_spans(conv), [])
            out = generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                           max_tokens=1)
            times.append(time.perf_counter() - t0)
            assert out.tokens
        warm = statistics.median(times[1:])
        click.echo(f"model {model_path} on {engine.device}: load {load:.3f} s; short chat ({len(prompt)} tokens): "
                   f"first reply token {times[0] * 1000:.1f} ms right after load, {warm * 1000:.1f} ms warm (median of "
                   f"{repeats}); cold start to first token {(load + times[0]) * 1000:.0f} ms")


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
    if not items or any(v < 1 for v in items):
        raise click.BadParameter(f"expected positive whole numbers, got {value!r}")
    return items
