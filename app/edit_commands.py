"""`kvchat edit` (replace a past message and answer it again) and `kvchat params` (a chat's own generation
parameters). Like app/chats.py these parse, call app.session.service.ChatService and print; `edit` answers through
`kvchat send` itself, so it streams, stops, saves and reports exactly as a send does."""

from __future__ import annotations

import json
import sys

import click

from kvchat.errors import KvchatError

# The chat's parameters as `kvchat params` names them (option, storage.db.CHAT_PARAMETERS column, type).
PARAMETER_OPTIONS = (("--temperature", "temperature", click.FloatRange(min=0.0, max=100.0)),
                     ("--top-p", "top_p", click.FloatRange(min=0.0, max=1.0, min_open=True)),
                     ("--top-k", "top_k", click.IntRange(min=0)),
                     ("--seed", "seed", click.IntRange(min=0)),
                     ("--reply-cap", "reply_cap", click.IntRange(min=1)))


def parameter_words(params: dict, system_prompt: str | None) -> list[str]:
    from kvchat.app.terminal_text import terminal_text

    lines = [f"{name.replace('_', '-')}: {'default' if value is None else value}" for name, value in params.items()]
    return lines + [f"system prompt: {terminal_text(system_prompt) if system_prompt else '(none)'}"]


def register(main: click.Group) -> None:
    @main.command()
    @click.argument("session")
    @click.argument("round_idx", metavar="ROUND", type=int)
    @click.argument("message")
    @click.option("--drop-old", is_flag=True,
                  help="Drop the replaced rounds (default: keep them as a fork of the chat, named in the output).")
    @click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(min=1))
    @click.option("--wait", "wait_s", default=600.0, show_default=True, type=click.FloatRange(min=0.0),
                  help="Seconds to wait while another kvchat process is writing to this chat (0: refuse at once).")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print one JSON object when the reply ends (as `kvchat send --json`, with the edited round, "
                       "the fork holding the replaced rounds and what the restore loaded and recomputed).")
    @click.pass_context
    def edit(ctx, session, round_idx, message, drop_old, max_tokens, wait_s, as_json):
        """Replace the message of round ROUND of SESSION (numbered as `kvchat show` does) with MESSAGE and answer
        it again; MESSAGE '-' reads stdin.

        The rounds before ROUND keep their stored KV (only the edited round is computed); ROUND and the rounds
        after it are kept as a fork of the chat, or dropped with --drop-old.
        """
        from kvchat.app.session.editing import EditRequest
        from kvchat.app.session.service import missing_round_words
        from kvchat.storage.db import Store

        store = Store()
        info = store.session(session)
        n_rounds = len(store.rounds(info["id"]))
        store.close()
        if not 0 <= round_idx < n_rounds:  # before any model is loaded (the send checks again under the lock)
            raise KvchatError(missing_round_words(round_idx, n_rounds))
        request = EditRequest(round_idx, keep_old=not drop_old)
        ctx.invoke(main.commands["send"], session=info["id"], message=message, max_tokens=max_tokens,
                   wait_s=wait_s, as_json=as_json, edit=request)

    def parameter_option(flag: str, name: str, kind):
        return click.option(flag, name, type=kind, default=None,
                            help=f"The chat's {flag[2:]} from now on.")

    def parameters_command(f):
        for flag, name, kind in reversed(PARAMETER_OPTIONS):
            f = parameter_option(flag, name, kind)(f)
        return f

    @main.command()
    @click.argument("session")
    @parameters_command
    @click.option("--system", "system_prompt", default=None,
                  help="The chat's system prompt ('' for none; changing it recomputes the chat's KV).")
    @click.option("--reset", "reset", multiple=True, metavar="NAME",
                  type=click.Choice(["all"] + [flag[2:] for flag, _, _ in PARAMETER_OPTIONS]),
                  help="Put this parameter (or all) back to the default: the app's settings, `kvchat send`'s own. "
                       "May be repeated.")
    @click.option("--json", "as_json", is_flag=True)
    def params(session, system_prompt, reset, as_json, **given):
        """Show or set SESSION's own generation parameters (temperature, top-p, top-k, seed, reply cap, system
        prompt). A parameter the chat has overrides the default in `kvchat send` and the app; `--reply-cap` given
        to a send still wins."""
        from kvchat.app.chats import _service

        service = _service()
        sid = service.chat_info(session)["id"]
        changes = {name: None for flag, name, _ in PARAMETER_OPTIONS if "all" in reset or flag[2:] in reset}
        changes.update({name: value for name, value in given.items() if value is not None})
        if changes:
            service.set_parameters(sid, changes)
        if system_prompt is not None:
            service.set_system_prompt(sid, system_prompt)
        info = service.chat_info(sid)
        current = service.parameters(sid)
        if as_json:
            click.echo(json.dumps({"session": sid, "parameters": current, "system_prompt": info["system_prompt"]}))
            return
        sys.stdout.write("".join(f"{line}\n" for line in parameter_words(current, info["system_prompt"])))
