"""`kvchat search QUERY`: find messages and replies across every chat (the store's full-text index,
storage/search.py). One hit a line — the chat's id and title, the round, which side matched, a snippet with the
matches in bold on a terminal — or `--json`."""

from __future__ import annotations

import json

import click

from kvchat.app.terminal_text import terminal_line


def hit_line(hit) -> str:
    """A hit as one terminal line: stored text with its control characters escaped, the matches in bold (click
    drops the bold where stdout is not a terminal)."""
    snippet = "".join(click.style(terminal_line(text), bold=True) if matched else terminal_line(text)
                      for text, matched in hit.pieces)
    title = terminal_line(hit.title) or "(untitled)"
    return f"{hit.session_id}  {title}  [{hit.round_idx}] {hit.side}: {snippet}"


def register(main: click.Group) -> None:
    # The words need no quotes, and one that looks like an option (`-x`) is a word: only --limit, --json and --help
    # are options.
    @main.command(context_settings={"ignore_unknown_options": True})
    @click.argument("words", nargs=-1, required=True)
    @click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="At most this many hits.")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print one JSON list of hits (session, title, round, side, snippet, matches: the snippet's "
                       "[start, end) spans that matched).")
    def search(words, limit, as_json):
        """Find WORDS in the messages and replies of every chat, best matches first.

        Each of the WORDS must begin a word of the round's message or reply, in any order, any case, accents
        folded ("lowf cafe" finds "Lowford's Café"); quotes, *, AND, NEAR and other search syntax are plain text.
        `kvchat show SESSION` prints the whole chat.
        """
        from kvchat.storage.db import Store

        query = " ".join(words)
        store = Store()
        try:
            hits = store.search(query, limit)
        finally:
            store.close()
        if as_json:
            click.echo(json.dumps([{"session": h.session_id, "title": h.title, "round": h.round_idx, "side": h.side,
                                    "snippet": h.snippet, "matches": [list(m) for m in h.matches]} for h in hits]))
            return
        for hit in hits:
            click.echo(hit_line(hit))
        if not hits:
            click.echo(f"kvchat: notice: no message or reply matches {terminal_line(query)!r}", err=True)
