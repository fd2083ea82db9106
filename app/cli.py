"""The `kvchat` command: its group (no command: the terminal app), generate, info, calibrate and profile.

The chat commands are registered from app/chats.py, `bench` and `eval` from app/bench/commands.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvchat.app.chats import gpu_memory_option, guard_options, kv_budget_option, make_guard, report_stop
from kvchat.app.errors import FriendlyGroup


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.version_option(package_name="kvchat")
@click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
              help="The app only: GGUF model file, or a known model's short name (gemma-3-270m), for new chats "
                   "(default: the settings' choice, else the embedded model).")
@click.option("--device", default=None, help="The app only: cpu or cuda (default: cuda when available).")
# The choices are engine.policies.CHAT_POLICIES, written out: importing it would load torch for every command.
@click.option("--kv-policy", "kv_policy", default=None,
              type=click.Choice(["full", "round", "loopserve", "xkv", "louiskv"]),
              help="The app only: the KV policy chats run under, full, round (Round Attention on a tiered KV "
                   "cache; calibrates the model on first use), loopserve (sparse prefill of long messages, "
                   "progressive selection of what the reply reads), xkv (each layer reads its own budget of the "
                   "chat's K/V) or louiskv (the reply reads the clusters of the chat's keys it needs, 1,024 tokens; "
                   "calibrates the model on first use). Default: the settings' choice, else full.")
@gpu_memory_option
@kv_budget_option
@click.pass_context
def main(ctx: click.Context, model_path, device, kv_policy, gpu_memory, kv_budget) -> None:
    """kvchat: a local assistant whose chats resume from their saved KV cache instead of being re-read.

    With no command, kvchat opens the terminal app (press F1 there for its keys).
    """
    if ctx.invoked_subcommand is not None:
        if model_path is not None or device is not None or kv_policy is not None or gpu_memory is not None or \
                kv_budget is not None:
            from kvchat.errors import KvchatError

            raise KvchatError(f"--model, --device, --kv-policy, --gpu-memory and --kv-budget before a command apply to "
                              f"the app only; give them after `{ctx.invoked_subcommand}`")
        return
    from kvchat.app.tui.app import run_app

    if model_path is not None:
        model_path = _resolve_model(ctx, None, model_path)
    run_app(model_path, _device(device) and device, kv_policy, gpu_memory, kv_budget)


def _model_option(f):
    return click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
                        callback=_resolve_model,
                        help="GGUF model file (llama, qwen2, qwen3 or gemma3 architecture) or a known model's "
                             "short name (gemma-3-270m, from the `gemma` extra); default: the embedded demo "
                             "model.")(f)


def _resolve_model(ctx, param, value):
    from kvchat.errors import InterruptedByUser, KvchatError

    if value is not None:
        from kvchat.storage.known_models import is_known_model, resolve_model

        if is_known_model(value):
            from kvchat.app.cli_progress import terminal_progress

            with terminal_progress() as shown:  # its first use assembles it from its packages (seconds)
                try:
                    return str(resolve_model(value, on_progress=shown))
                except KeyboardInterrupt:
                    raise InterruptedByUser(f"interrupted: {value} was not assembled (nothing half-written is "
                                            f"kept)") from None
        if not Path(value).is_file():
            raise KvchatError(f"{value}: no such file (give a GGUF file, or a known short name: gemma-3-270m)")
        return value
    from kvchat.assets import DEFAULT_MODEL

    if not DEFAULT_MODEL.exists():
        raise KvchatError(f"the embedded model is missing from this install ({DEFAULT_MODEL}); pass --model PATH")
    return str(DEFAULT_MODEL)


@main.command()
@_model_option
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0 means greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 means no limit.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=None, type=int, help="Seed for sampling (same seed, same text).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the tokens and text instead.")
@guard_options
@gpu_memory_option
@click.argument("prompt")
def generate(model_path, max_tokens, temperature, top_k, top_p, seed, device, as_json, guard, reply_cap,
             gpu_memory, prompt) -> None:
    """Complete a raw PROMPT (no chat template), streaming the text. PROMPT '-' reads standard input."""
    from dataclasses import replace

    from kvchat.app.session import memory
    from kvchat.app.session.memory import chat_needs, check_weights
    from kvchat.engine.engine import Engine
    from kvchat.engine.memory_plan import plan_memory
    from kvchat.engine.sampling import SamplingParams
    from kvchat.errors import GPUMemoryError

    if prompt == "-":
        prompt = sys.stdin.read()
    sampling = SamplingParams(temperature, top_k, top_p, seed).validate()
    reply_guard = make_guard(guard, reply_cap)
    budget = memory.memory_budget(_device(device), gpu_memory)
    check_weights(model_path, budget)
    engine = Engine(model_path, device=_device(device))
    tokens = engine.encode_prompt(prompt)
    if budget is not None:  # a raw completion has no rounds to tier: its K/V fits whole or not at all
        plan = plan_memory(replace(chat_needs(engine, budget, 0, len(tokens) + max_tokens + 1, []), can_tier=False))
        if plan.kind == "refused":
            raise GPUMemoryError(plan.message)

    def stream(_token: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = engine.complete(tokens, max_tokens, sampling, on_token=None if as_json else stream, guard=reply_guard)
    if as_json:
        click.echo(json.dumps({
            "tokens": result.tokens, "text": result.text, "stop_reason": result.stop_reason,
            "prompt_tokens": len(tokens), "prefill_seconds": round(result.prefill_seconds, 6),
            "decode_tokens_per_second": round(result.decode_tokens_per_second, 3),
        }))
    else:
        if result.text:
            click.echo()
        else:  # not an empty line and silence: the demo model ends a raw, untemplated prompt at once
            click.echo(f"kvchat: notice: {nothing_generated_note(model_path)}", err=True)
        report_stop(result.stop_reason)


def nothing_generated_note(model_path: str) -> str:
    """What `generate` says when the model wrote nothing: the prompt is raw text, which a chat model may end at once."""
    from kvchat.app.session.service import is_demo_model

    note = "the model wrote nothing after the prompt (generate completes raw text, with no chat template)"
    if is_demo_model(model_path):
        note += ("; the embedded demo model answers chat messages: `kvchat new`, then `kvchat send ID \"My name is "
                 "Ada.\"`")
    return note


@main.command()
@_model_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(model_path, as_json) -> None:
    """Print a model's architecture and KV size without loading its weights."""
    from kvchat.engine.engine import ModelInfo
    from kvchat.engine.text.chat_format import FORMAT_TRANSCRIPT, FORMAT_WORDS

    mi = ModelInfo.read(model_path)
    cfg = mi.config
    facts = {
        "name": mi.name, "architecture": cfg.arch, "layers": cfg.n_layers, "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads, "head_size": cfg.head_dim, "embedding": cfg.d_model, "ffn": cfg.ffn_dim,
        "vocab": cfg.vocab_size, "context_length": cfg.context_length,
        "kv_bytes_per_token_f16": cfg.kv_bytes_per_token(2), "kv_bytes_per_token_f32": cfg.kv_bytes_per_token(4),
        "rope": ("neox" if cfg.rope_neox else "norm") + (", llama3 factors" if cfg.llama3_rope else ""),
        "tied_output": cfg.tied_output, "tensor_types": mi.tensor_types,
        "chat_format": mi.chat_format, "base_model": mi.chat_format == FORMAT_TRANSCRIPT,
    }
    if cfg.sliding_window:
        facts["sliding_window"] = (f"{cfg.sliding_window} tokens on {cfg.n_layers - len(cfg.global_layers)} of "
                                   f"{cfg.n_layers} layers")
    if as_json:
        click.echo(json.dumps(facts))
        return
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}×{v}" for k, v in sorted(value.items()))
        elif key == "chat_format":
            value = FORMAT_WORDS[value]
        click.echo(f"{key.replace('_', ' '):<{width}}  {value}")


@main.command()
@_model_option
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--chats", default=None, type=click.IntRange(min=1),
              help="Calibration chats (memory dialogues on the embedded model, MT-Bench chats otherwise) for each "
                   "measure. Default: each its own (the watershed 8; the trigger 16; the layer costs 144 "
                   "dialogues or 3 MT-Bench chats, minutes on a CPU).")
@click.option("--png", "png_path", default=None, type=click.Path(dir_okay=False),
              help="Where the curve's plot goes (default: next to the stored calibration).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (top-level `watershed`).")
def calibrate(model_path, device, chats, png_path, as_json) -> None:
    """Find the model's watershed layer for Round Attention, LouisKV's retrieval thresholds and XKV's layer costs,
    and store them (used automatically from then on)."""
    from kvchat.app.cli_progress import terminal_progress
    from kvchat.app.session.artifacts import save_calibration, save_layer_costs, save_trigger_calibration
    from kvchat.engine.calibrate.layer_costs import calibrate_layer_costs, cost_lines
    from kvchat.engine.calibrate.retrieval_trigger import calibrate_trigger
    from kvchat.app.session.progress import Reporter
    from kvchat.engine.calibrate.watershed import calibrate as measure
    from kvchat.engine.calibrate.watershed import curve_lines, plot_curve
    from kvchat.engine.engine import Engine
    from kvchat.errors import InterruptedByUser
    from kvchat.storage.db import Store
    from kvchat.storage.fingerprint import model_fingerprint

    engine = Engine(model_path, device=_device(device))
    fingerprint = model_fingerprint(Path(model_path), Store())
    with terminal_progress() as shown:  # a bar with the time left on a terminal; nothing on a pipe
        try:  # each result stored as it is made: a later one that fails or is interrupted loses no earlier one
            cal = measure(engine, fingerprint, **({"chats": chats} if chats else {}),
                          progress=Reporter("calibrating the watershed layer (chats)", shown))
            stored = save_calibration(cal)
            trigger = calibrate_trigger(engine, fingerprint, **({"chats": chats} if chats else {}),
                                        progress=Reporter("calibrating the retrieval trigger (chats)", shown))
            trigger_stored = save_trigger_calibration(trigger)
            costs = calibrate_layer_costs(engine, fingerprint, chats,
                                          progress=Reporter("measuring XKV's layer costs (runs)", shown))
            costs_stored = save_layer_costs(costs)
        except KeyboardInterrupt:
            raise InterruptedByUser("interrupted: the calibration stopped; what finished before it is stored") from None
    png = Path(png_path) if png_path else stored.with_suffix(".png")
    try:
        plot_curve(cal, png)
    except ImportError:
        click.echo("no plot: matplotlib is not installed (pip install 'kvchat[bench]')", err=True)
        png = None
    except OSError as exc:
        from kvchat.errors import KvchatError

        raise KvchatError(f"calibration stored in {stored}, but the plot cannot be written to {png}: {exc}") from None
    if as_json:
        from dataclasses import asdict

        click.echo(json.dumps({**asdict(cal), "path": str(stored), "png": str(png) if png else None,
                               "trigger": {**trigger.to_dict(), "path": str(trigger_stored)},
                               "layer_costs": {**costs.to_dict(), "path": str(costs_stored)}}))
        return
    click.echo(f"model {model_path}  {cal.n_layers} layers  {cal.chats} {cal.source} chats  device {engine.device}")
    for line in curve_lines(cal):
        click.echo(line)
    click.echo(f"watershed layer: {cal.watershed}")
    click.echo(f"stored {stored}" + (f"; plot {png}" if png else ""))
    click.echo("retrieval trigger (louiskv), per global layer: " + "  ".join(
        f"{layer}:{tau:.2f}" for layer, tau in zip(trigger.layers, trigger.tau))
        + f"  (retrieving at {trigger.share:.0%} of {trigger.steps} reply steps)")
    click.echo(f"stored {trigger_stored}")
    click.echo(f"xkv's layer costs, per global layer relative to the budget's largest, over {costs.positions} reply "
               f"positions of {costs.chats} {costs.source} chats:")
    for line in cost_lines(costs):
        click.echo(line)
    click.echo(f"stored {costs_stored}")


@main.command()
@_model_option
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--redo", is_flag=True, help="Measure again (a new disk, driver or GPU).")
@click.option("--file", "profile_file", default=None, type=click.Path(dir_okay=False),
              help="Plan with this profile (JSON, e.g. another machine's) instead of this machine's.")
@click.option("--plan-tokens", default="2048,8192,32768", show_default=True,
              help="Show the restore plan for chats of these lengths (comma-separated tokens).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (`profile`, `plans`).")
def profile(model_path, device, redo, profile_file, plan_tokens, as_json) -> None:
    """How fast this machine recomputes and loads the model's chats (measured once, a few seconds), and how a
    restore splits a chat between the two."""
    from kvchat.app.session.profile import ensure_profile, plan_table
    from kvchat.engine.restore.plan import HardwareProfile
    from kvchat.errors import KvchatError

    try:
        tokens = [int(t) for t in plan_tokens.split(",") if t.strip()]
        if not tokens or min(tokens) < 1:
            raise ValueError
    except ValueError:
        raise KvchatError(f"--plan-tokens must be positive whole numbers separated by commas, not {plan_tokens!r}")
    if profile_file:
        try:
            prof = HardwareProfile.from_dict(json.loads(Path(profile_file).read_text()))
        except OSError as exc:
            raise KvchatError(f"cannot read {profile_file}: {exc.strerror or exc}") from None
        except (ValueError, TypeError) as exc:
            raise KvchatError(f"{profile_file} is not a kvchat hardware profile ({str(exc)[:100]})") from None
    else:
        from kvchat.app.cli_progress import terminal_progress
        from kvchat.engine.engine import Engine
        from kvchat.errors import InterruptedByUser
        from kvchat.storage.db import Store
        from kvchat.storage.fingerprint import model_fingerprint

        engine = Engine(model_path, device=_device(device))
        with terminal_progress() as shown:  # a quick estimate kept from a first chat is measured whole here
            try:
                prof = ensure_profile(engine, model_fingerprint(Path(model_path), Store()), redo=redo,
                                      notice=lambda text: click.echo(f"kvchat: notice: {text}", err=True),
                                      on_progress=shown)
            except KeyboardInterrupt:
                raise InterruptedByUser("interrupted: the profile was not measured; the stored one (if any) is "
                                        "as it was") from None
    rows = plan_table(prof, tokens)
    if as_json:
        click.echo(json.dumps({"profile": prof.to_dict(), "plans": rows}))
        return
    h2d = "n/a (CPU)" if prof.h2d_gb_s is None else f"{prof.h2d_gb_s:,.1f} GB/s"
    click.echo(f"{prof.device}, {prof.dtype}, {prof.n_layers} layers, "
               + (f"estimated quickly {prof.date} (`kvchat profile` without --file measures it whole)"
                  if prof.provisional else f"measured {prof.date}"))
    click.echo(f"prefill: {prof.prefill_a * 1e6:,.2f} µs/token + {prof.prefill_b * 1e9:,.3f} ns/token² "
               f"({', '.join(f'{n:,} tokens {1000 * t:,.0f} ms' for n, t in prof.prefill_points)})")
    click.echo(f"disk {prof.disk_read_mb_s:,.0f} MB/s cold, {prof.cache_read_mb_s:,.0f} MB/s from the page cache; "
               f"verify+decompress {prof.decode_mb_s:,.0f} MB/s per thread x {prof.decode_threads}; host-to-device "
               f"{h2d}")
    compute_slow, load_slow = prof.slowdowns
    click.echo(f"side by side: recompute x{compute_slow:.2f}, load x{load_slow:.2f} (" +
               (f"median of {len(prof.observed)} restores" if prof.observed else "measured") + ")")
    click.echo("\n| chat | page cache | plan | recompute | load | restore | load everything | recompute everything |")
    click.echo("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ms = {k: f"{1000 * r[k]:,.0f} ms" for k in ("compute_s", "load_s", "restore_s", "load_everything_s",
                                                     "recompute_everything_s")}
        click.echo(f"| {r['tokens']:,} tok, {r['rounds']} rounds | {r['cache']} | {r['plan']} | {ms['compute_s']} | "
                   f"{ms['load_s']} | **{ms['restore_s']}** | {ms['load_everything_s']} | "
                   f"{ms['recompute_everything_s']} |")


def _device(name: str | None):
    if name is None:
        return None
    import torch

    from kvchat.errors import KvchatError

    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise KvchatError(f"unknown device {name!r} (accepted: cpu, cuda, cuda:N)")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KvchatError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def _device_option(f):
    return click.option("--device", default=None, callback=lambda ctx, param, value: _device(value),
                        help="cpu or cuda (default: cuda when available).")(f)


def _register_commands() -> None:
    """The chat commands (app/chats.py) and the benchmark and eval commands (app/bench/commands.py) live in their
    own modules; they get this module's --model option and device parsing, so every command reads them alike."""
    from kvchat.app.bench.commands import register as register_bench
    from kvchat.app.chats import register as register_chats

    register_chats(main, _model_option, _device_option)
    from kvchat.app.edit_commands import register as register_edit_commands  # kvchat edit, kvchat params

    register_edit_commands(main)
    register_bench(main, _model_option, _device, _resolve_model)
    from kvchat.app.chat_search import register as register_search  # kvchat search

    register_search(main)


_register_commands()

if __name__ == "__main__":
    main()
