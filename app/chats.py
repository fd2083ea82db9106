"""`kvchat new / send / sessions / show / rm / export / import`: the chat store from the command line.

A stable contract that tests and scripts rely on: ids on stdout, replies streamed to stdout, `--json` for machines,
one-line errors on stderr. What each command does with the store and the engine is app.session.service.ChatService's
(the terminal app's too): these commands parse, call it once and print.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from pathlib import Path

import click

from kvchat.app.merge_command import DEFAULT_CHECK_SECONDS
from kvchat.app.terminal_text import terminal_line, terminal_text
from kvchat.errors import InterruptedByUser, KvchatError


def _store():
    from kvchat.storage.db import Store

    return Store()  # opening sweeps what interrupted saves left behind


def _service(device: str | None = None, gpu_memory: int | None = None):
    """The chat service over $KVCHAT_HOME's store, its models loaded on `device` (default: cuda when available),
    within `gpu_memory` bytes of the GPU (default: what it has free)."""
    from kvchat.app.session.service import ChatService

    service = ChatService(device=device, gpu_memory=gpu_memory)
    service.notice = notice  # a profile being measured is said on stderr
    if sys.stderr.isatty():  # and shown as it goes (stdout, which scripts read, never carries it)
        from kvchat.app.cli_progress import TerminalProgress

        service.on_progress = TerminalProgress()
    return service


def kv_stored(store, segments: list[dict]) -> bool:
    """Whether a round's K/V (not only its key bounds) is on disk."""
    from kvchat.storage.db import SEGMENT_KV

    return any(s["kind"] == SEGMENT_KV and (store.kv_dir / s["file"]).exists() for s in segments)


def calibrating(done: int, total: int) -> None:
    """Progress of the calibration a model gets the first time a round policy, layer merging, louiskv or xkv runs on
    it (on stderr): chats measured for the watershed layer or the retrieval trigger, layer pairs checked for merging,
    or runs measuring xkv's layer costs."""
    click.echo(f"\rcalibrating this model (first use of a round policy, merging, louiskv or xkv): {done}/{total}",
               err=True, nl=done == total)


def notice(text: str) -> None:
    click.echo(f"kvchat: notice: {text}", err=True)


def restore_words(r: dict) -> str:
    """A restore as `show` prints it: what each stream did, how long it took, and what went wrong."""
    parts = [f"{r['tokens_planned']:,} tokens recomputed by plan" if r.get("tokens_planned") else None,
             f"{r['tokens_loaded']:,} loaded",
             f"{r['tokens_recomputed']:,} recomputed because their K/V could not be loaded"
             if r["tokens_recomputed"] else None]
    words = ", ".join(p for p in parts if p) + f"; {r['restore_ms']:.1f} ms"
    if r.get("tokens_planned") and r.get("load_ms"):
        words += f" (recompute {r['compute_ms']:.0f} ms beside load {r['load_ms']:.0f} ms, gap {r['gap_ms']:.0f} ms)"
    if r.get("ttft_ms") is not None:
        words += f"; first token {r['ttft_ms']:.1f} ms"
    if r.get("plan"):
        words += f"; plan: {r['plan']}"
    return words + (f"; {'; '.join(r['notes'])}" if r["notes"] else "")


def restore_fields(r) -> dict | None:
    """A restore's token counts for `--json` (None: the chat was not restored, its cache was in memory)."""
    if r is None:
        return None
    return {"tokens_loaded": r.tokens_loaded, "tokens_planned": r.tokens_planned,
            "tokens_recomputed": r.tokens_recomputed}


def reply_note(store, sid: str, state: str) -> str:
    """What `show` adds after a reply that is not whole (storage.db's reply states)."""
    from kvchat.storage.chat_lock import is_locked

    if state == "partial":
        return " [stopped: partial reply]"
    if state == "pending":
        if is_locked(store.home, sid):
            return "[being answered by another kvchat process]"
        return "[no reply saved: kvchat stopped before the reply ended]"
    return ""


def merged_pairs(segments: list[dict]) -> list[str]:
    """The layer pairs a round's K/V rows hold merged."""
    return sorted({p for s in segments if s["kind"] == "kv" for p in (s.get("merged") or "").split(",") if p})


def guard_options(f):
    """--guard/--no-guard and --reply-cap: the generation guard (engine.reply_guard), on by default."""
    f = click.option("--reply-cap", default=None, type=click.IntRange(min=1),
                     help="Stop a reply after this many tokens (default: the model's own cap; the embedded demo "
                          "model's is 40).")(f)
    return click.option("--guard/--no-guard", default=True, show_default=True,
                        help="Stop a reply that keeps repeating itself or runs past the reply cap, and say so.")(f)


def parse_gpu_memory(ctx, param, value: str | None) -> int | None:
    """--gpu-memory SIZE as bytes (engine.memory_plan.parse_size); a bad size is a one-line usage error."""
    if value is None:
        return None
    from kvchat.engine.memory_plan import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def gpu_memory_option(f):
    """--gpu-memory SIZE: what kvchat may allocate on a CUDA GPU (engine/memory_plan.py); no effect on the CPU."""
    return click.option("--gpu-memory", "gpu_memory", default=None, metavar="SIZE", callback=parse_gpu_memory,
                        help="GPU memory kvchat may use (8GiB, 12GB, 7.5G, 8192MiB; default: what the GPU has free). "
                             "A chat whose K/V does not fit whole runs on the tiered cache (Round Attention); one "
                             "that does not fit even so is refused. No effect on the CPU.")(f)


def budget_words(b: dict) -> str:
    """A chat's latest per-layer KV budgets (storage: kv_budgets) in two lines."""
    kept, retention = b["kept"], b["retention"]
    n = max(b["input_slots"], 1)
    mean_retention = sum(retention) / max(len(retention), 1)
    return (f"KV budgets ({terminal_line(str(b['policy']))} {b['budget']:g}, at round {b['round_idx']}): of "
            f"{b['input_slots']} input "
            f"tokens, layers kept {min(kept)}-{max(kept)} (mean {sum(kept) / len(kept) / n:.1%}), holding "
            f"{mean_retention:.1%} of the attention scored\n  per layer: {' '.join(map(str, kept))}")


def model_budget_words(b: dict) -> str:
    """A model's average per-layer KV budgets (storage: model_kv_budgets) in two lines."""
    shares = b["kept_share"]
    retention = sum(b["retention"]) / max(len(b["retention"]), 1)
    replies = f"{b['replies']} repl{'y' if b['replies'] == 1 else 'ies'}"
    return (f"this model's average ({terminal_line(str(b['policy']))}, {replies} of every chat): layers kept "
            f"{min(shares):.1%}-{max(shares):.1%} of the input (mean {sum(shares) / len(shares):.1%}), holding "
            f"{retention:.1%} of the attention scored\n  per layer: {' '.join(f'{x:.1%}' for x in shares)}")


def _check_kv_budget(ctx, param, value):
    if value is not None and not 0 < value <= 1:
        raise KvchatError(f"--kv-budget is a share of the chat's K/V in (0, 1], not {value:g}")
    return value


def kv_budget_option(f):
    """--kv-budget SHARE: what each reply reads of the chat's K/V under the xkv policy (engine/policies/budgets.py)."""
    return click.option("--kv-budget", "kv_budget", default=None, type=float, metavar="SHARE",
                        callback=_check_kv_budget,
                        help="xkv: the share of the chat's K/V each reply reads, chosen per layer, in (0, 1] "
                             "(default 0.2).")(f)


def make_guard(guard: bool, reply_cap: int | None):
    from kvchat.engine.reply_guard import ReplyGuard

    if not guard and reply_cap is not None:
        raise KvchatError("--reply-cap needs the guard: drop --no-guard")
    return ReplyGuard(enabled=guard, reply_cap=reply_cap)


def kv_problem_words(problem: str) -> str:
    """A K/V save that failed (KVWriter.errors: 'round N: reason'), as the one line a user reads."""
    what, _, reason = problem.partition(": ")
    if what.startswith("round "):
        return (f"the K/V of {what} was not saved ({reason}); the round's text is saved, and its K/V is recomputed "
                f"when the chat is next opened")
    return problem


@contextlib.contextmanager
def stopping_on_signals(stop: threading.Event):
    """While a reply is generated: the first Ctrl-C or SIGTERM sets `stop` (the reply ends at the next token and
    what streamed is saved, marked partial); a second Ctrl-C interrupts at once (the message stays saved)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread (in-process tests run there too)
        return

    def first(signum, frame):
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    old = {sig: signal.signal(sig, first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def report_stop(stop_reason: str) -> None:
    """On stderr, when the guard stopped the reply."""
    from kvchat.engine.reply_guard import STOP_NOTES

    if stop_reason in ("repetition", "reply_cap"):
        click.echo(f"kvchat: {STOP_NOTES[stop_reason]} ({stop_reason})", err=True)


def register(main: click.Group, model_option, device_option) -> None:
    @main.command()
    @click.option("--title", default=None, help="Title (default: the first message).")
    @model_option
    @click.option("--system", "system_prompt", default=None, help="System prompt for this chat.")
    def new(title, model_path, system_prompt):
        """Start a chat; prints its id."""
        click.echo(_service().create_chat(model_path, system_prompt=system_prompt, title=title or ""))

    @main.command()
    @click.argument("session")
    @click.argument("message")
    @click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(min=1))
    @click.option("--kv-policy", "policy_name", default="full", show_default=True,
                  help="full: every round's K/V on the device; round (Round Attention): the lower layers of every "
                       "round, the upper layers of the rounds the message picks (calibrates the model on first use); "
                       "loopserve: the full cache, a long message's prefill sparse, the reply reading a budget of "
                       "input tokens chosen again as it goes; xkv: the full cache, the reply reading in each layer "
                       "its own budget of the chat's K/V (--kv-budget), chosen for each message; louiskv: the full "
                       "cache, the reply reading 1,024 tokens of the clusters of the chat's keys its queries score "
                       "best, chosen again where they turn (calibrates the model on first use).")
    @click.option("--compact/--no-compact", default=True, show_default=True,
                  help="After saving the round, drop the stored K/V that restoring the chat on this machine would "
                       "recompute anyway (kvchat compact).")
    @click.option("--merge", "merge_share", default=None, type=click.FloatRange(min=0.0, max=1.0),
                  help="Store this chat's rounds with up to this share of the layers merged in pairs (Krul; 0: off; "
                       "the chat keeps the setting). Only pairs the model's check accepted are used; under the round "
                       "policy, only in its upper layers.")
    @click.option("--wait", "wait_s", default=600.0, show_default=True, type=click.FloatRange(min=0.0),
                  help="Seconds to wait while another kvchat process is writing to this chat (0: refuse at once).")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print one JSON object when the reply ends (the reply, its round, why it stopped, what the "
                       "restore recomputed, what could not be saved) instead of streaming the reply.")
    @guard_options
    @device_option
    @gpu_memory_option
    @kv_budget_option
    def send(session, message, max_tokens, policy_name, compact, merge_share, wait_s, as_json, guard, reply_cap,
             device, gpu_memory, kv_budget=None, edit=None):
        """Resume SESSION from disk, stream the reply to MESSAGE, save the round. MESSAGE '-' reads stdin.

        The message is saved before it is answered. Ctrl-C (or SIGTERM) stops the reply and keeps what streamed,
        marked partial; a second Ctrl-C stops at once.
        """
        if message == "-":
            try:
                message = sys.stdin.buffer.read().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise KvchatError(f"the message on stdin is not UTF-8 text (byte {exc.start})") from None
        if any(0xD800 <= ord(ch) <= 0xDFFF for ch in message):  # bytes the shell's locale could not decode
            raise KvchatError("the message is not UTF-8 text")
        if not message.strip():
            raise KvchatError("the message is empty")
        # After the message's checks: these bring in torch (seconds), which a refused message never needs.
        from kvchat.app.session.restore import RestoreCancelled
        from kvchat.engine.sampling import SamplingParams

        reply_guard = make_guard(guard, reply_cap)
        service = _service(device, gpu_memory)
        service.compact_kv = compact
        service.kv_budget = kv_budget
        if kv_budget is not None and policy_name != "xkv":
            raise KvchatError(f"--kv-budget is an option of the xkv policy, not of {policy_name}")
        info = service.chat_info(session)
        model_path = info["model_path"]
        if not Path(model_path).exists():
            raise KvchatError(f"the chat's model {model_path} is missing; its text is safe (kvchat show {info['id']})")
        if merge_share:
            from kvchat.app.merge_command import check_merges_bounded

            # The model's check, bounded as `kvchat merge` bounds it, before the message is committed: a check cut
            # short sends nothing and changes no setting.
            check_merges_bounded(service, info, DEFAULT_CHECK_SECONDS)

        streamed = []

        def stream(_tok: int, piece: str) -> None:
            if not as_json:
                sys.stdout.write(terminal_text(piece))  # a generated ESC or BEL is shown, not obeyed
                sys.stdout.flush()
                streamed.append(bool(piece))

        def waiting(holder: dict | None) -> None:
            from kvchat.storage.chat_lock import holder_words

            notice(f"waiting for another kvchat process writing to this chat ({holder_words(holder)}); up to "
                   f"{wait_s:g} s")

        # Restored, answered and saved as the app does it (an untitled chat takes the message as its title).
        stop = threading.Event()
        reply = None
        with stopping_on_signals(stop):
            try:
                reply = service.send(info["id"], message, max_tokens=max_tokens, sampling=SamplingParams(),
                                     on_token=stream, kv_policy=policy_name, calibrating=calibrating,
                                     guard=reply_guard, merge_share=merge_share, cancel=stop, on_wait=waiting,
                                     lock_wait_s=wait_s, edit=edit)  # edit: `kvchat edit` (app/edit_commands.py)
            except KeyboardInterrupt:  # a second Ctrl-C: the session kept the message and what streamed
                raise InterruptedByUser("interrupted; the message is saved, with the reply as far as it had "
                                        "streamed (marked partial)") from None
            except RestoreCancelled:  # Ctrl-C while the chat was being restored, before the reply began
                raise InterruptedByUser("interrupted before the reply began; the message is saved (with an empty "
                                        "reply, marked partial: regenerate it in the app with ctrl+r)") from None
            finally:
                if reply is None and any(streamed):
                    click.echo()  # the error goes on a line of its own, after the reply as far as it streamed
                problems = service.close()  # the round's K/V reaches the disk before the process ends
                if reply is None:  # a failed send: its error is the line to read, the K/V's fate a warning
                    for problem in problems:
                        click.echo(f"kvchat: warning: {kv_problem_words(problem)}", err=True)
        damaged = reply.restore.damaged if reply.restore is not None else []
        if as_json:
            click.echo(json.dumps({"session": info["id"], "round": reply.round.idx, "reply": reply.round.assistant_text,
                                   "reply_state": reply.round.reply_state, "stop_reason": reply.result.stop_reason,
                                   "kv_policy": reply.kv_policy,
                                   "tokens": [reply.round.token_start, reply.round.token_end],
                                   "kv_recomputed": damaged, "kv_not_saved": problems,
                                   **({"edited_round": edit.round_idx, "fork": edit.fork_sid,
                                       "restore": restore_fields(reply.restore)} if edit is not None else {})}))
        else:
            click.echo()
        report_stop(reply.result.stop_reason)
        if edit is not None:
            from kvchat.app.session.editing import edit_words

            notice(edit_words(edit, reply.restore))
        if reply.round.reply_state == "partial":
            notice(f"stopped: the reply so far is saved as round {reply.round.idx}, marked partial")
        if damaged:  # stored K/V that could not be used (damaged, missing, of another model), recomputed from text
            notice(f"restoring recomputed stored K/V that could not be used: {'; '.join(damaged)}")
        for problem in problems:
            click.echo(f"kvchat: warning: {kv_problem_words(problem)}", err=True)
        if reply.round.reply_state == "partial":
            sys.exit(130)

    @main.command()
    @click.argument("session")
    @click.option("--share", default=0.5, show_default=True, type=click.FloatRange(min=0.0, max=1.0, min_open=True),
                  help="The share of layers merged, at most (r_l); only pairs the model's check accepted are used.")
    @click.option("--check-seconds", default=DEFAULT_CHECK_SECONDS, show_default=True, type=click.FloatRange(min=0.0),
                  help="Bound on the model's merge check, run on its first merge (0: none). A check that would "
                       "take longer stops, stores nothing and says how far it got.")
    @device_option
    def merge(session, share, check_seconds, device):
        """Store SESSION's rounds again with layer pairs merged (Krul), and keep merging its new rounds."""
        service = _service(device)
        info = service.chat_info(session)
        if not Path(info["model_path"]).exists():
            raise KvchatError(f"the chat's model {info['model_path']} is missing; its text is safe")
        from kvchat.app.merge_command import check_merges_bounded

        # The model's check first, bounded, before the chat's setting changes: a check cut short changes nothing.
        check = check_merges_bounded(service, info, check_seconds)
        # Every stored round is loaded (no restore plan) so that each can be stored again merged.
        chat = service.wire(info, service.engine(info["model_path"]), merge_share=share, calibrating=calibrating,
                            planned=False)
        with chat.writing(on_wait=lambda holder: notice("waiting for another kvchat process writing to this chat")):
            chat.restore()
            merged = chat.store_merged()
        chat.close()
        if chat.writer.errors:
            raise KvchatError(f"the rounds could not all be stored merged ({chat.writer.errors[0]}); those keep "
                              f"their K/V as it was")
        pairs = ", ".join(map(str, chat.merges.pairs())) or "none"
        why = ("no layer pair of this model passed its check: its chats stay whole" if not check.accepted else
               "no layer pair of this chat passed the model's check")
        click.echo(f"{info['id']}: {merged} of {len(chat.rounds)} rounds stored with layers {pairs} merged"
                   + ("" if merged else f" ({why})"))

    @main.command()
    @click.argument("session")
    @device_option
    def unmerge(session, device):
        """Undo SESSION's cross-layer merges: its merged rounds are recomputed (exactly) and stored whole, and the
        chat stops merging."""
        from kvchat.storage.db import SEGMENT_MERGED

        service = _service(device)
        store = service.store
        info = service.chat_info(session)
        if not Path(info["model_path"]).exists():
            raise KvchatError(f"the chat's model {info['model_path']} is missing; its text is safe")
        # Merged rounds recomputed exactly (no restore plan: every other round is loaded as stored).
        chat = service.wire(info, service.engine(info["model_path"]), planned=False, ignore_merges=True)
        with chat.writing(on_wait=lambda holder: notice("waiting for another kvchat process writing to this chat")):
            stats = chat.restore()
        chat.close()
        if chat.writer.errors:
            raise KvchatError(f"the merged rounds could not be stored whole ({chat.writer.errors[0]}); nothing "
                              f"was undone")
        merged = [(s["round_idx"], s["kind"], s["layer_start"]) for s in store.segments(info["id"])
                  if s["kind"] == SEGMENT_MERGED]
        store.unlink_files(store.drop_segment_rows(info["id"], merged))
        settings = {k: v for k, v in info["settings"].items() if k != "merge"}
        store.update_session(info["id"], settings=settings)
        click.echo(f"{info['id']}: {len(stats.recomputed_rounds)} merged rounds recomputed and stored whole; "
                   f"merging off for this chat")

    @main.command()
    @click.option("--json", "as_json", is_flag=True)
    def sessions(as_json):
        """List chats, most recent first."""
        rows = _service().chat_list()
        if as_json:
            click.echo(json.dumps([{k: getattr(r, k) for k in ("id", "title", "created", "updated", "n_rounds",
                                                               "kv_bytes", "model_path")} for r in rows]))
            return
        for r in rows:
            click.echo(f"{r.id}  {r.updated[:16].replace('T', ' ')}  {r.n_rounds:>4} rounds  "
                       f"{r.kv_bytes / 2**20:8.2f} MiB  {terminal_line(r.title) or '(untitled)'}")

    @main.command()
    @click.argument("session")
    @click.option("--json", "as_json", is_flag=True)
    def show(session, as_json):
        """Transcript, each round's KV status and size, and the last restore."""
        store = _store()
        info = store.session(session)
        segs: dict[int, list[dict]] = {}
        for s in store.segments(info["id"]):
            segs.setdefault(s["round_idx"], []).append(s)
        rounds = []
        for r in store.rounds(info["id"]):
            mine = segs.get(r.idx, [])
            rounds.append({"idx": r.idx, "user": r.user_text, "assistant": r.assistant_text,
                           "reply_state": r.reply_state,
                           "tokens": [r.token_start, r.token_end], "merged": merged_pairs(mine),
                           "kv": "on disk" if kv_stored(store, mine) else "text only",
                           "kv_bytes": sum(s["byte_size"] for s in mine), "kv_raw_bytes": sum(s["raw_size"] for s in mine)})
        out = {"id": info["id"], "title": info["title"], "model": info["model_path"],
               "system_prompt": info["system_prompt"], "rounds": rounds,
               "kv_bytes": sum(r["kv_bytes"] for r in rounds), "kv_raw_bytes": sum(r["kv_raw_bytes"] for r in rounds),
               "last_restore": store.last_restore(info["id"]), "kv_budgets": store.kv_budgets(info["id"])}
        # the chat's model's average under the chat's policy (XKV's sampling mode), over every chat on it
        out["model_kv_budgets"] = out["kv_budgets"] and store.model_kv_budgets(info["model_fingerprint"],
                                                                               out["kv_budgets"]["policy"])
        if as_json:
            click.echo(json.dumps(out))
            return
        click.echo(f"{out['id']}  {terminal_line(out['title'] or '') or '(untitled)'}  [{terminal_line(out['model'])}]")
        if out["system_prompt"]:
            click.echo(f"system: {terminal_text(out['system_prompt'])}")
        for r in rounds:
            merged = f", layers {', '.join(r['merged'])} merged" if r["merged"] else ""
            click.echo(f"\n[{r['idx']}] tokens {r['tokens'][0]}-{r['tokens'][1]}  KV {r['kv']} "
                       f"({r['kv_bytes']:,} bytes{merged})")
            click.echo(f"user: {terminal_text(r['user'])}")
            click.echo(f"assistant: {terminal_text(r['assistant'])}{reply_note(store, out['id'], r['reply_state'])}")
        click.echo(f"\nKV on disk: {out['kv_bytes']:,} bytes ({out['kv_raw_bytes']:,} raw)")
        counts: dict[str, int] = {}
        for r in rounds:
            for pair in r["merged"]:
                counts[pair] = counts.get(pair, 0) + 1
        if counts:
            click.echo("merged layer pairs: " + ", ".join(f"{p} ({n} rounds)" for p, n in sorted(counts.items()))
                       + f"; kvchat unmerge {out['id']} undoes them")
        lr = out["last_restore"]
        if lr:
            click.echo(f"last restore: {restore_words(lr)}")
        if out["kv_budgets"]:
            click.echo(budget_words(out["kv_budgets"]))
        if out["model_kv_budgets"]:
            click.echo(model_budget_words(out["model_kv_budgets"]))

    @main.command()
    @click.argument("session", required=False)
    @click.option("--all", "every", is_flag=True, help="Every chat.")
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per chat, one per line.")
    @device_option
    def compact(session, every, as_json, device):
        """Drop the stored K/V that restoring SESSION (or --all chats) on this machine recomputes anyway.

        A restore recomputes a chat's first rounds while it loads the rest, as far as this machine's measured
        speeds make that faster (kvchat profile); those rounds' K/V need not be kept. Nothing else is lost: the
        text stays, and a machine that would rather load them recomputes them once and keeps them.
        """
        from kvchat.app.session.compaction import compact_session
        from kvchat.app.session.profile import profile_for_chat

        if every == bool(session):
            raise KvchatError("give either a SESSION or --all")
        store = _store()
        chats = [r["id"] for r in store.sessions()] if every else [store.session(session)["id"]]
        for sid in chats:
            profile = profile_for_chat(store, sid, device, notice)
            report = compact_session(store, sid, profile)
            if as_json:
                click.echo(json.dumps({"session": report.session_id, "dropped_segments": report.dropped,
                                       "rounds": report.rounds, "bytes_dropped": report.bytes_dropped,
                                       "bytes_left": report.bytes_left, "skipped": report.skipped,
                                       "prefix": list(report.prefix),
                                       "groups": [[g.start, g.stop] for g in report.groups]}))
            else:
                click.echo(report.line())

    @main.command()
    @click.argument("session")
    def rm(session):
        """Delete a chat and the KV files only it used."""
        service = _service()
        info = service.chat_info(session)
        service.delete(info["id"])  # committed first, files after
        click.echo(f"deleted {info['id']}")

    @main.command("export")
    @click.argument("session")
    @click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="State file to write.")
    @click.option("--text-only", is_flag=True, help="Leave the KV cache out (smaller; recomputed on import).")
    @click.option("--format", "fmt", type=click.Choice(["state", "md", "txt", "json"]), default="state",
                  show_default=True, help="state: the chat whole, to import again; md, txt: a transcript; json: the "
                                          "role/content message list chat tools read.")
    def export_(session, output, text_only, fmt):
        """Write a chat to one state file."""
        service = _service()
        if text_only and fmt != "state":
            raise KvchatError("--text-only is for state files: a transcript holds no KV cache anyway")
        click.echo(str(service.export(service.chat_info(session)["id"], Path(output), text_only=text_only, fmt=fmt)))

    @main.command("import")
    @click.argument("file", type=click.Path(dir_okay=False))
    @model_option
    def import_(file, model_path):
        """Import a state file as a new chat; prints its id."""
        result = _service().import_file(Path(file), model_path)
        for notice in result.notices:
            click.echo(f"kvchat: notice: {notice}", err=True)
        click.echo(result.session_id)
