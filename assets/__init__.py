"""The embedded default model: a small memory-assistant demo trained by engine.train.trainer (see docs/embedded-model.md)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent  # the package data: the model, and the MT-Bench questions the benchmarks use
DEFAULT_MODEL = ASSETS / "kvchat-memory-demo.gguf"
