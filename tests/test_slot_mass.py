"""The per-slot attention mass kernel (LoopServe's progressive choice) against its torch definition `slot_mass_ref`.

As for the round-mass kernel: the `test_interpreted_*` tests run in a child pytest with TRITON_INTERPRET=1
(`test_the_kernel_in_triton_s_interpreter`), the GPU tests (`gpu` marker) on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels import round_scores, slot_mass as slot_mass_module
from kvchat.kernels.slot_mass import slot_mass, slot_mass_ref, triton_kernel_runs_on

interpreted = pytest.mark.skipif(not round_scores.INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (G layers, T tokens, S keys, N input slots, H, Hkv, D, dtype, with a visibility mask). Under the interpreter the
# tiles are 32 rows x 64 keys and the keys are split every 256: T * n_rep = 64 and 49 cross row tiles, S = 300
# crosses key blocks and a split; N < S - T leaves reply slots between the input and the window.
INTERPRETER_CASES = [
    (1, 1, 2, 1, 4, 4, 64, torch.float32, False),
    (2, 4, 300, 296, 8, 2, 128, torch.float32, True),
    (3, 16, 300, 284, 8, 2, 64, torch.float32, False),
    (2, 7, 300, 293, 14, 2, 80, torch.float32, True),  # a head size that is not a power of two
    (1, 16, 300, 100, 4, 4, 128, torch.float16, True),
    (2, 5, 300, 260, 8, 2, 64, torch.bfloat16, False),
    (1, 3, 3, 0, 4, 2, 64, torch.float32, False),  # no input: nothing to weigh
]

GPU_CASES = [(g, t, s, s - t - r, h, hkv, d, dtype, vis)
             for dtype in (torch.float32, torch.float16, torch.bfloat16)
             for g, h, hkv, d in ((1, 4, 4, 64), (4, 14, 2, 64), (32, 32, 8, 128), (2, 8, 1, 256))
             for t, s, r, vis in ((1, 33, 0, False), (16, 4097, 100, True), (16, 32768, 40, False))]


def case_id(case) -> str:
    g, t, s, n, h, hkv, d, dtype, vis = case
    return f"G{g}-T{t}-S{s}-N{n}-H{h}kv{hkv}-D{d}-{str(dtype).removeprefix('torch.')}{'-visible' if vis else ''}"


def random_inputs(case, device, seed=0):
    """Queries 3x larger than keys (peaked attention, where a wrong sum shows), and a mask hiding ~1/3 of the input
    and a whole run of it (a tile of hidden keys must not poison a row's statistics)."""
    g, t, s, n, h, hkv, d, dtype, vis = case
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(g, t, h, d, generator=gen)).to(device=device, dtype=dtype)
    k = torch.randn(g, hkv, s, d, generator=gen).to(device=device, dtype=dtype)
    visible = None
    if vis:
        visible = torch.rand(g, n, generator=gen) > 0.33
        visible[:, n // 4 : n // 4 + 130] = False
        visible = visible.to(device)
    return q, k, n, visible


def tolerances(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-5)


def fail_if_called(*args, **kwargs):
    raise AssertionError("slot_mass fell back to slot_mass_ref")


def check_against_reference(case, device, monkeypatch):
    q, k, n, visible = random_inputs(case, device)
    expected = slot_mass_ref(q, k, n, visible)
    monkeypatch.setattr(slot_mass_module, "slot_mass_ref", fail_if_called)
    got = slot_mass(q, k, n, visible)
    assert got.dtype == torch.float32 and got.shape == (q.shape[0], k.shape[1], n) and got.device == q.device
    torch.testing.assert_close(got, expected, **tolerances(q.dtype))
    if visible is not None:
        assert (got.masked_select(~visible[:, None]) == 0).all()


# --- on the CPU in triton's interpreter (run through test_the_kernel_in_triton_s_interpreter) ---

@interpreted
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_interpreted_kernel_matches_reference(case, monkeypatch):
    check_against_reference(case, "cpu", monkeypatch)


@interpreted
def test_interpreted_views_of_a_kv_cache():
    # The engine hands K of adjacent layers as a view of the cache [L, 2, Hkv, capacity, D] and the queries as an
    # index of its ring of the last tokens' queries.
    cache = torch.randn(4, 2, 2, 400, 64)
    k = cache[1:3, 0, :, :300]
    q = (3 * torch.randn(8, 2, 6, 64)).transpose(0, 1)  # [2, 8, 6, 64], not contiguous
    assert not q.is_contiguous() and not k.is_contiguous()
    got = slot_mass(q, k, 280, scale=0.3)
    torch.testing.assert_close(got, slot_mass_ref(q, k, 280, scale=0.3), rtol=1e-4, atol=1e-6)


def test_the_kernel_in_triton_s_interpreter():
    if round_scores.INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(INTERPRETER_CASES) + 1


# --- in this process: the reference, dispatch and input checks ---

def test_the_reference_is_the_softmax_mass_of_each_input_slot():
    """slot_mass_ref against a loop over layers, KV heads, query heads and tokens."""
    case = (2, 3, 20, 12, 4, 2, 8, torch.float32, True)
    q, k, n, visible = random_inputs(case, "cpu")
    want = torch.zeros(2, 2, n)
    for layer in range(2):
        for head in range(4):
            for t in range(3):
                slot = 20 - 3 + t
                seen = torch.arange(20) <= slot
                seen[:n] &= visible[layer]
                logits = (k[layer, head // 2] @ q[layer, t, head]) / 8 ** 0.5
                probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), 0)
                want[layer, head // 2] += probs[:n]
    torch.testing.assert_close(slot_mass_ref(q, k, n, visible), want)


def test_cpu_without_the_interpreter_falls_back_to_the_reference(monkeypatch):
    if round_scores.INTERPRET:
        pytest.skip("the interpreter runs the kernel on the CPU")
    assert not triton_kernel_runs_on("cpu")
    monkeypatch.setattr(slot_mass_module, "_slot_mass_triton", fail_if_called)
    q, k, n, visible = random_inputs(INTERPRETER_CASES[1], "cpu")
    assert torch.equal(slot_mass(q, k, n, visible), slot_mass_ref(q, k, n, visible))


BAD_INPUTS = [
    (dict(q=torch.zeros(2, 4, 16)), "q must be a \\[G, T, H, D\\] tensor"),
    (dict(k=torch.zeros(2, 10, 16)), "k must be a \\[G, Hkv, S, D\\] tensor"),
    (dict(q=torch.zeros(1, 2, 4, 16, dtype=torch.float64)), "share one float dtype"),
    (dict(k=torch.zeros(2, 2, 10, 16)), "does not fit q"),
    (dict(k=torch.zeros(1, 3, 10, 16)), "a multiple of k's KV heads"),
    (dict(n_input=9), "must come before the 2 tokens' own"),
    (dict(visible=torch.ones(1, 7)), "visible must be a bool \\[1, 8\\] tensor"),
    (dict(scale=float("nan")), "scale must be a finite positive number"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_raise_one_line_value_errors(change, message):
    args = {**dict(q=torch.zeros(1, 2, 4, 16), k=torch.zeros(1, 2, 10, 16), n_input=8), **change}
    with pytest.raises(ValueError, match=message) as error:
        slot_mass(**args)
    assert "\n" not in str(error.value)


# --- on the GPU ---

@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_kernel_matches_reference(case, monkeypatch):
    check_against_reference(case, "cuda", monkeypatch)


@pytest.mark.gpu
def test_gpu_views_of_a_kv_cache():
    cache = torch.randn(6, 2, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    k = cache[1:5, 0, :, :4097]
    q = (3 * torch.randn(16, 4, 32, 128, device="cuda")).to(torch.bfloat16).transpose(0, 1)
    got = slot_mass(q, k, 4000)
    torch.testing.assert_close(got, slot_mass_ref(q, k, 4000), **tolerances(torch.bfloat16))
