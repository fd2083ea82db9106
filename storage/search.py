"""Full-text search over every chat's messages and replies: an SQLite FTS5 index of the rounds table (`rounds_fts`,
migration 007_message_search), kept current by triggers, searched with a query built from the user's words so that
no FTS syntax they type (quotes, `*`, `AND`, `NEAR(`, `-`, `col:`) is ever read as syntax.

The index is sqlite-utils' `enable_fts(["user_text", "assistant_text"], create_triggers=True, tokenize=TOKENIZE)`,
statement for statement (`index_statements`; tests/test_search.py checks the two agree), so sqlite-utils' own FTS
helpers (`detect_fts`, `search`, `rebuild_fts`) work on it. It is written out rather than called because
`enable_fts` runs its SQL through `executescript`, which on Python 3.12 and later commits the transaction it is in:
a migration must be all or nothing.

It is an external-content index keyed by the rounds' rowids: anything that rewrites the rounds table (sqlite-utils'
`transform`, VACUUM, which may renumber the rowids of a table without an INTEGER PRIMARY KEY) must rebuild it after
(`INSERT INTO rounds_fts(rounds_fts) VALUES('rebuild')`).
"""

from __future__ import annotations

import re
import secrets
import sqlite3
import unicodedata
from dataclasses import dataclass

from kvchat.errors import KvchatError

FTS_TABLE = "rounds_fts"
SEARCHED_COLUMNS = ("user_text", "assistant_text")
SIDES = ("message", "reply")  # what each searched column is to a user
# unicode61 rather than porter: a search box is typed into a prefix at a time, and every word of the query matches
# the words that begin with it. Porter's stems break that ("genero" is no prefix of "gener", the stem of
# "generously"), and stemming is English only, where chats hold names, places and any language. Diacritics are
# folded ("cafe" finds "café"), case too.
TOKENIZE = "unicode61 remove_diacritics 2"


class SearchError(KvchatError):
    """A search that has nothing to look for (no word of letters or digits)."""


@dataclass(frozen=True)
class SearchHit:
    session_id: str
    title: str
    round_idx: int
    side: str  # "message" (the user's) or "reply"
    pieces: tuple[tuple[str, bool], ...]  # the snippet, in pieces: (text, whether it is a match)
    updated: str  # the chat's last activity

    @property
    def snippet(self) -> str:
        return "".join(text for text, _ in self.pieces)

    @property
    def matches(self) -> list[tuple[int, int]]:
        """Where the snippet's matches are: [start, end) character offsets."""
        spans, at = [], 0
        for text, matched in self.pieces:
            if matched:
                spans.append((at, at + len(text)))
            at += len(text)
        return spans


def index_statements() -> list[str]:
    """The FTS5 table over the rounds' message and reply, its triggers and its backfill of the rounds already
    stored: what `Table.enable_fts(SEARCHED_COLUMNS, create_triggers=True, tokenize=TOKENIZE)` executes."""
    fts, cols = f'"{FTS_TABLE}"', ", ".join(f'"{c}"' for c in SEARCHED_COLUMNS)
    new = ", ".join(f'new."{c}"' for c in SEARCHED_COLUMNS)
    old = ", ".join(f'old."{c}"' for c in SEARCHED_COLUMNS)
    return [
        f"CREATE VIRTUAL TABLE {fts} USING FTS5 (\n    {cols},\n    tokenize='{TOKENIZE}',\n    content=\"rounds\"\n)",
        f'INSERT INTO {fts} (rowid, {cols})\n    SELECT rowid, {cols} FROM "rounds";',
        f'CREATE TRIGGER "rounds_ai" AFTER INSERT ON "rounds" BEGIN\n'
        f"  INSERT INTO {fts} (rowid, {cols}) VALUES (new.rowid, {new});\nEND",
        f'CREATE TRIGGER "rounds_ad" AFTER DELETE ON "rounds" BEGIN\n'
        f"  INSERT INTO {fts} ({fts}, rowid, {cols}) VALUES('delete', old.rowid, {old});\nEND",
        f'CREATE TRIGGER "rounds_au" AFTER UPDATE ON "rounds" BEGIN\n'
        f"  INSERT INTO {fts} ({fts}, rowid, {cols}) VALUES('delete', old.rowid, {old});\n"
        f"  INSERT INTO {fts} (rowid, {cols}) VALUES (new.rowid, {new});\nEND",
    ]


def create_index(conn: sqlite3.Connection) -> None:
    """The migration: one statement at a time, inside the caller's transaction. A store that holds the index but
    lost the record of its migration gets it made again, from the rounds as they are."""
    for trigger in ("rounds_ai", "rounds_ad", "rounds_au"):
        conn.execute(f'DROP TRIGGER IF EXISTS "{trigger}"')
    conn.execute(f'DROP TABLE IF EXISTS "{FTS_TABLE}"')
    for statement in index_statements():
        conn.execute(statement)


def temporary_index(conn: sqlite3.Connection) -> None:
    """For a store read as it is (a read-only home whose store predates the index): the same index as a temporary
    table of this connection, copied from the rounds now (a read-only connection may still write its temp schema)."""
    cols = ", ".join(f"[{c}]" for c in SEARCHED_COLUMNS)
    conn.execute(f"DROP TABLE IF EXISTS temp.[{FTS_TABLE}]")
    conn.execute(f"CREATE VIRTUAL TABLE temp.[{FTS_TABLE}] USING FTS5 ({cols}, tokenize='{TOKENIZE}')")
    conn.execute(f"INSERT INTO temp.[{FTS_TABLE}] (rowid, {cols}) SELECT rowid, {cols} FROM main.[rounds]")


def query_words(text: str) -> list[str]:
    """The words searched for: the text split at whitespace, keeping those with a letter or digit (a lone `"`, `*`
    or `-` finds nothing anyway)."""
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):  # bytes the shell's locale could not decode
        raise SearchError("the search is not UTF-8 text")
    # Control characters separate words, as the tokenizer reads them; a NUL would end FTS5's reading of the query.
    spaced = "".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text)
    words = [w for w in spaced.split() if any(ch.isalnum() for ch in w)]
    if not words:
        raise SearchError("nothing to search for: give a word of letters or digits" if not text.strip() else
                          f"nothing to search for in {text.strip()!r}: give a word of letters or digits")
    return words


def match_expression(text: str) -> str:
    """An FTS5 query for `text` in which nothing is syntax: each word becomes a quoted phrase (its quotes doubled)
    matched as a prefix, and a round matches when it has every word, in its message or its reply, in any order."""
    return " ".join('"' + w.replace('"', '""') + '"*' for w in query_words(text))


_SPACE = re.compile(r"\s+")


def _pieces(snippet: str, opening: str, closing: str) -> tuple[tuple[str, bool], ...]:
    """A snippet whose matches FTS5 wrapped in `opening` … `closing` as (text, matched) pieces, its whitespace
    (newlines too) made single spaces: a snippet is one line."""
    pieces: list[tuple[str, bool]] = []
    for i, part in enumerate(snippet.split(opening)):
        matched, _, rest = part.rpartition(closing) if i else ("", "", part)
        for text, is_match in ((matched, True), (rest, False)):
            text = _SPACE.sub(" ", text)
            if text:
                pieces.append((text, is_match))
    if pieces and not pieces[0][1]:
        pieces[0] = (pieces[0][0].lstrip(), False)
    if pieces and not pieces[-1][1]:
        pieces[-1] = (pieces[-1][0].rstrip(), False)
    return tuple(p for p in pieces if p[0])


def search(conn: sqlite3.Connection, text: str, limit: int, snippet_tokens: int = 12) -> list[SearchHit]:
    """The rounds matching `text`, best first (bm25; then the chat's latest activity, the later round), at most
    `limit`, each with a snippet of the side (message or reply) that holds more of the matches."""
    expression = match_expression(text)
    # Markers no stored text can hold by chance: a message could carry any fixed marker and fake a match.
    opening, closing = f"\ue000{secrets.token_hex(4)}", f"\ue001{secrets.token_hex(4)}"
    tokens = max(1, min(int(snippet_tokens), 64))  # FTS5's own range
    rows = conn.execute(
        f"SELECT r.session_id, s.title, s.updated, r.idx, "
        f"snippet([{FTS_TABLE}], 0, :open, :close, '…', :tokens), "
        f"snippet([{FTS_TABLE}], 1, :open, :close, '…', :tokens) "
        f"FROM [{FTS_TABLE}] JOIN rounds r ON r.rowid = [{FTS_TABLE}].rowid JOIN sessions s ON s.id = r.session_id "
        f"WHERE [{FTS_TABLE}] MATCH :query ORDER BY [{FTS_TABLE}].rank, s.updated DESC, r.idx DESC LIMIT :limit",
        {"open": opening, "close": closing, "tokens": tokens, "query": expression, "limit": max(0, int(limit))},
    ).fetchall()
    hits = []
    for sid, title, updated, idx, message, reply in rows:
        sides = [_pieces(message, opening, closing), _pieces(reply, opening, closing)]
        found = [sum(matched for _, matched in pieces) for pieces in sides]
        side = 1 if found[1] > found[0] else 0
        hits.append(SearchHit(sid, title or "", idx, SIDES[side], sides[side], updated))
    return hits
