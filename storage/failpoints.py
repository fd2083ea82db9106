"""Crash points for the crash-loop tests: with KVCHAT_CRASH_AT=<name> in the environment, the process kills itself
(SIGKILL, no cleanup) when it reaches that point of sending a message, saving a round or compacting a chat. With
KVCHAT_CRASH_SIGNAL=INT or TERM it sends itself that signal instead (the user's Ctrl-C, a shutdown) and goes on;
INT2 sends SIGINT twice (a user who presses Ctrl-C again). Unset, each check is one dictionary lookup."""

from __future__ import annotations

import os
import signal

# In the order a message is sent and its round saved ("reply-token": the reply's first piece has streamed).
POINTS = ("message-text", "message-committed", "reply-token", "round-text", "round-committed", "segment-written",
          "segment-fsynced", "segment-renamed", "segment-durable", "segment-row-committed")
# In the order a chat is compacted (the rows go in one transaction, the files they named after it).
COMPACT_POINTS = ("compact-planned", "compact-rows-dropped", "compact-file-unlinked")
SIGNALS = {"KILL": (signal.SIGKILL,), "INT": (signal.SIGINT,), "TERM": (signal.SIGTERM,),
           "INT2": (signal.SIGINT, signal.SIGINT)}


def crash_point(name: str) -> None:
    if os.environ.get("KVCHAT_CRASH_AT") == name:
        for sig in SIGNALS[os.environ.get("KVCHAT_CRASH_SIGNAL", "KILL")]:
            os.kill(os.getpid(), sig)
