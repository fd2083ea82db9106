"""The host-to-GPU staging ring (storage.staging) on the CPU: its chunking, its reuse of a few host buffers by many
threads and the restore's use of what it stages, with a stand-in for the CUDA side (LateCopies) whose copies run as
late as a GPU may run them: only when an event is waited on. A ring that refilled a buffer before the copy reading
it had run, or a restore that used a tensor before waiting for it, gets wrong bytes here. The CPU counterparts of
test_prefetch.py::test_staging_ring_copies_bit_exact and test_persistence.py's staging-ring restore
(docs/testing.md); pinned memory and CUDA streams themselves are checked on the GPU only."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kvchat.storage.staging import HostToDevice


class LateCopies:
    """HostToDevice's device side on the CPU. Copies are queued, in order, on one "stream" and run only when an
    event covering them is waited on (a copy's own event, or the ready() of a Staged): it reads its source buffer
    then, as a DMA would."""

    events_wait = True  # False: events that do not wait (a ring that skipped its waits)

    def __init__(self, device: torch.device):
        self.device = device
        self.queued: list[tuple[torch.Tensor, np.ndarray]] = []
        self.done = 0  # copies run so far
        self.lock = threading.Lock()

    @staticmethod
    def serves(device: torch.device) -> bool:
        return device.type == "cpu"

    def host_buffer(self, size: int) -> np.ndarray:
        return np.empty(size, dtype=np.uint8)

    def output(self, size: int) -> torch.Tensor:
        return torch.full((size,), 0xEE, dtype=torch.uint8)  # not what any copy writes

    def _run_to(self, n: int) -> None:
        with self.lock:
            while self.done < n:
                dst, src = self.queued[self.done]
                dst.copy_(torch.from_numpy(src))
                self.done += 1

    def copy(self, dst: torch.Tensor, src: np.ndarray):
        with self.lock:
            self.queued.append((dst, src))
            n = len(self.queued)
        copies = self

        class Event:
            def synchronize(self):
                if copies.events_wait:
                    copies._run_to(n)

        return Event()

    def ready(self):
        with self.lock:
            n = len(self.queued)
        return lambda: self._run_to(n)


@pytest.fixture
def late_copies(monkeypatch):
    monkeypatch.setattr(HostToDevice, "copies", LateCopies)
    monkeypatch.setattr(HostToDevice, "_shared", {})
    return LateCopies


def copy_from_threads(ring: HostToDevice, data: list[bytes]) -> list[bytes]:
    """Each of `data` staged from its own thread (they share the ring's buffers), then waited for."""
    staged = [None] * len(data)

    def copy(i):
        staged[i] = ring.copy(data[i])

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(len(data))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return [bytes(s.wait().numpy()) for s in staged]


# 3 buffers of 4 KiB: the larger sizes wrap the ring many times.
@pytest.mark.parametrize("size", [0, 1, 4096, 4096 * 5 + 3, 50_000])
def test_staging_ring_copies_bit_exact(late_copies, size):
    ring = HostToDevice("cpu", chunk=4096, slots=3)
    gen = torch.Generator().manual_seed(size)
    data = [bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy()) for _ in range(5)]
    assert copy_from_threads(ring, data) == data


def test_a_ring_that_does_not_wait_for_its_copies_is_caught(late_copies, monkeypatch):
    """The check above can fail: with events that do not wait, buffers are refilled before their copies ran."""
    monkeypatch.setattr(LateCopies, "events_wait", False)
    ring = HostToDevice("cpu", chunk=4096, slots=3)
    data = [bytes(np.random.default_rng(i).integers(0, 256, 50_000, dtype=np.uint8)) for i in range(2)]
    assert copy_from_threads(ring, data) != data


def test_without_the_stand_in_the_ring_takes_only_a_gpu():
    assert not HostToDevice.serves("cpu")
    with pytest.raises(ValueError, match="HostToDevice copies to a CUDA device, not cpu"):
        HostToDevice("cpu")


def test_restore_is_bit_exact_through_the_staging_ring(late_copies, monkeypatch, kvchat_home):
    """test_persistence.py::test_restore_on_cuda_is_bit_exact_through_the_staging_ring on the CPU: every segment
    goes through the ring in chunks of 4 KiB (it wraps many times per segment) and the restore waits for each
    before merging its planes; the restored chat answers as one that never stopped."""
    from kvchat.app.session.chat import ChatSession
    from kvchat.engine.engine import Engine
    from kvchat.storage.db import Store
    from test_persistence import DEFAULT_MODEL, MESSAGES, new_session, saved_chat

    monkeypatch.setattr(HostToDevice, "CHUNK", 4096)
    engine = Engine(DEFAULT_MODEL, device="cpu")
    store, chat = saved_chat(engine)
    reopened = ChatSession(store, engine, chat.sid)
    stats = reopened.restore()
    n = chat.cache.length
    ring = HostToDevice._shared[torch.device("cpu")]
    assert ring._copies.done > 50  # it went through the ring
    assert stats.tokens_recomputed == 0 and stats.tokens_loaded == n
    assert torch.equal(reopened.cache.kv[:, :, :, :n], chat.cache.kv[:, :, :, :n])
    other = Store(kvchat_home / "other")
    never_stopped = ChatSession(other, engine, new_session(other))
    expected = [never_stopped.send(m).text for m in MESSAGES[:4]][-1]
    assert reopened.send(MESSAGES[3]).text == expected
