"""LoopServe's sparse prefill: the vertical-slash kernel (kernels.sparse_prefill) against its torch definition, the
index it runs on, the online line selection (engine.policies.sparse_prefill) and the model's prefill through it.

As for the other kernels, the Triton kernel runs on the CPU only in triton's interpreter: the `interpreted` tests
skip themselves in the ordinary run and `test_the_kernel_in_triton_s_interpreter` runs them in a child pytest with
TRITON_INTERPRET=1; the `gpu` tests cover larger sizes and every dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import passed_in_interpreter

from kvchat.engine.policies.sparse_prefill import SparsePrefill, select_lines
from kvchat.kernels._triton import INTERPRET
from kvchat.kernels.sparse_prefill import (
    block_size, build_index, dense_index, slash_diagonals, sparse_prefill_attention, sparse_prefill_ref,
    visible_mask,
)

interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def structured(n_new, start, n_heads, n_kv_heads, head_dim, dtype, device, seed=0):
    """Queries and a cache [2, Hkv, N + 3, D] whose attention has structure, as a trained model's has: a few key
    columns every query is drawn to (a sink, separators) and a local band (keys near each query), over noise."""
    gen = torch.Generator().manual_seed(seed)
    n_keys = start + n_new
    q = torch.randn(n_new, n_heads, head_dim, generator=gen) / head_dim**0.25
    kv = torch.randn(2, n_kv_heads, n_keys + 3, head_dim, generator=gen) / head_dim**0.25
    hot = torch.randn(head_dim, generator=gen)
    sinks = torch.randint(0, n_keys, (max(2, n_keys // 64),), generator=gen)
    kv[0, :, sinks] += 4 * hot / head_dim**0.25
    q += 2 * hot / head_dim**0.25
    # a local band: key t and the queries just after it share a direction of their own
    local = torch.randn(n_keys, head_dim, generator=gen)
    kv[0, :, :n_keys] += 3 * local / head_dim**0.25
    q += 3 * local[start:n_keys, None, :] / head_dim**0.25
    kv[:, :, n_keys:] = float("nan")  # past the keys: a kernel reading there would be caught
    return q.to(device, dtype), kv.to(device, dtype)


def random_lines(n_heads, n_keys, share, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n_heads, n_keys, generator=gen) < share, torch.rand(n_heads, n_keys, generator=gen) < share


def dense_causal(q, k, v, start):
    n_new, n_heads, _ = q.shape
    n_rep = n_heads // k.shape[0]
    n_keys = start + n_new
    mask = torch.arange(n_keys)[None, :] <= start + torch.arange(n_new)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k[:, :n_keys].float().repeat_interleave(n_rep, 0),
                                         v[:, :n_keys].float().repeat_interleave(n_rep, 0), attn_mask=mask.to(q.device))
    return out.transpose(0, 1).to(q.dtype)


# (H, Hkv, D, start, T, dtype): a first prefill (start 0), a chunk after a history not on a block boundary, MHA,
# GQA and MQA, a head size that is not a power of two, half precision.
CASES = [
    (4, 4, 32, 0, 37, torch.float32),
    (4, 2, 32, 57, 40, torch.float32),
    (8, 1, 64, 100, 33, torch.float16),
    (4, 2, 48, 21, 50, torch.bfloat16),
]


def case_id(case):
    h, hkv, d, start, t, dtype = case
    return f"H{h}kv{hkv}-D{d}-s{start}-T{t}-{str(dtype).removeprefix('torch.')}"


def check_kernel(case, device, share=0.1, dense=None):
    n_heads, n_kv_heads, head_dim, start, n_new, dtype = case
    q, kv = structured(n_new, start, n_heads, n_kv_heads, head_dim, dtype, device)
    verticals, slashes = random_lines(n_heads, start + n_new, share)
    block = block_size(head_dim)
    diagonals = slash_diagonals(slashes, start, n_new, block)
    index = build_index(verticals.to(device), diagonals.to(device), start, n_new, block,
                        None if dense is None else dense.to(device))
    got = sparse_prefill_attention(q, kv[0], kv[1], index)
    want = sparse_prefill_ref(q, kv[0, :, : start + n_new], kv[1, :, : start + n_new], index)
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL[dtype])
    return q, kv


# --- on the CPU in triton's interpreter (run through test_the_kernel_in_triton_s_interpreter) ---

@interpreted
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_interpreted_kernel_matches_reference(case):
    check_kernel(case, "cpu", share=0.15, dense=torch.tensor([False, True] + [False] * (case[0] - 2)))


@interpreted
def test_interpreted_dense_index_is_causal_attention():
    n_heads, n_kv_heads, head_dim, start, n_new = 4, 2, 32, 45, 39
    q, kv = structured(n_new, start, n_heads, n_kv_heads, head_dim, torch.float32, "cpu")
    index = dense_index(n_heads, start, n_new, block_size(head_dim), torch.device("cpu"))
    got = sparse_prefill_attention(q, kv[0], kv[1], index)
    torch.testing.assert_close(got, dense_causal(q, kv[0], kv[1], start), rtol=1e-5, atol=1e-5)
    assert index.density() == pytest.approx(1.0, abs=0.35)  # whole blocks: a little over the causal triangle


@interpreted
def test_interpreted_model_prefill_is_dense_at_alpha_one():
    """The embedded model (fp32) prefilled through the kernel with alpha = 1: every line with any mass is kept,
    so the logits are the dense prefill's (and with alpha 0.5 they are not)."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.engine import Engine

    m = Engine(DEFAULT_MODEL, device="cpu").model
    tokens = torch.arange(3, 90)
    dense = m(tokens, m.new_cache(128), all_logits=True)
    m.sparse_prefill = SparsePrefill(alpha=1.0, min_keys=0)
    try:
        sparse = m(tokens, m.new_cache(128), all_logits=True)
        m.sparse_prefill = SparsePrefill(alpha=0.5, min_keys=0)
        half = m(tokens, m.new_cache(128), all_logits=True)
    finally:
        m.sparse_prefill = None
    assert (half - dense).abs().max() > 0.1
    # Summed in another order than SDPA's, which this model's logits (up to ~30) carry to a few 1e-3.
    torch.testing.assert_close(sparse, dense, rtol=0, atol=2e-2)
    assert torch.equal(sparse.argmax(-1), dense.argmax(-1))


def test_the_kernel_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(CASES) + 2


# --- in this process: the index, the selection, the model ---

@pytest.mark.parametrize("start, n_new", [(29, 45), (50, 5), (0, 3), (48, 16)])
def test_the_index_covers_the_chosen_lines_and_nothing_after_a_row(start, n_new):
    # blocks crossing the diagonal, a chunk shorter than a block after a history, a first short chunk, aligned
    n_heads, block = 3, 16
    verticals, slashes = random_lines(n_heads, start + n_new, 0.08, seed=3)
    index = build_index(verticals, slash_diagonals(slashes, start, n_new, block), start, n_new, block)
    mask = visible_mask(index)
    rows = torch.arange(n_new)
    slot = start + rows
    assert not (mask & (torch.arange(start + n_new)[None, :] > slot[:, None])).any()  # causal
    assert mask[:, rows, slot].all()  # the diagonal is always there: every row sees itself
    for h in range(n_heads):
        for c in verticals[h].nonzero().flatten().tolist():
            assert mask[h, slot >= c, c].all()
        for d in slashes[h].nonzero().flatten().tolist():
            r = rows[slot >= d]
            assert mask[h, r, start + r - d].all()


def test_dense_heads_see_every_earlier_key():
    verticals, slashes = random_lines(4, 60, 0.05)
    index = build_index(verticals, slash_diagonals(slashes, 20, 40, 16), 20, 40, 16,
                        dense=torch.tensor([False, True, False, True]))
    mask = visible_mask(index)
    causal = torch.arange(60)[None, :] <= 20 + torch.arange(40)[:, None]
    assert torch.equal(mask[1], causal) and torch.equal(mask[3], causal) and not torch.equal(mask[0], causal)
    assert index.head_density()[1] >= 1.0  # whole blocks: a little over the causal triangle


@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99])
def test_selected_lines_hold_alpha_of_the_sampled_attention(alpha):
    n_heads, start, n_new, head_dim = 4, 150, 90, 32
    q, kv = structured(n_new, start, n_heads, 2, head_dim, torch.float32, "cpu")
    scale = 1 / math.sqrt(head_dim)
    block = 16
    verticals, diagonals, dense = select_lines(q, kv[0, :, : start + n_new], start, alpha, 16, scale, block)
    assert not dense.any()
    rows = torch.linspace(0, n_new - 1, 16).round().long()
    keys = kv[0, :, : start + n_new].repeat_interleave(2, 0)
    scores = torch.einsum("shd,hnd->hsn", q[rows], keys) * scale
    causal = torch.arange(start + n_new)[None, :] <= start + rows[:, None]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    index = build_index(verticals, diagonals, start, n_new, block)
    on_lines = visible_mask(index)[:, rows]  # the chosen lines (and the kernel's own diagonal) at the sampled rows
    held = (probs * on_lines).sum((1, 2)) / probs.sum((1, 2))
    assert (held >= alpha - 1e-5).all(), held
    if alpha < 0.99:  # structured attention is sparse: the lines are a small part of the work
        assert (index.head_density() < 0.8).all(), index.head_density()


def test_sparse_attention_nears_dense_as_alpha_grows():
    """On structured attention, alpha 0.9 computes half the work or less and moves the output by < 15%; alpha 0.99
    keeps every line that matters here (the output is dense's). On the CPU the torch definition runs
    (SparsePrefill.attend picks it without Triton)."""
    n_heads, n_kv_heads, head_dim, start, n_new = 4, 2, 32, 3800, 256
    q, kv = structured(n_new, start, n_heads, n_kv_heads, head_dim, torch.float32, "cpu")
    want = dense_causal(q, kv[0], kv[1], start)
    errors = {}
    for alpha in (0.9, 0.99):
        sparse = SparsePrefill(alpha=alpha, min_keys=0, max_density=1.0)
        got = sparse.attend(q, kv, start, 1 / math.sqrt(head_dim))
        if got is None:  # every head fell back to dense: the caller's dense attention runs
            assert sparse.stats.dense_heads == n_heads
            got = want
        errors[alpha] = float((got.view(n_new, n_heads, head_dim) - want).norm() / want.norm())
        assert sparse.stats.calls == 1
        if alpha == 0.9:
            assert sparse.stats.density < 0.6
    assert errors[0.9] < 0.15 and errors[0.99] < 1e-4, errors


def test_the_prefill_stays_dense_below_its_threshold_and_for_single_tokens():
    s = SparsePrefill(min_keys=1000)
    assert not s.applies(500, 999) and s.applies(500, 1000) and not s.applies(1, 5000)
    with pytest.raises(ValueError):
        SparsePrefill(alpha=0.0)


def test_a_head_whose_scores_are_not_finite_falls_back_to_dense():
    q, kv = structured(40, 20, 2, 2, 32, torch.float32, "cpu")
    q[:, 1] = float("nan")
    _, _, dense = select_lines(q, kv[0, :, :60], 20, 0.9, 48, 0.1, 16)
    assert dense.tolist() == [False, True]


# --- GPU ---

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 8, 128, 3000, 1100), (8, 1, 256, 0, 700), (28, 4, 64, 4096, 4096)])
def test_gpu_kernel_matches_reference(shape, dtype):
    n_heads, n_kv_heads, head_dim, start, n_new = shape
    check_kernel((n_heads, n_kv_heads, head_dim, start, n_new, dtype), "cuda", share=0.02)


def test_bench_loopserve_bad_input_is_one_line():
    from cli_run import kvchat

    proc = kvchat("bench", "loopserve", "--device", "cpu", "--densities", "0.1,abc", check=False)
    assert proc.returncode == 1 and "--densities takes comma-separated shares" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
