"""Errors a user can cause. The CLI prints their message on one line and exits non-zero; anything else is a bug."""


class KvchatError(Exception):
    """Bad input or an unusable environment, described in one sentence for the user."""


class GGUFError(KvchatError):
    """A GGUF file that is missing, truncated, garbled, or describes a model we cannot run."""


class ContextOverflowError(KvchatError):
    """A prompt or chat that does not fit in the model's context window."""
