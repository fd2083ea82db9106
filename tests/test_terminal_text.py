"""Stored text never drives the terminal: control characters in titles and messages (typed, generated or imported)
are shown escaped by `sessions`, `show` and the app, and kept byte-exact in the store and its exports; binary input
is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata

import pytest
from cli_run import kvchat
from tui_support import seed_chat

from kvchat.app.terminal_text import terminal_line, terminal_text

# One of each class: ESC sequences (CSI clear screen, OSC 52 clipboard write ended by BEL, OSC title ended by ST),
# BEL, backspace, carriage return, DEL, C1 CSI, a bidi override, NUL.
HOSTILE = ("a\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07b\x1b]0;pwned\x1b\\c\x07d\x08\x08e\rf\x7fg\x9b31mh\u202eevil\u202c"
           "i\x00j")


def _safe_for_a_terminal(text: str, newlines: bool = True) -> bool:
    allowed = "\n\t" if newlines else ""
    return all(ch in allowed or (unicodedata.category(ch) not in ("Cc", "Cs")
                                 and (newlines or ch not in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"))
               for ch in text)


def test_every_control_character_is_escaped_and_the_rest_kept():
    every = "".join(chr(c) for c in range(0x3000) if not 0xD800 <= c <= 0xDFFF) + "\udcff"
    shown, line = terminal_text(every), terminal_line(every)
    assert _safe_for_a_terminal(shown) and _safe_for_a_terminal(line, newlines=False)
    assert "\n" in shown and "\n" not in line and "\\x1b" in shown and "\\x9b" in line and "\\u202e" in line
    assert "\\udcff" in shown  # an undecodable byte is shown, not an encoding error
    plain = "Olá, 世界 — ok\n\tnext line"
    assert terminal_text(plain) == plain and terminal_line("Olá, 世界 — ok") == "Olá, 世界 — ok"
    assert terminal_text("\u202eRTL text stays in a message") == "\u202eRTL text stays in a message"


def test_sessions_and_show_print_stored_control_characters_escaped_and_json_keeps_them(tmp_path):
    sid = seed_chat("title" + HOSTILE + "\nsecond line", [(HOSTILE, "reply" + HOSTILE)], with_kv=False,
                    system_prompt="system" + HOSTILE)
    listed = kvchat("sessions").stdout
    shown = kvchat("show", sid).stdout
    for out in (listed, shown):
        assert _safe_for_a_terminal(out), repr(out)
        assert "\\x1b]52;c;" in out  # what it was is still visible
    assert len(listed.strip().splitlines()) == 1  # a newline in a title cannot fake a second chat
    data = json.loads(kvchat("show", sid, "--json").stdout)
    assert data["title"] == "title" + HOSTILE + "\nsecond line"
    assert data["rounds"][0]["user"] == HOSTILE and data["rounds"][0]["assistant"] == "reply" + HOSTILE
    exported = tmp_path / "chat.kvstate"
    kvchat("export", sid, "-o", str(exported), "--text-only")
    imported = kvchat("import", str(exported)).stdout.strip()
    again = json.loads(kvchat("show", imported, "--json").stdout)
    # The exported chat is still there, so the import's title is told apart from it
    assert again["rounds"][0]["user"] == HOSTILE and again["title"] == data["title"] + " (2)"


@pytest.mark.parametrize("stdin", [b"\xff\xfe not text", b"caf\xe9"])
def test_a_message_that_is_not_utf8_is_one_line(stdin):
    proc = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "send", "nosuchchat", "-"], input=stdin,
                          capture_output=True)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith("kvchat: error: the message on stdin is not UTF-8 text (byte ")
