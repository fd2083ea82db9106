"""Errors a user can cause. The CLI prints their message on one line and exits non-zero; anything else is a bug."""


class KvchatError(Exception):
    """Bad input or an unusable environment, described in one sentence for the user."""

    exit_status = 1  # the CLI's


class InterruptedByUser(KvchatError):
    """Ctrl-C stopped a command part way, and it says what it kept."""

    exit_status = 130


class GGUFError(KvchatError):
    """A GGUF file that is missing, truncated, garbled, or describes a model we cannot run."""


class ContextOverflowError(KvchatError):
    """A prompt or chat that does not fit in the model's context window."""


class GPUMemoryError(KvchatError):
    """The model, or a chat's K/V, does not fit in the GPU memory budget (`--gpu-memory`: engine.memory_plan)."""
