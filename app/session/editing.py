"""Editing a past message (`kvchat edit`, the app's edit key): the chat goes on from before the edited round, which
is answered again through the ordinary send; the rounds before it keep their K/V, and the replaced branch is kept
as a fork of its own unless the user drops it.

`EditRequest` is what `ChatService.send` takes for it; `edit_words` is the one line both front ends say after."""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.app.session.restore import RestoreStats


@dataclass
class EditRequest:
    """Replace the user message of round `round_idx` (0-based, as `kvchat show` numbers rounds)."""

    round_idx: int
    keep_old: bool = True  # the replaced rounds stay, as a fork of the chat (`fork_title`)
    fork_title: str = ""
    fork_sid: str | None = None  # set by the send: the fork made, if any
    replaced: int = 0  # set by the send: how many rounds were replaced (the edited one and those after it)
    in_memory: bool = False  # set by the send: the rounds before were answered from the cache in memory


def fork_title(title: str, round_idx: int) -> str:
    return f"{title or '(untitled)'} (before editing round {round_idx})"


def edit_words(edit: EditRequest, restore: RestoreStats | None) -> str:
    """What an edit kept and what it computed: the rounds before the edited one kept their K/V (loaded, or still in
    memory), only the edited round was computed; and where the replaced branch went."""
    k = edit.round_idx
    if k == 0:
        kept = "no earlier round to keep"
    else:
        rounds = "round 0" if k == 1 else f"rounds 0–{k - 1}"
        if edit.in_memory or restore is None:
            kept = f"kept the K/V of {rounds} (in memory)"
        else:
            kept = f"kept the K/V of {rounds} ({restore.tokens_loaded:,} tokens loaded"
            if restore.tokens_planned:
                kept += f", {restore.tokens_planned:,} recomputed by this machine's restore plan, faster than loading"
            if restore.tokens_recomputed:
                kept += f", {restore.tokens_recomputed:,} recomputed because their K/V could not be loaded"
            kept += ")"
    branch = (f"the replaced {edit.replaced} round{'s' if edit.replaced != 1 else ''} kept as chat {edit.fork_sid}"
              if edit.fork_sid else f"the replaced {edit.replaced} round{'s' if edit.replaced != 1 else ''} dropped")
    return f"edited round {k}: {kept}; only the edited round was computed; {branch}"
