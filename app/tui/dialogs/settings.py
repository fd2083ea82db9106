"""Settings: the model file for new chats, sampling, reply length, KV policy, compaction and GPU memory (the app's),
and the chat's system prompt."""

from __future__ import annotations

from dataclasses import dataclass, replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static, TextArea

from kvchat.app.terminal_text import terminal_text
from kvchat.app.tui.dialogs.save_or_cancel import SaveOrCancel
from kvchat.app.tui.preferences import Preferences
from kvchat.app.tui.wrapping_checkbox import WrappingCheckbox
from kvchat.engine.policies import CHAT_POLICIES
from kvchat.errors import KvchatError

POLICY_CHOICES = {
    "full": "full: every round's K/V on the GPU",
    "round": "round: Round Attention on a tiered KV cache (calibrates the model once)",
    "loopserve": "loopserve: sparse prefill of long messages, progressive decode",
    "xkv": "xkv: each layer reads its own budget of the chat's K/V (XKV)",
    "louiskv": "louiskv: the reply reads the clusters of keys it needs (LouisKV)",
}
# Round Attention is offered, not recommended: on the embedded model its recall is still below the full cache's.
ROUND_HINT = ("round: lower layers of every round on the GPU, upper layers only of the rounds each message picks "
              "(docs/benchmarks.md: recall below the full cache on the embedded model)")

GPU_MEMORY_HINT = ("A chat whose K/V does not fit beside the weights runs on the tiered cache (Round Attention), one "
                   "that does not fit even so is refused; from the next message on. No effect on the CPU.")


@dataclass
class SettingsChoice:
    preferences: Preferences
    system_prompt: str | None  # None: unchanged


class SettingsDialog(SaveOrCancel, ModalScreen[SettingsChoice | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]
    AUTO_FOCUS = None  # on_mount focuses the first field

    def __init__(self, preferences: Preferences, system_prompt: str | None, chat_title: str | None) -> None:
        super().__init__(classes="dialog")
        self.preferences, self.system_prompt, self.chat_title = preferences, system_prompt or "", chat_title
        # Edited as shown: control characters escaped (a stored prompt's ESC is seen, not obeyed by the terminal).
        self.shown_prompt = terminal_text(self.system_prompt)

    def compose(self) -> ComposeResult:
        p = self.preferences
        with Vertical(classes="box wide tall"):
            yield Label("Settings", classes="title")
            with VerticalScroll(id="settings-fields"):
                yield Label("Model file for new chats (empty: the embedded model)")
                # Not selected when focused (it is focused first): a key typed then would replace the whole path.
                yield Input(p.model_path, placeholder="the embedded model", id="model-path", select_on_focus=False)
                with Horizontal(classes="row"):
                    yield self._field("temperature (0: greedy)", "temperature", p.temperature)
                    yield self._field("top-k (0: off)", "top-k", p.top_k)
                    yield self._field("top-p", "top-p", p.top_p)
                with Horizontal(classes="row"):
                    yield self._field("seed (empty: random)", "seed", "" if p.seed is None else p.seed)
                    yield self._field("reply length (tokens)", "max-tokens", p.max_tokens)
                yield Label("KV policy of the chats opened from now on")
                yield Select([(POLICY_CHOICES.get(name, name), name) for name in CHAT_POLICIES], value=p.kv_policy,
                             allow_blank=False, id="kv-policy")
                yield self._hint(ROUND_HINT)
                with Horizontal(classes="row"):
                    yield self._field("xkv budget (share of K/V)", "kv-budget", p.kv_budget)
                yield WrappingCheckbox("Compact chats: after each reply, drop the stored K/V that reopening the chat "
                                       "on this machine recomputes anyway", p.compact_kv, id="compact-kv")
                yield WrappingCheckbox("Guard replies: stop a reply that keeps repeating itself or runs past the "
                                       "model's reply cap", p.reply_guard, id="reply-guard")
                yield WrappingCheckbox("Keep edited branches: editing a past message (ctrl+t) keeps the rounds it "
                                       "replaces as a fork of the chat", p.keep_edited_branch, id="keep-edited-branch")
                yield Label("GPU memory kvchat may use (e.g. 8GiB; empty: what the GPU has free)")
                yield Input(p.gpu_memory, placeholder="what the GPU has free", id="gpu-memory")
                yield self._hint(GPU_MEMORY_HINT)
                if self.chat_title is not None:
                    yield Label(f"System prompt of “{self.chat_title}” (changing it recomputes the chat's KV)",
                                markup=False)
                else:
                    yield Label("System prompt of the next new chat")
                yield TextArea(self.shown_prompt, id="system-prompt", soft_wrap=True)
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        # The app's cursor setting (snapshot tests freeze it): a field is focused as the dialog opens.
        for field in self.query("Input, TextArea"):
            field.cursor_blink = self.app.cursor_blink
        # Open on the first field, its text not selected (its select_on_focus): not on the fields' scroll container,
        # from which the first Tab reached the model field with its path selected, for a key to replace. Not
        # scrolled to either: on a short terminal that would hide its label above it.
        self.query_one("#model-path", Input).focus(scroll_visible=False)

    @staticmethod
    def _hint(text: str) -> Static:
        """A muted note that wraps (a Label would cut it at the box's edge), set apart from the field below."""
        hint = Static(text, classes="hint")
        hint.styles.margin = (1, 0, 1, 0)
        return hint

    @staticmethod
    def _field(label: str, name: str, value) -> Vertical:
        return Vertical(Label(label), Input(str(value), id=name), classes="field")

    def action_save(self) -> None:
        try:
            prefs = self._read()
        except KvchatError as exc:
            self.notify(str(exc), title="Settings not saved", severity="error")
            return
        prompt = self.query_one("#system-prompt", TextArea).text.strip()
        self.dismiss(SettingsChoice(prefs, prompt if prompt != self.shown_prompt.strip() else None))

    def _read(self) -> Preferences:
        def number(name: str, kind):
            raw = self.query_one(f"#{name}", Input).value.strip()
            try:
                return kind(raw)
            except ValueError:
                raise KvchatError(f"{name} must be a {'whole ' if kind is int else ''}number, not {raw!r}") from None

        seed = self.query_one("#seed", Input).value.strip()
        return replace(self.preferences, model_path=self.query_one("#model-path", Input).value.strip(),
                       temperature=number("temperature", float), top_k=number("top-k", int),
                       top_p=number("top-p", float), seed=number("seed", int) if seed else None,
                       max_tokens=number("max-tokens", int),
                       kv_policy=self.query_one("#kv-policy", Select).value,
                       kv_budget=number("kv-budget", float),
                       compact_kv=self.query_one("#compact-kv", Checkbox).value,
                       reply_guard=self.query_one("#reply-guard", Checkbox).value,
                       keep_edited_branch=self.query_one("#keep-edited-branch", Checkbox).value,
                       gpu_memory=self.query_one("#gpu-memory", Input).value.strip()).validate()

    def action_cancel(self) -> None:
        self.dismiss(None)
