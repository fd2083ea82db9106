"""The code blocks of a message (fenced or indented, as its Markdown shows them), for copying one at a time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodeBlock:
    code: str  # as written between the fences, without the last line's newline
    language: str  # the fence's info word ("python"), "" when it names none

    def describe(self) -> str:
        """ "python, 3 lines" """
        lines = self.code.count("\n") + 1
        return ", ".join(filter(None, [self.language, f"{lines} line{'s' if lines != 1 else ''}"]))


def code_blocks(text: str) -> list[CodeBlock]:
    """The code blocks of Markdown `text`, in order (the parser Textual's Markdown widget uses, so what is a block
    on screen is one here)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    return [CodeBlock(t.content.removesuffix("\n"), t.info.split()[0] if t.info.strip() else "")
            for t in tokens if t.type in ("fence", "code_block")]
