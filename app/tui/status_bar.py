"""The status bar: model and device, context used, speed and first-token time of the last reply, how the chat's
KV cache came back (tokens loaded vs recomputed, milliseconds), and its bytes on disk vs raw."""

from __future__ import annotations

from dataclasses import dataclass

from textual.widgets import Static

from kvchat.app.session.service import ChatStats
from kvchat.app.terminal_text import terminal_line
from kvchat.app.tui.formatting import UNMEASURED, kv_line, model_name, restore_line


@dataclass
class LastReply:
    tokens_per_second: float
    first_token_ms: float


class StatusBar(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__("starting…", markup=False, **kwargs)
        self.measured = True  # False: timings and compressed sizes are drawn as "…" (stable snapshots)
        self.model_path = ""
        self.device = ""
        self.stats: ChatStats | None = None
        self.last_reply: LastReply | None = None
        self.activity = ""
        self.note = ""  # what the last step reused (an edit's kept K/V), until the next reply or another chat
        self.model_failed = False  # the model of new chats could not be loaded: say so instead of "loading…"

    def set_model(self, model_path: str, device: str) -> None:
        self.model_path, self.device = model_path, device
        self.model_failed = False
        self.redraw()

    def set_model_failed(self, model_path: str) -> None:
        """The start (the store or the model) failed: the bar leaves "starting…"/"loading…" for what is known."""
        self.model_path = self.model_path or model_path
        self.model_failed = not self.device
        self.redraw()

    def set_chat(self, stats: ChatStats | None, last_reply: LastReply | None) -> None:
        if stats is None:  # no chat, or another one being opened
            self.note = ""
        self.stats, self.last_reply = stats, last_reply
        if stats is not None:
            self.model_path = stats.model_path
            self.device = stats.device or self.device
        self.redraw()

    def set_activity(self, activity: str) -> None:
        if activity == "generating…":
            self.note = ""
        self.activity = activity
        self.redraw()

    def set_note(self, note: str) -> None:
        self.note = note
        self.redraw()

    def redraw(self) -> None:
        first = [model_name(self.model_path) or "no model yet",
                 self.device or ("model not loaded" if self.model_failed else "loading…")]
        second: list[str] = []
        s = self.stats
        if s is None:
            first.append("no chat open")
        else:
            if s.base_model:  # no chat template: replies continue a plain transcript, and read like it
                first.append("base model: plain transcript")
            first.append(f"context {s.context_used}/{s.context_length or '?'}")
            if self.last_reply is not None:
                if self.measured:
                    first += [f"{self.last_reply.tokens_per_second:.1f} tok/s",
                              f"first token {self.last_reply.first_token_ms:.1f} ms"]
                else:
                    first += [f"{UNMEASURED} tok/s", f"first token {UNMEASURED} ms"]
            second += [restore_line(s, self.measured), kv_line(s, self.measured)]
            if s.memory:  # the GPU memory budget put the chat on the tiered cache
                second.append("K/V tiered to fit the GPU memory budget")
            if self.note:
                second.append(self.note)
        if self.activity:
            first.append(self.activity)
        # Each line escaped: a model file's name or another process's command (in "waiting for…") is stored text.
        lines = [terminal_line(" · ".join(first))] + ([terminal_line(" · ".join(second))] if second else [])
        self.update("\n".join(lines))
