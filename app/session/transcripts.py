"""A chat as a transcript other tools read (`kvchat export --format md|txt|json`, the app's export dialog): Markdown,
plain text, or the role/content message list of chat APIs. Unlike a state file it holds no K/V and cannot be
imported back; it is written atomically all the same (temporary file, fsync, rename), and a place it cannot be
written is one line."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import replace_atomically
from kvchat.storage.db import RoundRow

# What `kvchat export --format` takes: "state" is the state file (storage.statefile), the rest are transcripts.
EXPORT_FORMATS = ("state", "md", "txt", "json")
SUFFIXES = {"state": ".kvstate", "md": ".md", "txt": ".txt", "json": ".json"}


def messages(info: dict, rounds: list[RoundRow]) -> list[dict]:
    """The chat as [{"role": "system" | "user" | "assistant", "content": ...}]: the system prompt first if it has
    one, then each round's message and reply (a reply not saved is left out)."""
    out = [{"role": "system", "content": info["system_prompt"]}] if info.get("system_prompt") else []
    for r in rounds:
        out.append({"role": "user", "content": r.user_text})
        if r.assistant_text:
            out.append({"role": "assistant", "content": r.assistant_text})
    return out


def render_transcript(info: dict, rounds: list[RoundRow], fmt: str) -> str:
    listed = messages(info, rounds)
    if fmt == "json":
        return json.dumps(listed, ensure_ascii=False, indent=1) + "\n"
    title = info.get("title") or "(untitled)"
    if fmt == "md":
        # Each turn as written: a reply's Markdown (its code fences too) is kept as it is.
        parts = [f"# {title}"]
        for m in listed:
            heading = {"system": "System prompt", "user": "User", "assistant": "Assistant"}[m["role"]]
            parts.append(f"## {heading}\n\n{m['content'].strip()}")
        return "\n\n".join(parts) + "\n"
    if fmt == "txt":
        parts = [title, "=" * len(title)]
        for m in listed:
            parts.append(f"{m['role']}:\n{m['content'].strip()}")
        return "\n\n".join(parts) + "\n"
    raise KvchatError(f"unknown export format {fmt!r} (accepted: {', '.join(EXPORT_FORMATS)})")


def write_transcript(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (paths.replace_atomically); a failure is one line and leaves whatever was
    at `path` as it was."""
    path = Path(path)
    try:
        return replace_atomically(path, lambda f: f.write(text))
    except OSError as exc:
        raise KvchatError(f"cannot write {path}: {exc.strerror or exc}") from None
