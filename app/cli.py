"""The `kvchat` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvchat.app.chats import guard_options, make_guard, report_stop
from kvchat.app.errors import FriendlyGroup


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.version_option(package_name="kvchat")
@click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
              help="The app only: GGUF model file, or a known model's short name (gemma-3-270m), for new chats "
                   "(default: the settings' choice, else the embedded model).")
@click.option("--device", default=None, help="The app only: cpu or cuda (default: cuda when available).")
# The choices are engine.policies.CHAT_POLICIES, written out: importing it would load torch for every command.
@click.option("--kv-policy", "kv_policy", default=None, type=click.Choice(["full", "round", "loopserve"]),
              help="The app only: the KV policy chats run under, full, round (Round Attention on a tiered KV "
                   "cache; calibrates the model on first use) or loopserve (sparse prefill of long messages, "
                   "progressive selection of what the reply reads). Default: the settings' choice, else full.")
@click.pass_context
def main(ctx: click.Context, model_path, device, kv_policy) -> None:
    """kvchat: a local assistant whose chats resume from their saved KV cache instead of being re-read.

    With no command, kvchat opens the terminal app (press F1 there for its keys).
    """
    if ctx.invoked_subcommand is not None:
        if model_path is not None or device is not None or kv_policy is not None:
            from kvchat.errors import KvchatError

            raise KvchatError(f"--model, --device and --kv-policy before a command apply to the app only; give "
                              f"them after `{ctx.invoked_subcommand}`")
        return
    from kvchat.app.tui.app import run_app

    if model_path is not None:
        model_path = _resolve_model(ctx, None, model_path)
    run_app(model_path, _device(device) and device, kv_policy)


def _model_option(f):
    return click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
                        callback=_resolve_model,
                        help="GGUF model file (llama, qwen2, qwen3 or gemma3 architecture) or a known model's "
                             "short name (gemma-3-270m, from the `gemma` extra); default: the embedded demo "
                             "model.")(f)


def _resolve_model(ctx, param, value):
    from kvchat.errors import KvchatError

    if value is not None:
        from kvchat.storage.known_models import is_known_model, resolve_model

        if is_known_model(value):
            return str(resolve_model(value))
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
@click.argument("prompt")
def generate(model_path, max_tokens, temperature, top_k, top_p, seed, device, as_json, guard, reply_cap,
             prompt) -> None:
    """Complete a raw PROMPT (no chat template), streaming the text. PROMPT '-' reads standard input."""
    from kvchat.engine.engine import Engine
    from kvchat.engine.sampling import SamplingParams

    if prompt == "-":
        prompt = sys.stdin.read()
    sampling = SamplingParams(temperature, top_k, top_p, seed).validate()
    reply_guard = make_guard(guard, reply_cap)
    engine = Engine(model_path, device=_device(device))
    tokens = engine.encode_prompt(prompt)

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
        click.echo()
        report_stop(result.stop_reason)


@main.command()
@_model_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(model_path, as_json) -> None:
    """Print a model's architecture and KV size without loading its weights."""
    from kvchat.engine.engine import ModelInfo

    mi = ModelInfo.read(model_path)
    cfg = mi.config
    facts = {
        "name": mi.name, "architecture": cfg.arch, "layers": cfg.n_layers, "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads, "head_size": cfg.head_dim, "embedding": cfg.d_model, "ffn": cfg.ffn_dim,
        "vocab": cfg.vocab_size, "context_length": cfg.context_length,
        "kv_bytes_per_token_f16": cfg.kv_bytes_per_token(2), "kv_bytes_per_token_f32": cfg.kv_bytes_per_token(4),
        "rope": ("neox" if cfg.rope_neox else "norm") + (", llama3 factors" if cfg.llama3_rope else ""),
        "tied_output": cfg.tied_output, "tensor_types": mi.tensor_types,
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
        click.echo(f"{key.replace('_', ' '):<{width}}  {value}")


def _policy_options(name: str, watershed, r_l, unchecked, given: dict | None = None) -> dict:
    """The options `kvchat eval` passes to policy `name`: its flags', then those given with --option."""
    if name.startswith("round") or name == "loopserve+round":
        options = {} if watershed is None else {"watershed": watershed}
    elif name == "krul":
        options = {"r_l": r_l, "checked": not unchecked}
    else:
        options = {}
    return options | (given or {})


def _parse_options(items: tuple[str, ...]) -> dict:
    """--option KEY=VALUE pairs -> {key: int, float, bool or str}."""
    from kvchat.errors import KvchatError

    options: dict = {}
    for item in items:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key or not text:
            raise KvchatError(f"--option takes KEY=VALUE (e.g. pool=1), not {item!r}")
        options[key] = text.lower() == "true" if text.lower() in ("true", "false") else _number_or_text(text)
    return options


def _number_or_text(text: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _eval_text(model_path, policy_names, chats, seed, device, options, lengths, positions, as_json) -> None:
    from kvchat.app.chats import calibrating
    from kvchat.engine.engine import Engine
    from kvchat.app.bench.fidelity import text_fidelity
    from kvchat.engine.policies import make_policy
    from kvchat.errors import KvchatError

    try:
        wanted = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"--lengths takes comma-separated token counts, not {lengths!r}") from None
    if not wanted or min(wanted) < 200:
        raise KvchatError(f"--lengths needs chat lengths of at least 200 tokens, not {lengths!r}")
    engine = Engine(model_path, device=_device(device))
    makers = {name: (lambda name=name: make_policy(name, engine, calibrating, **options(name)))
              for name in policy_names}
    result = text_fidelity(engine, makers, wanted, chats, positions, seed,
                           progress=None if as_json else lambda what: click.echo(f"\r{what:<70}", nl=False,
                                                                                  err=True))
    d = result.as_dict()
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo("", err=True)
    click.echo(f"model {model_path}  device {result.device}  {chats} chats per length, up to {positions} reply "
               f"positions each  ({result.seconds:.0f} s)")
    for length, why in result.skipped.items():
        click.echo(f"{length} tokens: skipped, {why}")
    for length, entry in d["lengths"].items():
        click.echo(f"{length} tokens (chats of {', '.join(map(str, entry['chat_tokens']))}):")
        for p in entry["policies"]:
            if "error" in p:
                click.echo(f"  {p['policy']:<16} not measured: {p['error']}")
                continue
            buckets = "  ".join(f"{k}: {v['mean_kl']:.4f}/{v['top1']:.1%}" for k, v in p["by_position"].items())
            at = f"@{p['watershed']}" if "watershed" in p else ""
            if "merged_pairs" in p:
                at = " " + "/".join(",".join(pairs) or "none" for pairs in p["merged_pairs"])
            click.echo(f"  {p['policy'] + at:<16} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  ppl {p['ppl']:.3f} "
                       f"(full {p['ppl_full']:.3f})  over {p['positions']} positions;  by position {buckets}")


# engine.policies.POLICIES, written out (tests/test_project.py checks it): importing it loads torch, which every
# command then paid for at start, `kvchat --help` and `kvchat sessions` too.
EVAL_POLICIES = ["full", "krul", "loopserve", "loopserve+round", "round", "round-adaptive", "round-threshold",
                 "round-topk"]


@main.command("eval")
@_model_option
@click.option("--kv-policy", "policy_name", default="full", show_default=True,
              type=click.Choice(EVAL_POLICIES),
              help="Which KV cache the questions are answered from.")
@click.option("--chats", default=40, show_default=True, type=click.IntRange(min=1), help="Held-out chats to run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Which held-out chats (deterministic).")
@click.option("--min-rounds", default=44, show_default=True, type=click.IntRange(min=2))
@click.option("--max-rounds", default=52, show_default=True, type=click.IntRange(min=2))
@click.option("--min-tokens", default=2000, show_default=True, type=click.IntRange(min=0),
              help="Only chats at least this long in the model's tokens.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--watershed", default=None, type=click.IntRange(min=0),
              help="Round policies: the watershed layer (default: the model's calibration, made on first use).")
@click.option("--r-l", "r_l", default=0.5, show_default=True, type=click.FloatRange(min=0.0, max=1.0),
              help="krul: the share of layers merged (at most; the check may accept fewer).")
@click.option("--unchecked", is_flag=True,
              help="krul: merge the pairs the chat's attention statistics pick, without the model's check.")
@click.option("--phrasing", default="heldout", show_default=True, type=click.Choice(["heldout", "train", "dev"]),
              help="heldout: sentences written from templates training never saw; train: the training templates; "
                   "dev: a third disjoint set, for choosing between training runs (the values are held-out either "
                   "way).")
@click.option("--samples", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also sample this many replies at --temperature with the guard off, and count those that loop "
                   "or run past the model's reply cap.")
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0.0, max=100.0),
              help="Temperature of --samples.")
@click.option("--text", "text", is_flag=True,
              help="Fidelity on real text instead (any model): every KV policy (or the one --kv-policy names) "
                   "against the full cache, teacher-forced over the last reply of MT-Bench chats: mean KL, top-1 "
                   "agreement and perplexity per reply position.")
@click.option("--lengths", default="2000,8000,24000", show_default=True,
              help="--text: chat lengths in tokens (comma-separated).")
@click.option("--positions", default=256, show_default=True, type=click.IntRange(min=2),
              help="--text: reply tokens teacher-forced per chat (at most).")
@click.option("--option", "given_options", multiple=True, metavar="KEY=VALUE",
              help="An option of the policy --kv-policy names (e.g. pool=1 for loopserve); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (top-level `accuracy`).")
@click.pass_context
def eval_(ctx, model_path, policy_name, chats, seed, min_rounds, max_rounds, min_tokens, device, watershed,
          r_l, unchecked, phrasing, samples, temperature, text, lengths, positions, given_options, as_json) -> None:
    """Recall accuracy on held-out memory chats, per question kind, distance in rounds and phrasing family, and
    how politely out-of-scope prompts are answered; with --text, fidelity on real text."""
    from kvchat.app.chats import calibrating
    from kvchat.engine.engine import Engine
    from kvchat.app.bench.evaluate import evaluate, heldout_chats, sample_replies
    from kvchat.engine.policies import make_policy
    from kvchat.errors import KvchatError

    given = _parse_options(given_options)
    if text:
        source = click.core.ParameterSource
        named = ctx.get_parameter_source("policy_name") != source.DEFAULT
        if given and not named:
            raise KvchatError("--option needs --kv-policy: options belong to one policy")
        n_chats = chats if ctx.get_parameter_source("chats") != source.DEFAULT else 2
        _eval_text(model_path, [policy_name] if named else EVAL_POLICIES, n_chats, seed, device,
                   lambda name: _policy_options(name, watershed, r_l, unchecked, given), lengths, positions,
                   as_json)
        return
    if max_rounds < min_rounds:
        raise KvchatError(f"--max-rounds {max_rounds} is below --min-rounds {min_rounds}")
    engine = Engine(model_path, device=_device(device))
    policy = make_policy(policy_name, engine, calibrating,
                         **_policy_options(policy_name, watershed, r_l, unchecked, given))
    try:
        dialogues = heldout_chats(chats, seed, min_rounds, max_rounds, engine, min_tokens, phrasing)
    except ValueError as exc:
        raise KvchatError(f"{exc}; lower --min-tokens or raise --min-rounds") from None

    def progress(done: int, total: int) -> None:
        if not as_json:
            click.echo(f"\r{done}/{total} chats", nl=False, err=True)

    result = evaluate(engine, policy, dialogues, progress=progress)
    d = result.as_dict() | ({"options": given} if given else {})
    if samples:
        more = heldout_chats(max(chats, samples // 10), seed + 1, min_rounds, max_rounds, phrasing=phrasing)
        d["samples"] = sample_replies(engine, more, samples, temperature, seed, progress=None if as_json else (
            lambda done, total: click.echo(f"\r{done}/{total} sampled replies", nl=False, err=True))).as_dict()
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo("", err=True)
    click.echo(f"model {model_path}  policy {policy_name}  device {result.device}")
    click.echo(f"accuracy {d['accuracy']:.1%} ({d['correct']}/{d['questions']}) over {d['chats']} chats of "
               f">= {d['min_chat_rounds']} rounds, {d['min_chat_tokens']}+ tokens "
               f"(mean {d['mean_chat_tokens']:.0f}); {d['tokens_per_second']:.0f} tokens/s")
    if "merged_layer_fraction" in d:
        click.echo(f"layers merged: {d['merged_layer_fraction']:.1%} of the model's, on average at a question")
    for title in ("by_kind", "by_position", "by_distance", "by_stated", "by_asked"):
        cells = "  ".join(f"{k} {v['accuracy']:.1%} ({v['questions']})" for k, v in d[title].items())
        click.echo(f"{title.replace('_', ' ')}: {cells}")
    oos = d["out_of_scope"]
    cells = "  ".join(f"{k} {v['accuracy']:.1%} ({v['questions']})" for k, v in oos["by_kind"].items())
    click.echo(f"out of scope ({phrasing} phrasing): polite {oos['polite_rate']:.1%} ({oos['polite']}/"
               f"{oos['prompts']}); {cells}; longest other reply {oos['longest_other_reply_tokens']} tokens")
    if "samples" in d:
        s = d["samples"]
        click.echo(f"sampled at temperature {s['temperature']}: {s['replies']} replies, {s['looped']} looped, "
                   f"{s['over_cap']} past the reply cap of {s['reply_cap']} tokens (guard off); longest "
                   f"{s['longest']} tokens")


@main.command()
@_model_option
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--chats", default=8, show_default=True, type=click.IntRange(min=1),
              help="Calibration chats (memory dialogues on the embedded model, MT-Bench chats otherwise).")
@click.option("--png", "png_path", default=None, type=click.Path(dir_okay=False),
              help="Where the curve's plot goes (default: next to the stored calibration).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (top-level `watershed`).")
def calibrate(model_path, device, chats, png_path, as_json) -> None:
    """Find the model's watershed layer for Round Attention and store it (used automatically from then on)."""
    from kvchat.engine.calibrate.watershed import calibrate as measure, curve_lines, plot_curve, save_calibration
    from kvchat.engine.engine import Engine
    from kvchat.storage.db import Store
    from kvchat.storage.fingerprint import model_fingerprint

    engine = Engine(model_path, device=_device(device))
    cal = measure(engine, model_fingerprint(Path(model_path), Store()), chats=chats,
                  progress=lambda done, total: click.echo(f"\rcalibrating: {done}/{total} chats", nl=False, err=True))
    click.echo("", err=True)
    stored = save_calibration(cal)
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

        click.echo(json.dumps({**asdict(cal), "path": str(stored), "png": str(png) if png else None}))
        return
    click.echo(f"model {model_path}  {cal.n_layers} layers  {cal.chats} {cal.source} chats  device {engine.device}")
    for line in curve_lines(cal):
        click.echo(line)
    click.echo(f"watershed layer: {cal.watershed}")
    click.echo(f"stored {stored}" + (f"; plot {png}" if png else ""))


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
        from kvchat.engine.engine import Engine
        from kvchat.storage.db import Store
        from kvchat.storage.fingerprint import model_fingerprint

        engine = Engine(model_path, device=_device(device))
        prof = ensure_profile(engine, model_fingerprint(Path(model_path), Store()), redo=redo,
                              notice=lambda text: click.echo(f"kvchat: notice: {text}", err=True))
    rows = plan_table(prof, tokens)
    if as_json:
        click.echo(json.dumps({"profile": prof.to_dict(), "plans": rows}))
        return
    h2d = "n/a (CPU)" if prof.h2d_gb_s is None else f"{prof.h2d_gb_s:,.1f} GB/s"
    click.echo(f"{prof.device}, {prof.dtype}, {prof.n_layers} layers, measured {prof.date}")
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


@main.group(invoke_without_command=True)
@click.option("--models", default="embedded,qwen2.5-0.5b,llama-3.2-1b,llama-3.1-8b", show_default=True,
              help="Comma-separated: embedded, random-weight models shaped like public ones, and/or gemma-3-270m "
                   "(real weights: the gemma extra).")
@click.option("--workloads", default="2k,8k,32k", show_default=True,
              help="Comma-separated chat lengths (memory dialogues on the embedded model, MT-Bench chats otherwise).")
@click.option("--methods", default=None,
              help="Comma-separated: prefill, kv-load, llama.cpp, policy:NAME (default: all but the round policies).")
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
@click.pass_context
def bench(ctx, models, workloads, methods, repeats, device, cache_dir, work_dir, llama_cpp_budget, disk_probe_mib,
          json_path, markdown_path) -> None:
    """Benchmarks that print numbers (record them in docs/benchmarks.md with device and date).

    Without a subcommand: the resume benchmark. Time to the first token of a new message in an old chat, by
    re-prefilling it, loading its KV from our store, llama.cpp's state file and every KV policy, each in a fresh
    process; bytes on disk per token, decode speed, peak GPU memory, agreement with prefill, recall accuracy on
    the embedded model, and the machine's floor (disk, host-to-device, matmul) measured in the same run.
    """
    if ctx.invoked_subcommand is not None:
        return
    from pathlib import Path

    from kvchat.app.bench.resume import (
        Plan, default_methods, markdown, method_names, model_names, parse_names, run_benchmark,
    )
    from kvchat.engine.data.workloads import parse_workloads

    plan = Plan(models=parse_names(models, model_names(), "model"), workloads=parse_workloads(workloads),
                methods=parse_names(methods, method_names(), "method") if methods else default_methods(),
                repeats=repeats, device=str(_device(device)) if device else None,
                cache_dir=Path(cache_dir) if cache_dir else None, work_dir=Path(work_dir) if work_dir else None,
                llama_cpp_budget_s=llama_cpp_budget, disk_probe_bytes=disk_probe_mib << 20)
    steps = 1 + sum(1 + (1 if "llama.cpp" in plan.methods else 0) + len(plan.workloads) * len(plan.methods)
                    for _ in plan.models)
    with click.progressbar(length=steps, label="kvchat bench", file=sys.stderr, show_pos=True,
                           item_show_func=lambda label: label) as bar:
        def progress(label: str) -> None:
            bar.update(1, label)

        def save(results: dict) -> None:  # after every workload too: a run stopped at a time limit keeps its rows
            if json_path:
                Path(json_path).write_text(json.dumps(results, indent=2))
            if markdown_path:
                Path(markdown_path).write_text(markdown(results) + "\n")

        results = run_benchmark(plan, progress=progress, log=lambda line: click.echo(line, err=True), checkpoint=save)
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


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
    if not items or any(v < 1 for v in items):
        raise click.BadParameter(f"expected positive whole numbers, got {value!r}")
    return items


@bench.command("engine")
@click.option("--shape", "shapes", multiple=True, default=["llama-3.2-1b", "llama-3.1-8b"], show_default=True,
              help="Random-weight model shaped like a public one (repeatable).")
@click.option("--context", "contexts", default="1024,8192", show_default=True, callback=_int_list,
              help="Context lengths for prefill and decode.")
@click.option("--qtype", default="BF16", show_default=True, type=click.Choice(["BF16", "Q4_K_M"]))
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where the random models are kept (default: $KVCHAT_HOME/bench-models).")
@click.option("--cold", is_flag=True, help="Drop the OS page cache before each load (Linux, root).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write JSON here.")
@click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
              callback=lambda ctx, param, value: None if value is None else _resolve_model(ctx, param, value),
              help="A GGUF file or known short name to measure instead of the random shapes (a model with "
                   "sliding-window layers is measured with them in rings as well).")
def bench_engine(shapes, contexts, qtype, device, cache_dir, cold, json_path, model_path) -> None:
    """Load time, prefill and decode tokens/s and KV cache memory of the bare engine, on random models of real
    shapes or on --model."""
    from pathlib import Path

    from kvchat.app.bench.engine_speed import as_dict, bench_file, bench_shape
    from kvchat.engine.train.synthetic import SHAPES
    from kvchat.errors import KvchatError
    from kvchat.paths import data_dir

    if model_path is not None:
        path = Path(model_path)
        results = [as_dict(bench_file(path, path.name, "file", contexts, _device(device), log=click.echo,
                                      cold=cold))]
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=2))
        return
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise KvchatError(f"unknown shape {unknown[0]!r} (accepted: {', '.join(SHAPES)})")
    folder = Path(cache_dir) if cache_dir else data_dir() / "bench-models"
    results = [as_dict(bench_shape(folder, s, contexts, qtype, _device(device), log=click.echo, cold=cold))
               for s in shapes]
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))


@bench.command("loopserve")
@_model_option
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

    try:
        shares = [float(x) for x in densities.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"--densities takes comma-separated shares, not {densities!r}") from None
    if not shares or not all(0 < x <= 1 for x in shares):
        raise KvchatError(f"--densities takes shares in (0, 1], not {densities!r}")
    if shape is not None and shape not in SHAPES:
        raise KvchatError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
    path = model_file(Path(cache_dir) if cache_dir else data_dir() / "bench-models", shape) if shape else model_path
    engine = Engine(path, device=_device(device))
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
            p = compare(path, REFERENCE_PROMPT, device=_device(device), dtype=getattr(torch, dtype) if dtype else None,
                        numerics=numerics)
            own = self_consistency(path, Engine(path, device="cpu").encode_prompt(REFERENCE_PROMPT), p.greedy_steps)
            rows.append({"model": name, **asdict(p), "llama_cpp_decode_vs_batch": own})
            click.echo(f"{name:<24} {p.device:<6} {p.dtype:<9} {p.numerics:<9} rel. error {p.relative_error:.2e}  "
                       f"greedy {p.greedy_agreeing}/{p.greedy_steps}  llama.cpp decode vs its batch {own:.1e}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


@bench.command("storage")
@_model_option
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

    from kvchat.app.bench.storage import as_dict, bench_storage as run
    from kvchat.app.bench.engine_speed import model_file
    from kvchat.engine.train.synthetic import SHAPES
    from kvchat.errors import KvchatError
    from kvchat.paths import data_dir

    if shape is not None:
        if shape not in SHAPES:
            raise KvchatError(f"unknown shape {shape!r} (accepted: {', '.join(SHAPES)})")
        model_path = str(model_file(Path(cache_dir) if cache_dir else data_dir() / "bench-models", shape))
    figures = run(model_path, _device(device), tokens, log=click.echo)
    if json_path:
        Path(json_path).write_text(json.dumps(as_dict(figures), indent=2))


@bench.command("first-token")
@_model_option
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1))
def bench_first_token(model_path, device, repeats) -> None:
    """Time to the first reply token of a short chat, from a cold start of the engine and with it loaded."""
    import statistics
    import time

    from kvchat.engine.text.chat_format import Conversation, Round
    from kvchat.engine.engine import Engine
    from kvchat.engine.generate import generate

    started = time.perf_counter()
    engine = Engine(model_path, device=_device(device))
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


def _register_chats() -> None:
    from kvchat.app.chats import register

    register(main, _model_option, _device_option)


_register_chats()

if __name__ == "__main__":
    main()
