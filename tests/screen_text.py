"""The text of a Textual SVG screenshot, row by row, so that a test can read what a snapshot shows (which words
are whole, what the footer says)."""

from __future__ import annotations

import html
import re

CELL_WIDTH = 12.2  # Textual's SVG export: one terminal column
_TEXT = re.compile(r'<text class="terminal-[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>')


def screen_rows(svg: str) -> list[str]:
    """The screen's rows as text, each character in its column (blank cells as spaces)."""
    cells: dict[float, dict[int, str]] = {}
    for x, y, text in _TEXT.findall(svg):
        row = cells.setdefault(float(y), {})
        column = round(float(x) / CELL_WIDTH)
        for i, ch in enumerate(html.unescape(text).replace("\xa0", " ")):
            row[column + i] = ch
    rows = []
    for y in sorted(cells):
        row = cells[y]
        rows.append("".join(row.get(i, " ") for i in range(max(row) + 1)).rstrip() if row else "")
    return rows


def cut_words(rows: list[str], phrase: str) -> list[str]:
    """The words of `phrase` (a label the screen shows) missing whole from the screen, when its first word is on
    it: a label cut at a box's edge ("runs past the mod") loses the words after the cut. Wrapped text keeps whole
    words, so it passes."""
    text = "\n".join(rows)
    words = [w.strip(".,:;()“”\"") for w in phrase.split()]
    words = [w for w in words if w]
    if not words or not re.search(rf"(?<!\w){re.escape(words[0])}(?!\w)", text):
        return []
    return [w for w in words if not re.search(rf"(?<![\w']){re.escape(w)}(?![\w'])", text)]


def labels_cut(app) -> dict[str, list[str]]:
    """For each label, checkbox and footer key wholly on the app's screen now: the words of its text that the
    screenshot lacks (none, where nothing is cut)."""
    from textual.widget import Widget
    from textual.widgets import Checkbox, Label
    from textual.widgets._footer import FooterKey

    rows = screen_rows(app.export_screenshot())
    screen_region = app.screen.region
    cut = {}
    for widget in app.screen.query("Label, Checkbox, FooterKey"):
        if not widget.display or widget.region.area == 0 or not screen_region.contains_region(widget.region):
            continue
        clipped_by = [a for a in widget.ancestors if isinstance(a, Widget) and a.is_scrollable
                      and not a.scrollable_content_region.contains_region(widget.region)]
        if clipped_by:
            continue  # scrolled out of its container, wholly or partly
        if isinstance(widget, FooterKey):
            text = widget.description
        elif isinstance(widget, Checkbox):
            text = str(widget.label)
        elif isinstance(widget, Label):
            text = str(widget.render())
        missing = cut_words(rows, text)
        if missing:
            cut[text] = missing
    return cut
