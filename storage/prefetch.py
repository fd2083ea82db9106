"""Reading many KV segment files ahead of their use, as fast as the disk allows.

Reads run in one thread pool, checks and decompression in another. Kept apart, the disk always has requests queued
(a thread that hashes and decompresses is not reading), and the CPU work of one file overlaps the reading of the
next. Results are taken in order; only a window of bytes ahead of the consumer is in flight, so memory stays
bounded however long the chat.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from kvchat.storage.codec import StorageError
from kvchat.storage.segments import SegmentHeader, decode_segment, read_segment_file

Finish = Callable[[SegmentHeader, bytes], object]  # decoded bytes -> what the consumer wants (runs in a worker)


class SegmentPrefetcher:
    READERS = 16  # requests in flight: a virtio/NVMe disk needs a deep queue to reach its bandwidth
    WINDOW_BYTES = 1 << 30

    def __init__(self, folder: Path, fingerprint: str, groups: list[list[str]], sizes: list[int],
                 finish: Finish | None = None, window_bytes: int | None = None, decode_threads: int | None = None):
        """`groups[i]`: the files of item i (e.g. one round's segments), `sizes[i]`: their decoded bytes;
        `window_bytes`: how far ahead of the consumer to read (default WINDOW_BYTES); `decode_threads`: how many
        segments are decoded at once (default `decode_threads()`, one per core)."""
        self.folder, self.fingerprint, self.finish = Path(folder), fingerprint, finish
        self.groups, self.sizes = groups, sizes
        self.window = self.WINDOW_BYTES if window_bytes is None else window_bytes
        self._readers = ThreadPoolExecutor(self.READERS, thread_name_prefix="kv-read", initializer=_yielding)
        self._decoders = ThreadPoolExecutor(decode_threads or self.decode_threads(), thread_name_prefix="kv-decode",
                                            initializer=_yielding)
        self._futures: list[Future] = []
        # Items the consumer needs now, each read and decoded on a thread of its own rather than behind the queue.
        self._urgent: dict[int, Future] = {}
        # Queued reads of items taken before they were done still run (their results dropped): each one's end, so
        # that `wait` waits for them too (an event, not the future: a dropped result, staged on a GPU, is freed)
        self._dropped: list[threading.Event] = []
        self._hurried = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kv-urgent")
        # While hurried items are in flight, or while the consumer says it is busy (pause), the background work
        # starts nothing new: the cores and the GIL go to what a message is waiting for.
        self._hurrying = 0
        self._paused = 0
        self._go = threading.Event()
        self._go.set()
        self._gate_lock = threading.Lock()
        self._closed = False
        self._in_flight = 0  # decoded bytes submitted and not yet taken
        self._taken = 0  # items before this one are taken (or skipped by the consumer)

    @staticmethod
    def decode_threads() -> int:
        """How many segments are verified and decompressed at once."""
        return os.cpu_count() or 1

    @staticmethod
    def decode_threads_beside_compute() -> int:
        """The same while another thread queues work for the device (a restore's recompute stream): a quarter of
        the cores, at most 4, are left to it. With a decoding thread on every core the host queued the recompute
        too slowly and the device idled: on the H100 (16 cores) 25-48% of the recompute stream's span at 8k and 32k,
        and 5-7% with 12 decoding threads (docs/benchmarks.md, docs/probes/restore_trace.py)."""
        n = os.cpu_count() or 1
        return max(1, n - min(4, n // 4))

    def get(self, i: int) -> list[tuple[SegmentHeader, object]] | str:
        """Item i's segments as (header, finished bytes), or why they cannot be used. Items are taken in order."""
        while len(self._futures) <= i:
            self._submit(len(self._futures))
        self._read_ahead()
        future = self._futures[i]
        if future is None:
            raise RuntimeError(f"item {i} was taken already")
        result = future.result()
        # The caller owns the item's memory now: kept here, a restore's staged K/V of every round would stay on the
        # device until the restore ended (at 32k on the 8B shape, 3 GiB past the plan: out of memory under 12 GiB).
        self._futures[i] = None
        while self._taken <= i:
            self._in_flight -= self.sizes[self._taken]
            self._taken += 1
        self._read_ahead()
        return result

    def _read_ahead(self) -> None:
        while len(self._futures) < len(self.groups) and self._in_flight < self.window:
            self._submit(len(self._futures))

    def start(self) -> None:
        """Begin reading ahead now, before anything is asked for."""
        self._read_ahead()

    def hurry(self, items: list[int]) -> None:
        """The consumer is about to take these items: read those not read yet now, side by side, each on a thread
        of its own (a message waiting for several rounds waits for the slowest, not for their sum)."""
        if self._closed:
            return
        for i in items:
            pending = self._futures[i] if i < len(self._futures) else None
            if i in self._urgent or (pending is not None and pending.done()) or not self.groups[i]:
                continue
            now: Future = Future()
            self._urgent[i] = now
            self._hold(hurrying=1)
            now.add_done_callback(lambda _done: self._hold(hurrying=-1))
            self._hurried.submit(self._read, self.groups[i], now, True)

    def pause(self) -> None:
        """Start no new background work until `resume` (the consumer is busy: a model answering); hurried items
        and `take` still read."""
        self._hold(paused=1)

    def resume(self) -> None:
        self._hold(paused=-1)

    def _hold(self, hurrying: int = 0, paused: int = 0) -> None:
        with self._gate_lock:
            self._hurrying += hurrying
            self._paused += paused
            if (self._hurrying or self._paused) and not self._closed:
                self._go.clear()
            else:
                self._go.set()

    def take(self, i: int) -> list[tuple[SegmentHeader, object]] | str:
        """Item i, in any order, and forget it here (its memory is the caller's): asked again, it is read again."""
        urgent = self._urgent.pop(i, None)
        if urgent is None and not self._closed:
            while len(self._futures) <= i:
                self._submit(len(self._futures))
        queued = None
        if i < len(self._futures):
            queued, self._futures[i] = self._futures[i], None
        if queued is not None and (urgent is not None or not queued.done()):  # its read goes on, unseen
            ended = threading.Event()
            queued.add_done_callback(lambda _read, ended=ended: ended.set())
            self._dropped = [e for e in self._dropped if not e.is_set()] + [ended]
        if urgent is not None:
            return urgent.result()
        if queued is not None and queued.done():
            return queued.result()
        # Not read yet (or forgotten): read it here and now rather than behind the queue of every other item.
        # A queued read of the same item still runs; its result is dropped.
        now: Future = Future()
        if self.groups[i]:
            self._read(self.groups[i], now, decode_here=True)
        else:
            now.set_result([])
        return now.result()

    def wait(self) -> None:
        """Until every item submitted so far is read (a benchmark's "the user typed for a while")."""
        for f in [*self._futures, *self._urgent.values()]:
            if f is not None:
                f.exception()
        for ended in self._dropped:
            ended.wait()

    def close(self) -> None:
        """Stop: queued work is dropped, running work finishes in the background; `take` still reads, here."""
        self._closed = True
        self._go.set()  # waiting workers finish rather than hold their threads
        for pool in (self._readers, self._decoders, self._hurried):
            pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, i: int) -> None:
        out: Future = Future()
        self._futures.append(out)
        self._in_flight += self.sizes[i]
        if not self.groups[i]:
            out.set_result([])
            return
        # Each file of the item is read and decoded on its own (a big model's round is several layer-group files:
        # side by side, one round costs its largest file, not their sum).
        parts = _Parts(len(self.groups[i]), out)
        for j, name in enumerate(self.groups[i]):
            self._readers.submit(self._when_free, self._read_part, name, j, parts)

    def _read_part(self, name: str, j: int, parts: "_Parts") -> None:
        try:
            data = read_segment_file(self.folder / name)
            self._decoders.submit(self._when_free, self._decode_part, name, data, j, parts)
        except StorageError as exc:
            parts.fail(str(exc))
        except BaseException as exc:  # noqa: BLE001 - the consumer waits on the item: it must always be resolved
            parts.fail(exc)

    def _decode_part(self, name: str, data, j: int, parts: "_Parts") -> None:
        try:
            header, raw = decode_segment(data, self.folder / name, fingerprint=self.fingerprint)
            parts.done(j, (header, self.finish(header, raw) if self.finish else raw))
        except StorageError as exc:
            parts.fail(str(exc))
        except BaseException as exc:  # noqa: BLE001
            parts.fail(exc)

    def _when_free(self, work, *args) -> None:
        """Background work waits here while hurried items are in flight or the consumer has paused it."""
        self._go.wait()
        work(*args)

    def _read(self, names: list[str], out: Future, decode_here: bool = False) -> None:
        try:
            data = [read_segment_file(self.folder / name) for name in names]
            if decode_here:
                self._decode(names, data, out)
            else:
                self._decoders.submit(self._when_free, self._decode, names, data, out)
        except StorageError as exc:
            out.set_result(str(exc))
        except BaseException as exc:  # noqa: BLE001 - the consumer waits on `out`: it must always be resolved
            out.set_exception(exc)

    def _decode(self, names: list[str], data: list, out: Future) -> None:
        try:
            decoded = []
            for name, blob in zip(names, data):
                header, raw = decode_segment(blob, self.folder / name, fingerprint=self.fingerprint)
                decoded.append((header, self.finish(header, raw) if self.finish else raw))
            out.set_result(decoded)
        except StorageError as exc:
            out.set_result(str(exc))
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)


# Background reads and decompression run below normal priority (Linux: per thread), so the threads that queue the
# device's work (the recompute stream, the placing of loaded rounds, decoding) never wait for a core behind them.
NICE = 5


def _yielding() -> None:
    try:
        if NICE:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


class _Parts:
    """The files of one item, finished in any order: the item's future gets them in order once all are done, or
    the first failure (a reason, or an exception) at once."""

    def __init__(self, n: int, out: Future):
        self._results: list = [None] * n
        self._left, self._out = n, out
        self._lock = threading.Lock()

    def done(self, j: int, result) -> None:
        with self._lock:
            self._results[j] = result
            self._left -= 1
            finished = self._left == 0 and not self._out.done()
        if finished:
            self._out.set_result(self._results)

    def fail(self, why: str | BaseException) -> None:
        with self._lock:
            if self._out.done():
                return
            if isinstance(why, BaseException):
                self._out.set_exception(why)
            else:
                self._out.set_result(why)
