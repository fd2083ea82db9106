"""kvchat: a local terminal assistant whose chats resume from their saved KV cache instead of being re-read."""

__version__ = "0.1.0"
