"""The app's own settings (model file for new chats, sampling, reply length, KV policy, compaction, GPU memory), kept
as JSON in $KVCHAT_HOME.

A chat's system prompt is not here: it belongs to the chat and lives in the store, as with `kvchat new --system`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kvchat.engine.policies import CHAT_POLICIES
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import KvchatError
from kvchat.paths import data_dir

FILE_NAME = "app-settings.json"


@dataclass
class Preferences:
    model_path: str = ""  # empty: the embedded model
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 512
    kv_policy: str = "full"  # one of CHAT_POLICIES: what the chats opened from now on run under
    kv_budget: float = 0.2  # xkv: the share of a chat's K/V each reply reads, in (0, 1]
    compact_kv: bool = True  # after each saved round, drop the K/V that restoring on this machine recomputes anyway
    reply_guard: bool = True  # stop a reply that loops or runs past the model's reply cap (engine.reply_guard)
    gpu_memory: str = ""  # what kvchat may use of the GPU, as written ("8GiB"); empty: what it has free
    keep_edited_branch: bool = True  # editing a past message keeps the rounds it replaces as a fork of the chat
    theme: str = ""  # the Textual theme last chosen (command palette); empty: Textual's default

    @property
    def gpu_memory_bytes(self) -> int | None:
        """The GPU memory budget in bytes (engine.memory_plan), None: what the GPU has free."""
        from kvchat.engine.memory_plan import parse_size

        return parse_size(self.gpu_memory) if self.gpu_memory else None

    @property
    def guard(self) -> ReplyGuard:
        return ReplyGuard(enabled=self.reply_guard)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def validate(self) -> "Preferences":
        self.sampling.validate()
        if self.max_tokens < 1:
            raise KvchatError(f"the reply length must be at least 1 token, not {self.max_tokens}")
        if self.kv_policy not in CHAT_POLICIES:
            raise KvchatError(f"unknown KV policy {self.kv_policy!r} for chats (accepted: {', '.join(CHAT_POLICIES)})")
        if isinstance(self.kv_budget, bool) or not isinstance(self.kv_budget, (int, float)) or \
                not 0 < self.kv_budget <= 1:
            raise KvchatError(f"the KV budget is a share of the chat's K/V in (0, 1], not {self.kv_budget!r}")
        if not isinstance(self.gpu_memory, str):
            raise KvchatError("the GPU memory must be a size such as 8GiB")
        try:
            self.gpu_memory_bytes
        except ValueError as exc:
            raise KvchatError(f"GPU memory: {exc}") from None
        return self

    @classmethod
    def load(cls, home: Path | None = None) -> "Preferences":
        """The saved settings; defaults where the file is missing, unreadable or holds bad values."""
        path = (home or data_dir()) / FILE_NAME
        try:
            raw = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            prefs = cls(**{k: v for k, v in raw.items() if k in known})
            if prefs.kv_policy not in CHAT_POLICIES:  # a hand edit or another version's name: only it is reset
                prefs.kv_policy = "full"
            if not isinstance(prefs.compact_kv, bool):
                prefs.compact_kv = True
            if not isinstance(prefs.reply_guard, bool):
                prefs.reply_guard = True
            if not isinstance(prefs.keep_edited_branch, bool):
                prefs.keep_edited_branch = True
            if isinstance(prefs.kv_budget, bool) or not isinstance(prefs.kv_budget, (int, float)) or \
                    not 0 < prefs.kv_budget <= 1:
                prefs.kv_budget = 0.2
            if not isinstance(prefs.theme, str):  # an unknown name is let go when the app applies it
                prefs.theme = ""
            try:
                prefs.gpu_memory_bytes
            except (ValueError, TypeError, AttributeError):  # a hand edit: only it is reset
                prefs.gpu_memory = ""
            return prefs.validate()
        except (OSError, ValueError, TypeError, KvchatError):
            return cls()

    def save(self, home: Path | None = None) -> None:
        folder = home or data_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{FILE_NAME}.part"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, folder / FILE_NAME)  # never half a settings file
