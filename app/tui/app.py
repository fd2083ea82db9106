"""KvchatApp: the Textual application that `kvchat` with no arguments runs."""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from textual.app import App
from textual.binding import Binding

from kvchat.app.session.service import ChatService
from kvchat.app.tui.chat_screen import ChatScreen
from kvchat.app.tui.preferences import Preferences


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class KvchatApp(App[None]):
    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True,
                        tooltip="Quit (a reply being generated is stopped and saved; every round's KV reaches the "
                                "disk before the app exits)")]

    def __init__(self, *, model_path: str | None = None, device: str | None = None, kv_policy: str | None = None,
                 gpu_memory: int | None = None, kv_budget: float | None = None, home: Path | None = None,
                 clock: Callable[[], datetime] = utc_now,
                 show_measurements: bool = True, cursor_blink: bool = True) -> None:
        """`clock`, `show_measurements` and `cursor_blink` exist so snapshot tests can freeze the screen: ages are
        computed from `clock()`, timings and compressed sizes are drawn as "…" when measurements are hidden."""
        super().__init__()
        self.home = home
        self.backend = ChatService(home, device)
        self.preferences = Preferences.load(home)
        if model_path:  # --model on the command line: for this run's new chats, not saved
            self.preferences.model_path = str(Path(model_path).resolve())
        if kv_policy:  # --kv-policy: likewise for this run only
            self.preferences.kv_policy = kv_policy
        if kv_budget is not None:  # --kv-budget: likewise
            self.preferences.kv_budget = kv_budget
        self.gpu_memory = gpu_memory  # --gpu-memory: this run's budget, over the settings' (which may change)
        self.backend.compact_kv = self.preferences.compact_kv
        self.backend.kv_budget = self.preferences.kv_budget
        self.apply_gpu_memory(self.preferences)
        self.clock, self.show_measurements, self.cursor_blink = clock, show_measurements, cursor_blink

    def apply_gpu_memory(self, preferences: Preferences) -> None:
        """The GPU memory budget the chat service plans within: --gpu-memory, else the settings'."""
        if self.gpu_memory is not None:
            self.backend.gpu_memory, self.backend.gpu_memory_name = self.gpu_memory, "--gpu-memory"
        else:
            self.backend.gpu_memory = preferences.gpu_memory_bytes
            self.backend.gpu_memory_name = "the GPU memory setting"

    def on_mount(self) -> None:
        if self.preferences.theme in self.available_themes:  # the theme chosen last time (a removed one is let go)
            self.theme = self.preferences.theme
        self.theme_changed_signal.subscribe(self, self._keep_theme)
        self.push_screen(ChatScreen())

    def _keep_theme(self, theme) -> None:
        """A theme chosen (ctrl+p, "Change theme") is kept across restarts, in the app's settings."""
        if theme.name == self.preferences.theme:
            return
        self.preferences.theme = theme.name
        saved = Preferences.load(self.home)  # only the theme changes: this run's --model and --kv-policy stay unsaved
        saved.theme = theme.name
        try:
            saved.save(self.home)
        except OSError as exc:
            self.notify(f"The theme is not kept for the next start: {exc.strerror or exc}", severity="warning")

    async def action_quit(self) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                screen.stop_everything()
        self.exit()


def run_app(model_path: str | None = None, device: str | None = None, kv_policy: str | None = None,
            gpu_memory: int | None = None, kv_budget: float | None = None) -> None:
    app = KvchatApp(model_path=model_path, device=device, kv_policy=kv_policy, gpu_memory=gpu_memory,
                    kv_budget=kv_budget)
    try:
        app.run()
    finally:
        # A stopped reply's round is being saved, and the KV writer may still hold rounds: wait for both.
        for problem in app.backend.close():
            print(f"kvchat: warning: {problem}", file=sys.stderr)
