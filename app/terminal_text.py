"""Stored text made safe to print on a terminal: what a chat holds (typed, generated or imported from a state file)
may carry control characters — ESC sequences that move the cursor or rewrite the screen, OSC 52 clipboard writes,
BEL, backspaces, bidi overrides that reorder a title. Displays escape them into visible `\\xNN` form; the store keeps
the text byte-exact (exports round-trip it). Used by the CLI and the app alike.
"""

from __future__ import annotations

# Bidi embeddings, overrides and isolates: in a one-line title they can make the listed text read otherwise.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _unsafe(ch: str, keep: str, bidi: bool) -> bool:
    code = ord(ch)
    if ch in keep:
        return False
    return (code < 0x20 or code == 0x7F or 0x80 <= code <= 0x9F  # C0, DEL, C1 (CSI, OSC, ST as one byte)
            or 0xD800 <= code <= 0xDFFF  # lone surrogates (undecodable bytes): not printable, not encodable
            or (bidi and ch in _BIDI_CONTROLS))


def terminal_text(text: str) -> str:
    """A message or reply for the terminal: newlines and tabs kept, every other control character escaped."""
    if text.isprintable():
        return text
    return "".join(_escaped(ch) if _unsafe(ch, "\n\t", False) else ch for ch in text)


def terminal_line(text: str) -> str:
    """A title or other one-line field: newlines, tabs and bidi controls escaped too."""
    if text.isprintable():
        return text
    return "".join(_escaped(ch) if _unsafe(ch, "", True) else ch for ch in text)
