"""The lazy resume's frame checksums in one kernel (kernels/frame_checksums.py, issue 44) against its torch
definition and the file format's (storage.unit_frames.frame_sums): the same int64 sums, wrapping modulo 2^64.

As for the other kernels: the `test_interpreted_*` tests run in a child pytest with TRITON_INTERPRET=1
(`test_the_kernel_in_triton_s_interpreter`), the GPU tests (`gpu` marker) on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels import frame_checksums as module
from kvchat.kernels.frame_checksums import frame_checksums, frame_checksums_ref
from kvchat.storage.unit_frames import frame_rows, frame_sums

interpreted = pytest.mark.skipif(not module.INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (frames' member counts, words a row, values): a frame holds 2 rows a member (its K rows, then its V rows).
# "random": any 16-bit words; "extreme": every word of a frame 32767, of the next -32768, and so on, in frames long
# enough (1,000 members of 64 words) that the squared sum passes 2^63 and wraps (test_the_extreme_case_wraps);
# members 0: a frame of no rows (sums 0).
CASES = [
    ([3, 1, 0, 7, 16], 64, "random"),
    ([1], 8, "random"),
    ([16, 16, 15, 17, 2, 0, 0, 9], 128, "random"),
    ([1000, 3], 64, "extreme"),
]


def case_id(case) -> str:
    counts, width, kind = case
    return f"F{len(counts)}-W{width}-{kind}"


def inputs(case, device="cpu", seed=0):
    counts, width, kind = case
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.int64)
    n_rows = int(2 * counts.sum())
    if kind == "random":
        words = torch.randint(-(1 << 15), 1 << 15, (n_rows, width), generator=gen, dtype=torch.int64)
    else:
        frame_of_row = torch.repeat_interleave(torch.arange(len(counts)), 2 * counts)
        words = torch.where(frame_of_row % 2 == 0, (1 << 15) - 1, -(1 << 15))[:, None].expand(n_rows, width)
    words = words.to(torch.int16)
    rows = 2 * counts
    first = torch.cumsum(rows, 0) - rows
    return words.to(device), first.to(device), rows.to(device), counts


def format_sums(words: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The file format's definition (storage.unit_frames.frame_sums), on the host."""
    words = words.cpu()
    _, frame, place = frame_rows(counts)
    return frame_sums(words.view(torch.uint8).view(words.shape[0], -1), frame, place, len(counts))


def test_the_extreme_case_wraps():
    """Its first frame's sum of (i + 1)^2 * w_i, exact, is past 2^63: the kernel's int64 must wrap as the format's."""
    counts, width, _ = CASES[3]
    n = 2 * counts[0] * width
    exact = (1 << 15) - 1
    assert exact * sum((i + 1) ** 2 for i in range(n)) > 1 << 63


def test_the_reference_is_the_file_format_s_definition():
    for case in CASES:
        words, first, rows, counts = inputs(case)
        assert torch.equal(frame_checksums_ref(words, first, rows), format_sums(words, counts)), case_id(case)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_interpreted_checksums_match_the_reference(case):
    words, first, rows, counts = inputs(case)
    got = frame_checksums(words, first, rows)
    assert got.dtype == torch.int64 and torch.equal(got, frame_checksums_ref(words, first, rows))


@interpreted
def test_interpreted_checksums_of_frames_taken_out_of_order_and_of_none():
    words, first, rows, _ = inputs(CASES[2])
    order = torch.tensor([5, 0, 7, 2])  # some frames, in another order (a buffer's frames need not be all of them)
    assert torch.equal(frame_checksums(words, first[order], rows[order]),
                       frame_checksums_ref(words, first[order], rows[order]))
    assert frame_checksums(words, first[:0], rows[:0]).shape == (0, 2)


def test_the_kernel_in_triton_s_interpreter():
    if module.INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(CASES) + 1


def test_bad_arguments_are_refused():
    words, first, rows, _ = inputs(CASES[0])
    with pytest.raises(ValueError):
        frame_checksums(words.float(), first, rows)
    with pytest.raises(ValueError):
        frame_checksums(words, first, rows[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_checksums_match_the_file_format(case):
    words, first, rows, counts = inputs(case, "cuda")
    assert torch.equal(frame_checksums(words, first, rows).cpu(), format_sums(words, counts))
