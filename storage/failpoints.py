"""Crash points for the crash-loop tests: with KVCHAT_CRASH_AT=<name> in the environment, the process kills itself
(SIGKILL, no cleanup) when it reaches that point of saving a round or compacting a chat. Unset, each check is one
dictionary lookup."""

from __future__ import annotations

import os
import signal

# In the order a round is saved.
POINTS = ("round-text", "round-committed", "segment-written", "segment-fsynced", "segment-renamed",
          "segment-durable", "segment-row-committed")
# In the order a chat is compacted (the rows go in one transaction, the files they named after it).
COMPACT_POINTS = ("compact-planned", "compact-rows-dropped", "compact-file-unlinked")


def crash_point(name: str) -> None:
    if os.environ.get("KVCHAT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
