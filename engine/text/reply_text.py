r"""A reply's text as it streams: what may be shown now, so that what was shown is exactly what is saved.

A stop string (a base model's next speaker line, "\nUser:") is cut off the reply; it arrives over several tokens,
so the end of the text that could still be the start of one is held back until the next token says whether it is
("\nUs" is shown once "\nUse" became "\nUsed"). With `strip`, the reply is shown and saved without the whitespace
around it: none before its first character (a transcript's generation prompt ends at "Assistant:", and the reply's
first token brings its own space), and whitespace is shown only once more text follows it (a base model leaves a
blank line before the next speaker's); the reply's start counts as a line's start, so a reply that opens with
"User:" is a stop at once.
"""

from __future__ import annotations


class ReplyText:
    def __init__(self, stop_strings: tuple[str, ...] = (), strip: bool = False):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.strip = strip
        self.text = ""  # everything released so far: the reply as shown and saved
        self.stopped = False  # a stop string came: nothing more is released
        self._held = ""

    def feed(self, piece: str) -> str:
        """The text `piece` (a token's) lets out now: "" while it may still be part of a stop string."""
        if self.stopped:
            return ""
        if not self.stop_strings and not self.strip:
            self.text += piece
            return piece
        held = self._held + piece
        at_start = self.strip and not self.text
        if at_start:
            held = "\n" + held.lstrip()  # the reply begins a line (this "\n" is never shown)
        stop = min((at for at in (held.find(s) for s in self.stop_strings) if at >= 0), default=-1)
        if stop >= 0:
            out, self._held, self.stopped = held[:stop], "", True
            return self._release(out.rstrip() if self.strip else out, at_start)
        cut = len(held) - self._stop_prefix(held)
        if self.strip:  # the whitespace before what is held back waits too: it may end the reply
            cut = len(held[:cut].rstrip())
        out, self._held = held[:cut], held[cut:]
        return self._release(out, at_start)

    def finish(self) -> str:
        """What is still held once the reply has ended without a stop string."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return self._release(out.rstrip() if self.strip else out, self.strip and not self.text)

    def _release(self, out: str, at_start: bool) -> str:
        if at_start:
            out = out.lstrip()
        self.text += out
        return out

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that begins some stop string."""
        for k in range(min(len(text), max(map(len, self.stop_strings), default=1) - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0
