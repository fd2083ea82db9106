"""The decode step's kernels besides attention (kernels.rms_norm, kernels.rope_kv, kernels.silu_mul, kernels.gemv)
against their torch definitions, on the CPU in triton's interpreter (through a child pytest, as in test_round_scores) and on the GPU."""

from __future__ import annotations


import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels.gemv import gemv, gemv_ref, gemv_runs
from kvchat.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from kvchat.kernels.rope_kv import partner_index, rope_kv, rope_kv_ref
from kvchat.kernels._triton import INTERPRET
from kvchat.kernels.silu_mul import silu_mul, silu_mul_ref

interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="run by test_the_kernels_in_triton_s_interpreter with TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (H, Hkv, D, rope_dim, neox): Llama (normal pairs), Qwen2 (NeoX pairs), a partial rotary dimension, MHA and MQA.
ROPE_CASES = [(8, 2, 64, 64, False), (14, 2, 64, 64, True), (4, 4, 128, 64, True), (8, 1, 32, 24, False),
              (32, 8, 128, 128, False)]


def exact_or_one_rounding(dtype: torch.dtype) -> dict:
    # The kernels compute in float32 like the references; they may round once where torch rounds twice
    # (silu, then the product) or fuse a multiply-add: a unit in the last place of the output dtype.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


def check_rms_norm(dtype, device, width=4096, rows=1, residual=True):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(device, dtype)
    r = torch.randn(rows, width, generator=gen).to(device, dtype) if residual else None
    w = (1 + torch.randn(width, generator=gen)).to(device)
    got_sum, got = add_rms_norm(x, r, w, 1e-5)
    want_sum, want = add_rms_norm_ref(x, r, w, 1e-5)
    # One rounding of the same float32 sum; triton's interpreter rounds to bfloat16 by truncation (the GPU to
    # nearest), a unit in the last place.
    exact = dtype != torch.bfloat16 or device != "cpu"
    torch.testing.assert_close(got_sum, want_sum, **(dict(rtol=0, atol=0) if exact else exact_or_one_rounding(dtype)))
    torch.testing.assert_close(got, want, **exact_or_one_rounding(dtype))


def rope_tables(head_dim, rope_dim, neox, n_pos=64):
    """C and S as engine.model.RotaryTable builds them, for positions [0, n_pos)."""
    half = rope_dim // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().float(), ang.sin().float()
    if neox:
        c, s = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    else:
        c, s = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
    pad = torch.nn.functional.pad
    return pad(c, (0, head_dim - rope_dim), value=1.0), pad(s, (0, head_dim - rope_dim), value=0.0)


def check_rope_kv(case, dtype, device):
    n_heads, n_kv, head_dim, rope_dim, neox = case
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, (n_heads + 2 * n_kv) * head_dim, generator=gen).to(device, dtype)
    c, s = (t.to(device) for t in rope_tables(head_dim, rope_dim, neox))
    position, slot = torch.tensor([37], device=device), torch.tensor([5], device=device)
    caches = [torch.randn(3, 2, n_kv, 9, head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    got = rope_kv(qkv, c, s, position, caches[0][1], slot, n_heads, rope_dim, neox)
    want = rope_kv_ref(qkv, c, s, position, caches[1][1], slot, n_heads, rope_dim, neox)
    torch.testing.assert_close(got, want, **exact_or_one_rounding(dtype))
    torch.testing.assert_close(caches[0], caches[1], **exact_or_one_rounding(dtype))  # the slot, nothing else


def check_silu_mul(dtype, device, width=14336, rows=1):
    gate_up = (2 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(2))).to(device, dtype)
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), **exact_or_one_rounding(dtype))


def check_gemv(dtype, device, n_out, n_in, bias=False):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, n_in, generator=gen).to(device, dtype)
    w = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).to(device, dtype)
    b = torch.randn(n_out, generator=gen).to(device, dtype) if bias else None
    # Sums of n_in products in another order than cuBLAS's (and the CPU's): float32 gets room for that.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else exact_or_one_rounding(dtype)
    # gemv falls back to F.linear where the kernel does not run: compared with gemv_ref, that could not fail.
    assert gemv_runs(x, w, b), "gemv would fall back to F.linear for these inputs"
    torch.testing.assert_close(gemv(x, w, b), gemv_ref(x, w, b), **tol)


def test_partner_index_pairs_elements_as_the_rotary_table_does():
    assert partner_index(8, 8, neox=False).tolist() == [1, 0, 3, 2, 5, 4, 7, 6]
    assert partner_index(8, 8, neox=True).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert partner_index(8, 4, neox=True).tolist() == [2, 3, 0, 1, 4, 5, 6, 7]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreted_kernels_match_references(dtype):
    check_rms_norm(dtype, "cpu", width=300, rows=2)
    check_rms_norm(dtype, "cpu", width=256, residual=False)
    for case in ROPE_CASES:
        check_rope_kv(case, dtype, "cpu")
    check_silu_mul(dtype, "cpu", width=1500, rows=2)
    check_gemv(dtype, "cpu", 77, 300, bias=True)  # odd sizes: the row and column tiles are masked
    check_gemv(dtype, "cpu", 64, 128)


def fused_and_plain_prefill(engine, monkeypatch, chunk: int):
    """Logits and K/V of a prompt in chunks and a message over it: through the fused prefill, then plainly."""
    from kvchat.engine.model import decoder as model_module
    from kvchat.engine.generate import prefill
    from kvchat.engine.train.synthetic import REFERENCE_PROMPT

    tokens = engine.encode_prompt(REFERENCE_PROMPT)
    out = []
    for fused in (True, False):
        monkeypatch.setattr(model_module, "fused_prefill_runs", lambda *args, fused=fused: fused)
        cache = engine.new_cache(len(tokens) + 8)
        prefill(engine.model, cache, tokens[:-5], chunk=chunk)
        logits = prefill(engine.model, cache, tokens[-5:])
        out.append((logits.float(), cache.kv[:, :, :, : len(tokens)].float()))
    return out


@interpreted
@pytest.mark.parametrize("spec", [dict(n_layers=2), dict(arch="qwen2", style="chatml", n_layers=2)], ids=str)
def test_interpreted_fused_prefill_matches_the_plain_one(models, monkeypatch, spec):
    """Norms fused with their residual adds and SwiGLU in one kernel: the same model in fp32."""
    from kvchat.engine.engine import Engine

    (fused, fused_kv), (plain, plain_kv) = fused_and_plain_prefill(
        Engine(models.get(**spec), device="cpu"), monkeypatch, chunk=9)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_kv, plain_kv, rtol=1e-4, atol=1e-4)


def test_the_kernels_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(DTYPES) + 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [896, 4096, 5120])
def test_gpu_rms_norm(dtype, width):
    check_rms_norm(dtype, "cuda", width=width)
    check_rms_norm(dtype, "cuda", width=width, residual=False, rows=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_gpu_rope_kv(case, dtype):
    check_rope_kv(case, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [4864, 14336])
def test_gpu_silu_mul(dtype, width):
    check_silu_mul(dtype, "cuda", width=width)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1152, 896), (77, 300)],
                         ids=str)
def test_gpu_gemv(shape, dtype):
    check_gemv(dtype, "cuda", *shape, bias=shape[0] == 1152)
