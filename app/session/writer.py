"""The background writer: finished rounds' K/V go to segment files on a thread of their own.

Separate from the session because it outlives any one chat (the app shares one writer per model between its open
chats) and because benchmarks store chats through it without a session; nothing here knows about rounds beyond
the (chat, round, layers, tokens) a job names.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

import torch

from kvchat.errors import KvchatError
from kvchat.storage.codec import StorageError
from kvchat.storage.db import SEGMENT_KV, Store
from kvchat.storage.failpoints import crash_point
from kvchat.storage.segments import write_segment

log = logging.getLogger("kvchat.session")


class KVWriter:
    """Writes finished rounds' K/V in the background, so saving never stalls decoding or input."""

    def __init__(self, store: Store, fingerprint: str):
        self.store, self.fingerprint = store, fingerprint
        self.errors: list[str] = []
        self._stream = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self._thread.start()

    def submit(self, sid: str, round_idx: int, kv: torch.Tensor, layers: range, tokens: range,
               kind: str = SEGMENT_KV, live_from: int = 0, merged: str = "") -> None:
        """`kv` (or, by `kind`, the round's key bounds or a merged pair) must not change afterwards (a copy, as
        KVCache.read returns). `live_from`: its sliding-window layers hold zeros before this position
        (ChatSession.live_from); `merged`: the layer pairs it holds as zeros, stored merged ("4+5,6+7")."""
        ready = None
        if kv.is_cuda:  # the writer's stream must not read the copy before the main stream has made it
            ready = torch.cuda.Event()
            ready.record()
        self._jobs.put((sid, round_idx, kv, layers, tokens, kind, (live_from, merged), ready))

    def submit_job(self, job: Callable[[], object], what: str) -> None:
        """Run `job` on the writer's thread once every save submitted before it is done (compaction)."""
        self._jobs.put(("job", job, what))

    @property
    def busy(self) -> bool:
        """Whether submitted rounds are still on their way to disk."""
        return self._jobs.unfinished_tasks > 0

    def drain(self) -> None:
        """Wait until every submitted round is on disk (or has failed, with the reason in `errors`)."""
        self._jobs.join()

    def _run(self) -> None:
        try:  # Linux: a thread can lower its own priority, so compressing K/V yields the CPU to decoding
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._jobs.get()
            if item[0] == "job":
                self._run_job(*item[1:])
                continue
            sid, round_idx, kv, layers, tokens, kind, extra, ready = item
            try:
                if ready is None:
                    self._save(sid, round_idx, kv, layers, tokens, kind, *extra)
                else:
                    # Its own CUDA stream: copying K/V to the host overlaps decoding instead of queueing behind it.
                    stream = self._stream or torch.cuda.Stream(kv.device)
                    self._stream = stream
                    stream.wait_event(ready)
                    with torch.cuda.stream(stream):
                        self._save(sid, round_idx, kv, layers, tokens, kind, *extra)
            except Exception as exc:  # noqa: BLE001 - the writer must outlive any one failed save
                # The text is already committed; this round's K/V will be recomputed when the chat is reopened.
                reason = str(exc) if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
                self.errors.append(f"round {round_idx}: {reason}")
                log.warning("KV of round %d not saved: %s", round_idx, reason)
            finally:
                self._jobs.task_done()

    def _run_job(self, job: Callable[[], object], what: str) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a failed compaction costs disk space, never a chat
            reason = str(exc) if isinstance(exc, KvchatError) else f"{type(exc).__name__}: {exc}"
            self.errors.append(f"{what}: {reason}")
            log.warning("%s failed: %s", what, reason)
        finally:
            self._jobs.task_done()

    def _save(self, sid: str, round_idx: int, kv: torch.Tensor, layers: range, tokens: range, kind: str,
              live_from: int = 0, merged: str = "") -> None:
        ref = write_segment(self.store.kv_dir, kv, fingerprint=self.fingerprint, layers=layers, tokens=tokens,
                            kind=kind)
        crash_point("segment-durable")
        self.store.add_segment(sid, kind=kind, round_idx=round_idx, layer_start=layers.start, layer_end=layers.stop,
                               token_start=tokens.start, token_end=tokens.stop, codec=ref.codec,
                               dtype=str(kv.dtype).removeprefix("torch."), byte_size=ref.byte_size,
                               raw_size=ref.raw_size, checksum=ref.checksum, file=ref.file,
                               model_fingerprint=self.fingerprint, live_from=live_from, merged=merged)
        crash_point("segment-row-committed")
