"""`kvchat eval`: recall accuracy on held-out memory chats under a KV policy, or with --text, each policy's fidelity
on real text (app/bench/evaluate.py and app/bench/fidelity.py measure; this module parses, prints and exits).

Registered on the `kvchat` group by app/bench/commands.py. Every import of torch or the engine is inside the
command, so `kvchat --help` stays fast.
"""

from __future__ import annotations

import json

import click

from kvchat.app.chats import gpu_memory_option

# engine.policies.POLICIES, written out (tests/test_project.py checks it): importing it loads torch, which every
# command then paid for at start, `kvchat --help` and `kvchat sessions` too.
EVAL_POLICIES = ["full", "krul", "loopserve", "loopserve+round", "louiskv", "pyramid", "quest", "round",
                 "round-adaptive", "round-threshold", "round-topk", "uniform", "xkv"]
BUDGET_POLICIES = ("xkv", "uniform", "pyramid")  # engine.policies.BUDGET_POLICIES, written out: --kv-budget


def register(main: click.Group, model_option, to_device) -> None:
    """Add `eval` to `main`; `model_option` and `to_device` are the CLI's own (app/cli.py), so a model and a device
    are resolved and refused as every other command does it."""

    @main.command("eval")
    @model_option
    @click.option("--kv-policy", "policy_name", default="full", show_default=True,
                  type=click.Choice(EVAL_POLICIES),
                  help="Which KV cache the questions are answered from.")
    @click.option("--chats", default=40, show_default=True, type=click.IntRange(min=1),
                  help="Held-out chats to run (--phrasing written: all the set's chats unless given).")
    @click.option("--mode", default="app", show_default=True, type=click.Choice(["app", "compare"]),
                  help="app: recall as the app answers (every reply the model's own, kept in the chat); compare: "
                       "policy comparison (only questions answered, each rolled back to the expected reply, so every "
                       "policy sees the identical chat).")
    @click.option("--seed", default=0, show_default=True, type=int,
                  help="Which held-out chats (deterministic). 0 and the other small seeds are development sets.")
    @click.option("--report", "report", is_flag=True,
                  help="The report sets instead of --seed: --chats chats from each of the four seeds drawn once for "
                       "the figures docs/embedded-model.md reports (never to choose anything on).")
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
    @click.option("--phrasing", default="heldout", show_default=True,
                  type=click.Choice(["heldout", "train", "dev", "written"]),
                  help="heldout: sentences written from templates training never saw; train: the training templates; "
                       "dev: a third disjoint set, for choosing between training runs (the values are held-out either "
                       "way); written: the hand-written set of app/bench/written_eval.json (no template's), each fact "
                       "told once and asked --min-distance+ rounds later, scored on exact copy.")
    @click.option("--values", "values", default="heldout", show_default=True, type=click.Choice(["heldout", "random"]),
                  help="heldout: the held-out pools' values (real names, cities, ...); random: random strings "
                       "(letters, digits, mixed case, 2-16 characters, at times several words) in --phrasing's "
                       "templates, each told once and asked --min-distance+ rounds later, scored on exact copy.")
    @click.option("--min-distance", default=20, show_default=True, type=click.IntRange(min=1),
                  help="--phrasing written, --values random: the fewest rounds between a fact and its question "
                       "(--min-tokens does not apply: these chats are built, not drawn).")
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
    @click.option("--kv-budget", "kv_budget", default=None, type=float, metavar="SHARE",
                  help="xkv, uniform, pyramid: the share of the chat's K/V each reply reads, in (0, 1] (default 0.2).")
    @click.option("--option", "given_options", multiple=True, metavar="KEY=VALUE",
                  help="An option of the policy --kv-policy names (e.g. pool=1 for loopserve); repeatable.")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object (top-level `accuracy`).")
    @gpu_memory_option
    @click.pass_context
    def eval_(ctx, model_path, policy_name, mode, chats, seed, report, min_rounds, max_rounds, min_tokens, device,
              watershed, r_l, unchecked, phrasing, values, min_distance, samples, temperature, text, lengths, positions,
              kv_budget, given_options, as_json, gpu_memory) -> None:
        """Recall accuracy on held-out memory chats, per question kind, distance in rounds and phrasing family, and
        how politely out-of-scope prompts are answered; with --text, fidelity on real text."""
        from kvchat.app.bench.evaluate import (
            MODE_TITLES,
            REPORT_SEEDS,
            evaluate,
            heldout_chats,
            report_chats,
            sample_replies,
            told_once_eval_chats,
        )
        from kvchat.app.chats import calibrating
        from kvchat.app.session.policies import build_policy
        from kvchat.engine.engine import Engine
        from kvchat.errors import KvchatError

        given = _parse_options(given_options)
        if kv_budget is not None:
            if ctx.get_parameter_source("policy_name") != click.core.ParameterSource.DEFAULT and \
                    policy_name not in BUDGET_POLICIES:
                raise KvchatError(f"--kv-budget is an option of {', '.join(BUDGET_POLICIES)}, not of {policy_name}")
        if gpu_memory is not None:  # torch's allocator capped, and the weights checked against it, before loading
            from kvchat.app.session import memory

            memory.check_weights(model_path, memory.memory_budget(to_device(device), gpu_memory))
        if text:
            source = click.core.ParameterSource
            named = ctx.get_parameter_source("policy_name") != source.DEFAULT
            if given and not named:
                raise KvchatError("--option needs --kv-policy: options belong to one policy")
            n_chats = chats if ctx.get_parameter_source("chats") != source.DEFAULT else 2
            _eval_text(model_path, [policy_name] if named else EVAL_POLICIES, n_chats, seed, device,
                       lambda name: _policy_options(name, watershed, r_l, unchecked, given, kv_budget), lengths,
                       positions,
                       as_json, to_device)
            return
        if report and ctx.get_parameter_source("seed") != click.core.ParameterSource.DEFAULT:
            raise KvchatError("--report and --seed both name the chats: give one")
        if max_rounds < min_rounds:
            raise KvchatError(f"--max-rounds {max_rounds} is below --min-rounds {min_rounds}")
        told_once = phrasing == "written" or values == "random"
        if phrasing == "written" and values == "random":
            raise KvchatError("--values random is for the generator's phrasings: the written set has its own values")
        engine = Engine(model_path, device=to_device(device))
        policy = build_policy(policy_name, engine, calibrating,
                              **_policy_options(policy_name, watershed, r_l, unchecked, given, kv_budget))
        try:
            if told_once:  # the written set whole unless --chats is given; random values: --chats chats
                count = None if phrasing == "written" and \
                    ctx.get_parameter_source("chats") == click.core.ParameterSource.DEFAULT else chats
                dialogues = [dlg for s in (REPORT_SEEDS if report else (seed,)) for dlg in told_once_eval_chats(
                    phrasing, values, count, s, min_rounds, max_rounds, min_distance)]
            else:
                dialogues = report_chats(chats, min_rounds, max_rounds, engine, min_tokens, phrasing) if report else \
                    heldout_chats(chats, seed, min_rounds, max_rounds, engine, min_tokens, phrasing)
        except ValueError as exc:
            fix = "raise --min-rounds or lower --min-distance" if told_once else \
                "lower --min-tokens or raise --min-rounds"
            raise KvchatError(f"{exc}; {fix}") from None

        from kvchat.app.cli_progress import counted_progress

        def plain(done: int, total: int) -> None:
            click.echo(f"\r{done}/{total} chats", nl=False, err=True)

        with counted_progress(f"eval: {policy_name}, {len(dialogues)} chats", None if as_json else plain) as progress:
            result = evaluate(engine, policy, dialogues, progress=progress, mode=mode)
        d = result.as_dict() | ({"options": given} if given else {})
        d["seeds"] = list(REPORT_SEEDS) if report else [seed]
        d["values"] = "written" if phrasing == "written" else values
        if told_once:
            d["min_distance"] = min_distance
        if samples:  # (the generator's chats: the written set's replies are scored on exact copy alone)
            more = heldout_chats(max(chats, samples // 10), seed + 1, min_rounds, max_rounds,
                                 phrasing="heldout" if phrasing == "written" else phrasing)
            with counted_progress(f"eval: {samples} sampled replies", None if as_json else (
                    lambda done, total: click.echo(f"\r{done}/{total} sampled replies", nl=False, err=True))) as shown:
                d["samples"] = sample_replies(engine, more, samples, temperature, seed, progress=shown).as_dict()
        if as_json:
            click.echo(json.dumps(d))
            return
        click.echo("", err=True)
        sets = "report sets" if report else f"set {seed}" + ("" if seed in REPORT_SEEDS else " (a development set)")
        click.echo(f"model {model_path}  policy {policy_name}  device {result.device}  {sets}")
        click.echo(f"recall {MODE_TITLES[mode]}: {d['accuracy']:.1%} ({d['correct']}/{d['questions']}) over "
                   f"{d['chats']} chats of >= {d['min_chat_rounds']} rounds, {d['min_chat_tokens']}+ tokens "
                   f"(mean {d['mean_chat_tokens']:.0f}); {d['tokens_per_second']:.0f} tokens/s")
        if mode == "compare":
            click.echo("  (expected replies fed back after each question: for comparing KV policies on identical "
                       "chats; --mode app gives recall as a user gets it)")
        else:
            other = d["other_replies"]
            click.echo(f"  (every reply the model's own and kept; {other['as_expected']}/{other['replies']} replies to "
                       f"statements and small talk as the chat expected)")
        if d.get("context_full"):
            where = ", ".join(f"chat {c['chat']} at round {c['round']} ({c['tokens']:,} tokens)"
                              for c in d["context_full"][:3])
            click.echo(f"  {len(d['context_full'])} chat(s) outgrew the model's context ({where}): their questions "
                       f"from there on count as missed")
        copy = d["exact_copy"]
        what = {"written": "the written set", "random": "random values"}.get(d["values"], "held-out values")
        click.echo(f"exact copy ({what}{f', asked {min_distance}+ rounds after told' if told_once else ''}): "
                   f"{copy['accuracy']:.1%} ({copy['correct']}/{copy['questions']}) replies with every value byte "
                   f"for byte")
        for title in ("by_kind", "by_length"):
            cells = "  ".join(f"{k} {v['accuracy']:.1%} ({v['questions']})" for k, v in copy[title].items())
            click.echo(f"  exact copy {title.replace('_', ' ')}: {cells}")
        if "merged_layer_fraction" in d:
            click.echo(f"layers merged: {d['merged_layer_fraction']:.1%} of the model's, on average at a question")
        for title in ("by_repeat", "by_values", "by_kind", "by_position", "by_distance", "by_stated", "by_asked"):
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


def _policy_options(name: str, watershed, r_l, unchecked, given: dict | None = None,
                    kv_budget: float | None = None) -> dict:
    """The options `kvchat eval` passes to policy `name`: its flags', then those given with --option."""
    if name in BUDGET_POLICIES:
        options = {} if kv_budget is None else {"budget": kv_budget}
    elif name.startswith("round") or name == "loopserve+round":
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


def _eval_text(model_path, policy_names, chats, seed, device, options, lengths, positions, as_json,
               to_device) -> None:
    from kvchat.app.bench.fidelity import text_fidelity
    from kvchat.app.chats import calibrating
    from kvchat.app.session.policies import build_policy
    from kvchat.engine.engine import Engine
    from kvchat.errors import KvchatError

    try:
        wanted = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"--lengths takes comma-separated token counts, not {lengths!r}") from None
    if not wanted or min(wanted) < 200:
        raise KvchatError(f"--lengths needs chat lengths of at least 200 tokens, not {lengths!r}")
    engine = Engine(model_path, device=to_device(device))
    makers = {name: (lambda name=name: build_policy(name, engine, calibrating, **options(name)))
              for name in policy_names}
    from kvchat.app.cli_progress import counted_progress

    with counted_progress(f"eval --text: {len(policy_names)} policies", None if as_json else (
            lambda done, total: click.echo(f"\r{done}/{total} policy runs", nl=False, err=True))) as shown:
        result = text_fidelity(engine, makers, wanted, chats, positions, seed,
                               progress=lambda what, done, total: shown(done, total))
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
            if "kept_share" in p:
                at = f" {p['kept_share']:.0%} kept"
            click.echo(f"  {p['policy'] + at:<16} KL {p['mean_kl']:.4f}  top-1 {p['top1']:.1%}  ppl {p['ppl']:.3f} "
                       f"(full {p['ppl_full']:.3f})  over {p['positions']} positions;  by position {buckets}")
