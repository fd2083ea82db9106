"""kvchat: a local terminal assistant whose chats resume from their saved KV cache instead of being re-read."""

__version__ = "0.1.0"

import logging

# A library's warnings go where its user's logging sends them: without a handler, Python's last resort would write a
# background thread's "KV of round N not saved" into the middle of a streaming reply. The commands say such
# failures themselves, once, after the reply.
logging.getLogger("kvchat").addHandler(logging.NullHandler())
