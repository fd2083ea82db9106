"""The per-round attention mass kernel against its torch definition `round_mass_ref`.

The Triton kernel runs on the CPU only in triton's interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is imported. The tests named `test_interpreted_*` therefore skip themselves in the ordinary run, and
`test_the_kernel_in_triton_s_interpreter` runs exactly them in a child pytest with the variable set. The GPU tests
(`gpu` marker, skipped without CUDA) cover a much larger grid, up to T = 512 queries over S = 32768 keys.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels import round_scores
from kvchat.kernels.round_scores import round_mass, round_mass_ref, triton_kernel_runs_on

interpreted = pytest.mark.skipif(not round_scores.INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (T, S, R, H, Hkv, D, dtype). Under the interpreter the tiles are 32 rows x 64 keys and the keys are split every
# 256: T = 7 with 14 heads (49 rows) and T = 64 cross row tiles, S = 300 crosses key blocks and a split.
INTERPRETER_CASES = [
    (1, 1, 1, 4, 4, 64, torch.float32),
    (7, 33, 3, 8, 2, 128, torch.float32),
    (64, 300, 8, 14, 2, 64, torch.float32),
    (7, 300, 3, 8, 2, 80, torch.float32),  # a head size that is not a power of two (Phi's 80), padded and masked
    (64, 300, 8, 4, 4, 128, torch.float16),
    (1, 300, 5, 8, 2, 64, torch.float16),
    (7, 300, 8, 14, 2, 128, torch.bfloat16),
    (7, 33, 33, 4, 4, 64, torch.bfloat16),  # every round a single key
    (1, 33, 3, 14, 2, 128, torch.bfloat16),
]

# The GPU grid: every head layout and dtype over short and long histories; D follows the model family (64 for the
# 4/4 and 14/2 layouts like Qwen2.5 0.5B, 128 for 8/2 and 32/8 like Llama), plus D = 256 and a padded D = 80.
GPU_TOKENS_KEYS = [(1, 1), (1, 33), (7, 300), (64, 300), (64, 4097), (1, 32768), (512, 32768)]
GPU_HEADS = [(4, 4, 64), (8, 2, 128), (14, 2, 64), (32, 8, 128)]
GPU_CASES = [(t, s, min(s, 64), h, hkv, d, dtype)
             for dtype in (torch.float32, torch.float16, torch.bfloat16)
             for h, hkv, d in GPU_HEADS for t, s in GPU_TOKENS_KEYS]
GPU_CASES += [(t, s, 17, 8, 2, d, dtype) for d in (80, 256) for dtype in (torch.float32, torch.bfloat16)
              for t, s in ((7, 300), (64, 4097))]


def case_id(case) -> str:
    t, s, r, h, hkv, d, dtype = case
    return f"T{t}-S{s}-R{r}-H{h}kv{hkv}-D{d}-{str(dtype).removeprefix('torch.')}"


def round_starts(n_keys: int, n_rounds: int, seed: int = 0) -> torch.Tensor:
    """n_rounds ascending starts from 0 over n_keys keys, with the first and last rounds a single key wherever
    there are three rounds or more; the others at random places (so some short, some long)."""
    assert 1 <= n_rounds <= n_keys
    inner = torch.randperm(n_keys - 1, generator=torch.Generator().manual_seed(seed))[: n_rounds - 1] + 1
    if n_rounds >= 3:
        inner = torch.cat([torch.tensor([1, n_keys - 1]), inner[~torch.isin(inner, torch.tensor([1, n_keys - 1]))]])
        inner = inner[: n_rounds - 1]
    return torch.cat([torch.tensor([0]), inner.sort().values])


def random_inputs(n_tokens, n_keys, n_heads, n_kv_heads, head_dim, dtype, device, seed=0):
    """Queries 3x larger than keys, so that attention is peaked (logits of standard deviation ~3) rather than
    nearly uniform, where any summation would look right."""
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(n_tokens, n_heads, head_dim, generator=gen)).to(device=device, dtype=dtype)
    k = torch.randn(n_kv_heads, n_keys, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k


def tolerances(dtype: torch.dtype) -> dict:
    # Both sides see the same rounded inputs and accumulate in float32 (products of 16-bit floats are exact in
    # float32), so only summation order and exp2 vs exp differ; half-precision dots on tensor cores get more room.
    return dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-5)


def check_against_reference(case, device, monkeypatch):
    n_tokens, n_keys, n_rounds, n_heads, n_kv_heads, head_dim, dtype = case
    q, k = random_inputs(n_tokens, n_keys, n_heads, n_kv_heads, head_dim, dtype, device)
    starts = round_starts(n_keys, n_rounds).to(device)
    expected = round_mass_ref(q, k, starts)
    # Make the fallback fail loudly: comparing the reference with itself could not fail.
    monkeypatch.setattr(round_scores, "round_mass_ref", fail_if_called)
    got = round_mass(q, k, starts)
    assert got.dtype == torch.float32 and got.shape == (n_rounds,) and got.device == q.device
    torch.testing.assert_close(got, expected, **tolerances(dtype))
    assert abs(got.sum().item() - 1.0) < 1e-5


def fail_if_called(*args, **kwargs):
    raise AssertionError("round_mass fell back to round_mass_ref")


def dominant_round_inputs(device, dtype):
    """Keys of two rounds that straddle key block boundaries (64 and 128) and the interpreter's split at 256 are
    made to match the queries: those rounds must take nearly all of the mass, and exactly the reference's."""
    q, k = random_inputs(5, 300, 8, 2, 64, torch.float32, "cpu", seed=1)
    k[:, 40:140] += 2.0 * q.mean(dim=0).view(2, 4, 64).mean(dim=1, keepdim=True)
    k[:, 240:270] += 2.0 * q.mean(dim=0).view(2, 4, 64).mean(dim=1, keepdim=True)
    starts = torch.tensor([0, 40, 140, 240, 270])
    return q.to(device, dtype), k.to(device, dtype), starts.to(device)


# --- on the CPU in triton's interpreter (run through test_the_kernel_in_triton_s_interpreter) ---

@interpreted
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_interpreted_kernel_matches_reference(case, monkeypatch):
    check_against_reference(case, "cpu", monkeypatch)


@interpreted
def test_interpreted_rounds_across_block_boundaries_take_their_mass():
    q, k, starts = dominant_round_inputs("cpu", torch.float32)
    got = round_mass(q, k, starts)
    torch.testing.assert_close(got, round_mass_ref(q, k, starts), rtol=1e-4, atol=1e-6)
    assert got[1] + got[3] > 0.9
    # Logits in the hundreds, whose maxima differ between key splits by far more than float32's exponent range:
    # merging the splits' statistics must rescale to the overall maximum rather than to any one split's.
    torch.testing.assert_close(round_mass(q, k, starts, scale=10.0), round_mass_ref(q, k, starts, scale=10.0),
                               rtol=1e-4, atol=1e-6)


@interpreted
def test_interpreted_views_of_a_kv_cache_and_a_custom_scale():
    # The engine's cache is [L, 2, Hkv, capacity, D]; K of one layer is a strided view, and q may be permuted.
    cache = torch.randn(3, 2, 2, 400, 64)
    k = cache[1, 0, :, :300]
    q = (3 * torch.randn(8, 5, 64)).transpose(0, 1)  # [5, 8, 64], not contiguous
    starts = torch.tensor([0, 1, 100, 299])
    assert not q.is_contiguous() and not k.is_contiguous()
    got = round_mass(q, k, starts, scale=0.3)
    torch.testing.assert_close(got, round_mass_ref(q, k, starts, scale=0.3), rtol=1e-4, atol=1e-6)


def test_the_kernel_in_triton_s_interpreter():
    if round_scores.INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(INTERPRETER_CASES) + 2


# --- in this process: dispatch and input checks ---

def test_cpu_without_the_interpreter_falls_back_to_the_reference(monkeypatch):
    if round_scores.INTERPRET:
        pytest.skip("the interpreter runs the kernel on the CPU")
    assert not triton_kernel_runs_on("cpu")

    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton path ran on the CPU without the interpreter")

    monkeypatch.setattr(round_scores, "_round_mass_triton", no_kernel)
    q, k = random_inputs(7, 33, 8, 2, 64, torch.bfloat16, "cpu")
    starts = round_starts(33, 3)
    assert torch.equal(round_mass(q, k, starts), round_mass_ref(q, k, starts))


def good_inputs():
    q, k = random_inputs(2, 10, 4, 2, 16, torch.float32, "cpu")
    return dict(q=q, k=k, round_starts=torch.tensor([0, 4]))


BAD_INPUTS = [
    (dict(q=torch.zeros(2, 4)), "q must be \\[T, H, D\\]"),
    (dict(k=torch.zeros(10, 16)), "k must be \\[Hkv, S, D\\]"),
    (dict(q=torch.zeros(2, 4, 16, dtype=torch.float64)), "q must be float32, float16 or bfloat16"),
    (dict(k=torch.zeros(2, 10, 16, dtype=torch.float16)), "k must have q's dtype"),
    (dict(q=torch.zeros(0, 4, 16)), "q needs at least one token"),
    (dict(k=torch.zeros(2, 0, 16)), "k needs at least one head and one key"),
    (dict(k=torch.zeros(2, 10, 32)), "same head size, got 16 and 32"),
    (dict(q=torch.zeros(2, 4, 512), k=torch.zeros(2, 10, 512)), "head size must be between 1 and 256"),
    (dict(k=torch.zeros(3, 10, 16)), "query heads \\(4\\) must be a multiple of KV heads \\(3\\)"),
    (dict(round_starts=torch.tensor([])), "round_starts must be a non-empty 1-D tensor"),
    (dict(round_starts=torch.tensor([[0, 4]])), "round_starts must be a non-empty 1-D tensor"),
    (dict(round_starts=torch.tensor([0.0, 4.0])), "round_starts must hold integers"),
    (dict(round_starts=torch.tensor([1, 4])), "round_starts must begin at 0, got 1"),
    (dict(round_starts=torch.tensor([0, 4, 4])), "strictly ascending"),
    (dict(round_starts=torch.tensor([0, 6, 4])), "strictly ascending"),
    (dict(round_starts=torch.tensor([0, 10])), "below the number of keys 10"),
    (dict(scale=float("nan")), "scale must be a finite positive number"),
    (dict(scale=0.0), "scale must be a finite positive number"),
    (dict(q=[[[0.0]]]), "q must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_raise_one_line_value_errors(change, message):
    args = {**good_inputs(), **change}
    with pytest.raises(ValueError, match=message) as error:
        round_mass(**args)
    assert "\n" not in str(error.value)


def test_good_inputs_pass_the_checks():
    # The baseline that each bad input above changes one thing of.
    assert round_mass(**good_inputs()).shape == (2,)


# --- on the GPU ---

@pytest.mark.gpu
def test_kernel_runs_on_cuda():
    assert triton_kernel_runs_on("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_kernel_matches_reference(case, monkeypatch):
    check_against_reference(case, "cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_rounds_across_block_boundaries_take_their_mass(dtype):
    q, k, starts = dominant_round_inputs("cuda", dtype)
    got = round_mass(q, k, starts)
    torch.testing.assert_close(got, round_mass_ref(q, k, starts), **tolerances(dtype))
    assert got[1] + got[3] > 0.9


@pytest.mark.gpu
def test_gpu_views_of_a_kv_cache_with_round_starts_on_the_cpu():
    cache = torch.randn(3, 2, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    k = cache[1, 0, :, :4097]
    q = (3 * torch.randn(32, 64, 128, device="cuda")).to(torch.bfloat16).transpose(0, 1)
    starts = round_starts(4097, 40)  # on the CPU, as a caller holding Python-side round boundaries would pass
    got = round_mass(q, k, starts)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, round_mass_ref(q, k, starts.cuda()), **tolerances(torch.bfloat16))
