"""Message search (issue 42): the FTS5 index of every round's message and reply (migration 007_message_search),
kept current by triggers and built for stores that predate it; queries in which nothing the user types is FTS
syntax; `kvchat search`; and the app's search dialog (ctrl+g), which opens the chat at the hit."""

from __future__ import annotations

import json
import random
import re
import sqlite3

import pytest
from sqlite_utils import Database

import kvchat.storage.db as db_module
from cli_run import kvchat
from kvchat.paths import data_dir
from kvchat.storage.db import RoundRow, Store, now
from kvchat.storage.search import FTS_TABLE, SEARCHED_COLUMNS, TOKENIZE, SearchError, create_index

BEFORE_SEARCH = [m for m in db_module.MIGRATIONS][:[name for name, _ in db_module.MIGRATIONS].index(
    "007_message_search")]


def chat(store: Store, title: str, exchanges: list[tuple[str, str]]) -> str:
    sid = store.create_session(title=title, model_fingerprint="fp", model_path="model.gguf", system_prompt=None)
    for i, (user, reply) in enumerate(exchanges):
        store.add_round(sid, RoundRow(i, user, reply, 10 * i, 10 * i + 10, now()))
    return sid


def found(store: Store, query: str) -> list[tuple[str, int, str]]:
    return [(h.session_id, h.round_idx, h.side) for h in store.search(query)]


def index_is_sound(store: Store) -> None:
    """FTS5's own check that the external-content index holds exactly what the rounds hold (raises otherwise)."""
    store.db.execute(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rank) VALUES('integrity-check', 1)")


def old_store(monkeypatch, home) -> Store:
    """A store made by a kvchat from before message search (the migrations up to 006)."""
    with monkeypatch.context() as m:
        m.setattr(db_module, "MIGRATIONS", BEFORE_SEARCH)
        return Store(home)


# ---- the index ----


def test_an_existing_store_is_indexed_when_this_version_first_opens_it(tmp_path, monkeypatch):
    store = old_store(monkeypatch, tmp_path)
    trip = chat(store, "Trip", [("I live in Lowford by the sea.", "Noted: Lowford."), ("And my café?", "Yes.")])
    other = chat(store, "Other", [("Nothing here.", "Fine.")])
    assert FTS_TABLE not in store.db.table_names()
    store.close()

    store = Store(tmp_path)  # migrates: the index is made and filled with the rounds already stored
    assert "007_message_search" in {r["name"] for r in store.db["_migrations"].rows}
    assert store.db["rounds"].detect_fts() == FTS_TABLE  # sqlite-utils sees it as its own
    assert found(store, "lowford") == [(trip, 0, "message")]
    assert found(store, "cafe") == [(trip, 1, "message")]  # accents folded
    assert found(store, "fine") == [(other, 0, "reply")]
    index_is_sound(store)

    # a store that lost the record of this migration (kept its index) is migrated again, the index made anew
    store.db.execute("DELETE FROM _migrations WHERE name = '007_message_search'")
    store.db.execute("UPDATE rounds SET user_text = 'I live in Porto.' WHERE session_id = ? AND idx = 0", [trip])
    store.close()
    store = Store(tmp_path)
    assert found(store, "porto") == [(trip, 0, "message")] and found(store, "lowford") == [(trip, 0, "reply")]
    index_is_sound(store)


def test_the_index_is_the_one_sqlite_utils_enable_fts_makes():
    def schema(db: Database) -> list:
        return sorted(db.execute("SELECT type, name, sql FROM sqlite_master WHERE name LIKE 'rounds%' "
                                 "AND sql IS NOT NULL").fetchall())

    columns = {"session_id": str, "idx": int, "user_text": str, "assistant_text": str}
    theirs, ours = Database(memory=True), Database(memory=True)
    for db in (theirs, ours):
        db["rounds"].create(columns, pk=("session_id", "idx"))
        db["rounds"].insert({"session_id": "a", "idx": 0, "user_text": "hello there", "assistant_text": "hi"})
    theirs["rounds"].enable_fts(list(SEARCHED_COLUMNS), create_triggers=True, tokenize=TOKENIZE)
    create_index(ours.conn)

    def normalized(db):  # sqlite-utils has quoted names with [] and with "" across versions
        return [tuple(str(v).replace("[", '"').replace("]", '"') for v in row) for row in schema(db)]

    assert normalized(ours) == normalized(theirs)
    assert list(ours["rounds"].search("hello")) == list(theirs["rounds"].search("hello"))


def test_triggers_keep_the_index_current_through_every_change_to_a_chat():
    store = Store(data_dir())
    sid = chat(store, "Pets", [("My dog is Rex.", "Noted.")])
    assert found(store, "rex") == [(sid, 0, "message")]

    # a pending round then its reply (what send does), the reply replaced on regenerating
    row = RoundRow(1, "My cat is Tom.", "", 10, 12, now(), "pending")
    store.add_round(sid, row)
    assert found(store, "tom") == [(sid, 1, "message")]
    store.finish_round(sid, RoundRow(1, row.user_text, "Noted: Tomasz.", 10, 20, row.created))
    assert found(store, "tomasz") == [(sid, 1, "reply")]
    removed, _ = store.delete_last_round(sid)
    assert removed.idx == 1 and found(store, "tom") == []

    fork = store.fork_session(sid, 1, "Pets (fork)")
    assert sorted(found(store, "rex")) == sorted([(sid, 0, "message"), (fork, 0, "message")])
    imported = store.insert_session(title="Imported", model_fingerprint="fp", model_path="m", system_prompt=None,
                                    settings={}, rounds=[RoundRow(0, "The boat is Wavelet.", "Noted.", 0, 5, now())],
                                    segments=[])
    assert found(store, "wavelet") == [(imported, 0, "message")]
    store.delete_session(sid)
    assert found(store, "rex") == [(fork, 0, "message")]
    index_is_sound(store)


def test_a_read_only_store_from_before_the_index_is_searched_through_one_in_memory(tmp_path, monkeypatch):
    writer = old_store(monkeypatch, tmp_path)
    sid = chat(writer, "Trip", [("I live in Lowford.", "Noted.")])
    monkeypatch.setattr(db_module, "_can_write", lambda home, path: False)  # as on a read-only mount
    reader = Store(tmp_path)
    assert reader.read_only and FTS_TABLE not in reader.db.table_names()
    assert found(reader, "lowf") == [(sid, 0, "message")]
    writer.add_round(sid, RoundRow(1, "I moved.", "Noted: you live in Porto.", 10, 20, now()))  # another process
    assert found(reader, "porto") == [(sid, 1, "reply")]
    assert FTS_TABLE not in reader.db.table_names()  # nothing written to the store itself


# ---- queries: nothing typed is syntax ----

HOSTILE = ['"', '""', '"lowford', 'a AND', 'AND', 'OR', 'NOT', 'NEAR(', 'NEAR(a b, 2)', '*', 'low*', '-x', '- x',
           'col:val', 'user_text:lowford', '{user_text}: x', '^lowford', '(', ')', '+', "'", 'a"b', 'x:', ':',
           '日本語', 'café', 'Ωmega', '🙂', 'lowford\x00', '\x1b[31m', '\\', '%', '_', 'a' * 5000]


def test_query_syntax_never_raises_and_changes_nothing():
    store = Store(data_dir())
    chat(store, "Trip", [("I live in Lowford, NEAR(the) sea: col:val 100% a_b.", "Noted: Lowford 日本語 café.")])
    before = store.db.execute("SELECT COUNT(*), total_changes() FROM rounds").fetchone()
    for query in HOSTILE:
        try:
            hits = store.search(query)
        except SearchError as exc:  # only a query without a word of letters or digits
            assert not any(ch.isalnum() for ch in query), exc
            assert "nothing to search for" in str(exc)
        else:
            assert isinstance(hits, list), query
    assert store.db.execute("SELECT COUNT(*), total_changes() FROM rounds").fetchone() == before
    assert [h.round_idx for h in store.search("NEAR(")] == [0]  # the word "near", found as text
    assert [h.round_idx for h in store.search("col:val")] == [0]  # the phrase "col val"


def test_random_mixtures_of_syntax_never_raise():
    store = Store(data_dir())
    chat(store, "Trip", [("I live in Lowford by the sea.", "Noted: Lowford.")])
    alphabet = list('"*:^-+(){}[],.\'\\ ') + ["AND", "OR", "NOT", "NEAR", "low", "ford", "é", "日"]
    rng = random.Random(42)
    for _ in range(300):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        try:
            store.search(query)
        except SearchError:
            assert not any(ch.isalnum() for ch in query), query


def test_words_match_as_prefixes_in_any_order_and_the_snippet_marks_them():
    store = Store(data_dir())
    sid = chat(store, "Trip", [("My sister Mira lives in Lowford.", "Noted: Mira lives in Lowford.")])
    chat(store, "Other", [("Lowford only.", "Right.")])
    assert [h.session_id for h in store.search("LOWF sist")] == [sid]  # every word, as a prefix, any case
    assert [h.session_id for h in store.search('"lowford" AND mira')] == []  # "and" is a word like any other
    [hit] = store.search("sister mira")
    assert hit.side == "message" and hit.title == "Trip"
    assert [hit.snippet[a:b] for a, b in hit.matches] == ["sister", "Mira"]
    assert store.search("lowford", limit=1) and len(store.search("lowford", limit=1)) == 1


def test_stored_text_cannot_fake_a_match_marker():
    store = Store(data_dir())
    chat(store, "Trip", [("\ue000 fake \ue001 real Lowford", "ok")])
    [hit] = store.search("lowford")
    assert [hit.snippet[a:b] for a, b in hit.matches] == ["Lowford"]


@pytest.mark.parametrize("query", ["", "   ", '"', "* - :"])
def test_a_query_without_words_is_one_line_error(query):
    with pytest.raises(SearchError, match="nothing to search for"):
        Store(data_dir()).search(query)


# ---- kvchat search ----


def test_kvchat_search_prints_one_hit_a_line_with_stored_text_made_safe():
    store = Store(data_dir())
    sid = chat(store, "Trip\x1b[2J", [("I live in Lowford.\nBy the \x1b]52;c;evil\x07 sea.", "Noted: Lowford.")])
    other = chat(store, "Home", [("Lowford again", "Yes")])
    store.close()
    proc = kvchat("search", "lowford")
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and proc.stderr == ""  # one a round
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout  # escaped, never obeyed
    assert any(line.startswith(f"{sid}  Trip\\x1b[2J  [0] message: I live in Lowford. By the \\x1b]52")
               for line in lines), lines
    assert any(line.startswith(f"{other}  Home  [0] message: Lowford again") for line in lines)
    assert len(kvchat("search", "lowford", "--limit", "1").stdout.splitlines()) == 1

    nothing = kvchat("search", "zzz")
    assert nothing.stdout == "" and "no message or reply matches 'zzz'" in nothing.stderr


def test_kvchat_search_json():
    store = Store(data_dir())
    sid = chat(store, "Trip", [("I live in Lowford.", "Noted.")])
    store.close()
    [hit] = json.loads(kvchat("search", "--json", "lowf").stdout)
    assert hit == {"session": sid, "title": "Trip", "round": 0, "side": "message", "snippet": "I live in Lowford.",
                   "matches": [[10, 17]]}
    [both] = json.loads(kvchat("search", "live", "lowf", "--json").stdout)  # words need no quotes
    assert both["session"] == sid and both["matches"] == [[2, 6], [10, 17]]
    assert json.loads(kvchat("search", "--json", "zzz").stdout) == []


def test_kvchat_help_lists_search():
    assert re.search(r"^\s+search\s+Find WORDS in the messages and replies", kvchat("--help").stdout, flags=re.M)


@pytest.mark.parametrize("query", ['"', "", "*"])
def test_kvchat_search_without_words_is_one_line_and_changes_nothing(query):
    Store(data_dir()).close()
    before = sqlite3.connect(data_dir() / "kvchat.db").execute("SELECT COUNT(*) FROM rounds").fetchone()
    proc = kvchat("search", query, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("kvchat: error: nothing to search for") and len(proc.stderr.splitlines()) == 1
    assert sqlite3.connect(data_dir() / "kvchat.db").execute("SELECT COUNT(*) FROM rounds").fetchone() == before


@pytest.mark.parametrize("query", ["a AND", "NEAR(", "-x", "col:val", 'say "hi'])
def test_kvchat_search_with_syntax_characters_answers(query):
    Store(data_dir()).close()
    proc = kvchat("search", query)
    assert proc.stdout == "" and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


# ---- the app ----


async def test_the_search_dialog_finds_message_text_and_opens_the_chat_at_the_hit():
    from kvchat.app.tui.chat_view import MessageView
    from kvchat.app.tui.dialogs.search import SearchDialog
    from tui_support import make_app, screen, seed_chat, wait_for, wait_idle

    rounds = [(f"Filler message number {i}.", f"Noted, number {i}.") for i in range(12)]
    target = seed_chat("Long chat", rounds[:5] + [("I grew up in Lowford.", "Noted: Lowford.")] + rounds[5:],
                       with_kv=False)
    seed_chat("Newer chat", [("Nothing to see.", "Fine.")], with_kv=False)
    app = make_app()
    async with app.run_test(size=(120, 35)) as pilot:
        await wait_for(pilot, lambda: screen(app)._chats_shown, what="the chat list")
        await wait_idle(pilot)
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: isinstance(app.screen, SearchDialog), what="the search dialog")
        dialog = app.screen
        await pilot.press(*'"')  # a lone quote: said in the dialog, no error, nothing listed
        await wait_for(pilot, lambda: dialog.hits_for == '"', what="the answer to a quote")
        assert "nothing to search for" in str(dialog.query_one("#search-status").render())
        await pilot.press("backspace", *"lowford", "enter")
        await wait_for(pilot, lambda: screen(app).open_sid == target, what="the chat with the hit")
        chat_screen = screen(app)
        await wait_for(pilot, lambda: chat_screen.chat_view.selected is not None, what="the hit selected")
        selected = chat_screen.chat_view.selected
        assert isinstance(selected, MessageView) and "Lowford" in selected.text
        await pilot.pause(0.2)
        view = chat_screen.chat_view
        assert view.scroll_y <= selected.virtual_region.y <= view.scroll_y + view.size.height  # scrolled to it
        await wait_idle(pilot)

        # ctrl+f filters titles only: no title holds Lowford; ctrl+g then searches the messages for those words
        await pilot.press("ctrl+f", *"lowford")
        await wait_for(pilot, lambda: chat_screen.sidebar.chat_list.option_count == 0, what="the title filter")
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: isinstance(app.screen, SearchDialog) and app.screen.hits_for == "lowford",
                       what="the filter's words searched")
        assert [(h.session_id, h.round_idx) for h in app.screen.hits] == [(target, 5)]
        await pilot.press(*"zzz")  # the words are selected: typing replaces them
        await wait_for(pilot, lambda: app.screen.hits_for == "zzz", what="a new search")
        assert "No message or reply matches" in str(app.screen.query_one("#search-status").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, SearchDialog) and chat_screen.open_sid == target
