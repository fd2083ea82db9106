"""A checkbox whose label wraps at word boundaries over as many lines as it needs: Textual's Checkbox draws one line
and cuts a long label at its edge ("…runs past the mod"), which a narrow terminal turns into lost words."""

from __future__ import annotations

from textual.geometry import Size
from textual.widgets import Checkbox


class WrappingCheckbox(Checkbox):
    DEFAULT_CSS = """
    WrappingCheckbox {
        width: 100%;
        height: auto;
        text-wrap: wrap;
        text-overflow: fold;
    }
    """

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.render().wrap(max(1, width))))
