"""LouisKV's fused slot choice (kernels/unit_choice.py, issue 44) against its torch definition
`slots_of_best_units_ref`: the very same lists, ties included.

As for the other kernels: the `test_interpreted_*` tests run in a child pytest with TRITON_INTERPRET=1
(`test_the_kernel_in_triton_s_interpreter`), the GPU tests (`gpu` marker) on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.engine.kv import units as units_module
from kvchat.kernels import unit_choice as unit_choice_module
from kvchat.kernels.unit_choice import slots_of_best_units, slots_of_best_units_ref

interpreted = pytest.mark.skipif(not unit_choice_module.INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (G, Hkv, U units, N listed slots, n chosen, pool, scores). Under the interpreter a program walks its row in blocks
# of 256 slots: N = 300 and 700 end inside a block, so the running counts and the pooling window cross blocks.
# The scores: "softmax" (random, distinct); "ties" (softmax with every third unit's score repeated and every fifth
# 0); "equal" (every unit the same score: the first n positions); "zero" (all 0, the key 0 as the threshold);
# "signed" (negatives and -0.0, which rank as 0); "ulps" (neighbouring floats, differing in the lowest digit of the
# key alone); "wide" (scores from 1e-40, subnormal, to 1e30: every digit of the key in use).
INTERPRETER_CASES = [
    (1, 1, 3, 8, 4, 1, "softmax"),
    (2, 3, 40, 700, 50, 7, "ties"),
    (1, 2, 10, 300, 300, 3, "ties"),  # n == N: every slot
    (1, 2, 10, 300, 299, 1, "ties"),  # all but one
    (1, 2, 10, 300, 1, 3, "ties"),
    (1, 2, 16, 520, 100, 3, "equal"),
    (1, 1, 16, 300, 77, 7, "zero"),
    (2, 1, 30, 300, 64, 3, "signed"),
    (2, 1, 30, 300, 280, 1, "signed"),  # more than the positive slots: the threshold is 0, negatives tie at it
    (1, 2, 200, 300, 150, 1, "ulps"),
    (1, 2, 300, 300, 40, 7, "wide"),
    (1, 1, 4, 1, 1, 7, "softmax"),  # one slot, a window wider than the row
    (1, 1, 5, 20, 50, 3, "softmax"),  # n > N: all N
]

GPU_CASES = [(32, 8, 2000, 32500, n, 7, scores) for n in (1024, 2048) for scores in ("softmax", "ties")] + [
    (32, 8, 2000, 32500, 1024, 1, "softmax"), (4, 8, 2000, 32500, 2048, 3, "equal"),
    (4, 8, 3000, 32500, 1024, 7, "wide")]


def case_id(case) -> str:
    g, h, u, n_listed, n, pool, kind = case
    return f"G{g}-Hkv{h}-U{u}-N{n_listed}-n{n}-pool{pool}-{kind}"


def random_choice_inputs(case, device="cpu", seed=0):
    """(scores [G, Hkv, U] float32, member [G, Hkv, N] int64 in runs as a unit's slots lie (mostly together),
    slots [N] int64 ascending with a gap, as joined spans)."""
    g, h, u, n_listed, n, pool, kind = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(g, h, u, generator=gen)
    if kind == "softmax":
        scores = torch.softmax(logits, -1)
    elif kind == "ties":
        scores = torch.softmax(logits, -1)
        scores[..., ::3] = scores[..., 1:2]
        scores[..., ::5] = 0.0
    elif kind == "equal":
        scores = torch.full((g, h, u), 1.0 / u)
    elif kind == "zero":
        scores = torch.zeros(g, h, u)
    elif kind == "signed":
        scores = logits
        scores[..., ::4] = -0.0
    elif kind == "ulps":
        base = torch.full((g, h, u), 0.3)
        scores = base.clone()
        for i in range(1, u):  # scores[..., i] is i floats above 0.3, in a shuffled order below
            scores[..., i] = torch.nextafter(scores[..., i - 1], torch.tensor(1.0))
        scores = scores[..., torch.randperm(u, generator=gen)]
    elif kind == "wide":
        scores = torch.rand(g, h, u, generator=gen) * torch.pow(10.0, torch.randint(-40, 31, (g, h, u), generator=gen))
    else:
        raise ValueError(kind)
    # runs of 1..20 slots of one unit, units in a random order (as k-means clusters and a reply's segments mix)
    run_units = torch.randint(0, u, (g, h, n_listed), generator=gen)
    run_lengths = torch.randint(1, 21, (n_listed,), generator=gen)
    run_of_slot = torch.repeat_interleave(torch.arange(n_listed), run_lengths)[:n_listed]
    member = run_units[:, :, run_of_slot]
    slots = torch.arange(n_listed) + 4
    slots[n_listed // 2 :] += 1000  # a second span further on
    return scores.float().to(device), member.to(device), slots.to(device), n, pool


def assert_same_lists(scores, member, slots, n, pool):
    got = slots_of_best_units(scores, member, slots, n, pool)
    want = slots_of_best_units_ref(scores, member, slots, n, pool)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want), f"{(got != want).sum()} of {want.numel()} entries differ"


# --- the kernel, in triton's interpreter (a child process) or on CUDA ---

@interpreted
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_interpreted_choice_matches_the_reference(case):
    assert_same_lists(*random_choice_inputs(case))


@interpreted
def test_interpreted_choice_takes_int32_and_strided_inputs():
    scores, member, slots, n, pool = random_choice_inputs((2, 3, 40, 300, 50, 3, "ties"), seed=1)
    wide_scores = torch.zeros(2, 3, 2 * 40)
    wide_scores[..., ::2] = scores  # a view with a last stride of 2
    assert_same_lists(wide_scores[..., ::2], member.transpose(0, 1).contiguous().transpose(0, 1).int(),
                      slots.int(), n, pool)


@interpreted
def test_interpreted_choice_of_the_engine_is_the_kernel_s():
    # engine.kv.units' function is the kernel's dispatch: with the interpreter on, the kernel itself
    scores = torch.tensor([[[0.2, 0.5, 0.3]]])
    member = torch.tensor([[[0, 0, 1, 1, 1, 2, 2, 0]]])
    slots = torch.arange(100, 108)
    assert units_module.slots_of_best_units(scores, member, slots, 4).tolist() == [[[102, 103, 104, 105]]]
    assert units_module.slots_of_best_units(scores, member, slots, 5, pool=3).tolist() == [[[101, 102, 103, 104,
                                                                                              105]]]


def test_the_kernel_in_triton_s_interpreter():
    if unit_choice_module.INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(INTERPRETER_CASES) + 2


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_choice_matches_the_reference(case):
    assert_same_lists(*random_choice_inputs(case, "cuda"))


@pytest.mark.gpu
def test_gpu_choice_replays_in_a_cuda_graph():
    """The launch is capturable (no host sync, fixed shapes): a replay after new scores gives their lists."""
    scores, member, slots, n, pool = random_choice_inputs((4, 8, 2000, 32500, 1024, 7, "ties"), "cuda")
    slots_of_best_units(scores, member, slots, n, pool)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lists = slots_of_best_units(scores, member, slots, n, pool)
    scores.copy_(random_choice_inputs((4, 8, 2000, 32500, 1024, 7, "softmax"), "cuda", seed=5)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lists, slots_of_best_units_ref(scores, member, slots, n, pool))


# --- in this process: the reference, the dispatch and the input checks ---

def test_the_reference_is_a_stable_ranking_by_pooled_score():
    """The definition, spelled out: slots by pooled (clamped) score, descending, ties to the lower position (a
    stable sort); the first n, ascending."""
    for case in [(2, 3, 40, 700, 50, 7, "ties"), (1, 2, 16, 520, 100, 3, "equal"), (2, 1, 30, 300, 64, 1, "signed")]:
        scores, member, slots, n, pool = random_choice_inputs(case)
        per_slot = scores.gather(2, member)
        padded = torch.nn.functional.pad(per_slot, (pool // 2, pool // 2), value=float("-inf"))
        pooled = padded.unfold(2, pool, 1).amax(-1).clamp_min(0)  # [G, Hkv, N]
        order = torch.sort(pooled, dim=2, descending=True, stable=True).indices[:, :, :n]
        assert torch.equal(slots_of_best_units_ref(scores, member, slots, n, pool),
                           slots[order].sort(dim=2).values.int())


def test_without_the_interpreter_cpu_tensors_take_the_reference(monkeypatch):
    if unit_choice_module.INTERPRET:
        pytest.skip("in the interpreter the kernel runs on the CPU")
    monkeypatch.setattr(unit_choice_module, "_slots_of_best_units_triton", None)  # would fail if called
    scores, member, slots, n, pool = random_choice_inputs((2, 3, 40, 700, 50, 7, "ties"))
    assert torch.equal(units_module.slots_of_best_units(scores, member, slots, n, pool),
                       slots_of_best_units_ref(scores, member, slots, n, pool))


@pytest.mark.parametrize("change", ["scores 2-d", "member float", "member shape", "slots length", "n < 0",
                                    "pool even", "pool 0"])
def test_bad_inputs_are_refused(change):
    scores, member, slots = torch.rand(1, 2, 5), torch.zeros(1, 2, 9, dtype=torch.long), torch.arange(9)
    n, pool = 3, 3
    if change == "scores 2-d":
        scores = scores[0]
    elif change == "member float":
        member = member.float()
    elif change == "member shape":
        member = member[:, :1]
    elif change == "slots length":
        slots = slots[:8]
    elif change == "n < 0":
        n = -1
    elif change == "pool even":
        pool = 2
    else:
        pool = 0
    with pytest.raises(ValueError):
        slots_of_best_units(scores, member, slots, n, pool)
