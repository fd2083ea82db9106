"""The bench's allocator-trace reading (`KVCHAT_BENCH_MEMORY`, app/bench/resume_engine.blocks_at_peak): what a
developer is told a GPU peak is made of must be the blocks held at that moment, not those of another."""

from kvchat.app.bench.resume_engine import blocks_at_peak

MIB = 1 << 20


def _alloc(addr, size, name="x"):
    return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "/kvchat/a.py", "line": 1,
                                                                        "name": name}]}


def _free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_peak_s_blocks_are_those_held_when_most_was_allocated():
    events = [_alloc(1, 100 * MIB, "cache"), _alloc(2, 300 * MIB, "copy"), _free(2, 300 * MIB),
              _alloc(3, 200 * MIB, "later"), _alloc(4, 1 * MIB, "small"), _free(1, 100 * MIB)]
    most, held = blocks_at_peak(events, before=50 * MIB, large=64 * MIB)
    assert most == 450 * MIB
    assert [e["frames"][0]["name"] for e in held] == ["copy", "cache"]  # largest first; "later" came after


def test_frees_of_blocks_from_before_the_trace_are_not_counted_against_it():
    events = [_free(9, 500 * MIB), _alloc(1, 80 * MIB)]
    most, held = blocks_at_peak(events, before=10 * MIB, large=64 * MIB)
    assert most == 90 * MIB and len(held) == 1
