"""The embedded default model: a small memory-assistant demo trained by engine.train (see docs/embedded-model.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).with_name("kvchat-memory-demo.gguf")
