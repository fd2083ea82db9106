"""The integer decode products (kernels.quant_dot: x quantized to int8, 4-way int8 dot products) against their
reference (x as quantized, W dequantized by gguf's decoder, the product in float64), on the CPU in triton's
interpreter (dp4a computed byte by byte) and on the GPU (dp4a itself); and how a quantized 16-bit model uses them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kvchat.kernels._triton import INTERPRET
from kvchat.kernels.quant_dot import (QUANT_DOT_TYPES, QuantX, quant_dot, quant_dot_ref, quant_dot_runs, quantize_x,
                                      quantize_x_ref)
from test_quant_gemv import random_blocks
from triton_interpreter import passed_in_interpreter

_T = GGMLQuantizationType
interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="run by test_the_integer_kernels_in_triton_s_interpreter (TRITON_INTERPRET=1)")
TYPES = sorted(QUANT_DOT_TYPES, key=lambda t: t.name)


def some_x(n_in: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """A row with a group of zeros (a scale of zero), one of a single large value, and one of tiny values."""
    x = torch.randn(1, n_in, generator=torch.Generator().manual_seed(seed))
    x[0, 32:64] = 0
    x[0, 64:96] *= 1e-3
    x[0, 100] = 40.0
    return x.to(device, dtype)


def check_quantize_x(x: torch.Tensor) -> QuantX:
    got, want = quantize_x(x), quantize_x_ref(x)
    # A value within a rounding of a half may land one step away (the kernel's multiply-add may be fused).
    assert (got.q.int() - want.q.int()).abs().max() <= 1 and (got.q != want.q).sum() <= 2
    torch.testing.assert_close(got.d, want.d, rtol=0, atol=0)
    torch.testing.assert_close(got.sums, got.q.float().reshape(-1, 16).sum(1), rtol=0, atol=0)
    # what the quants stand for is x, to half a step of its group's scale
    approx = (got.q.float().reshape(-1, 32) * got.d[:, None]).reshape(1, -1)
    assert ((approx - x.float()).abs().reshape(-1, 32) <= got.d[:, None] * 0.5001 + 1e-12).all()
    return got


def check_quant_dot(qtype, dtype, device, n_out, n_in, seed=0):
    w = random_blocks(qtype, n_out, n_in, seed, device)
    x = some_x(n_in, dtype, device, seed)
    assert quant_dot_runs(x, w), "these operands would not take the integer kernel"
    xq = check_quantize_x(x)
    out = torch.full((1, n_out + 3), 7.0, dtype=dtype, device=device)  # into a slice of a fused output
    got = quant_dot(xq, w, out[:, 2:2 + n_out]).float()
    want = quant_dot_ref(xq, w)
    # Integer sums are exact; the scales' float32 products summed in another order, then one rounding to dtype.
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert (out[:, :2] == 7).all() and (out[:, 2 + n_out:] == 7).all()


def test_what_the_integer_kernels_do_not_take():
    w = random_blocks(_T.Q4_K, 4, 256)
    assert not quant_dot_runs(torch.randn(2, 256), w)  # two rows: a prefill's work
    assert not quant_dot_runs(torch.randn(1, 512), w)  # a row of another length
    assert not quant_dot_runs(torch.randn(1, 256), random_blocks(_T.Q5_0, 4, 256))  # no integer kernel for Q5_0
    if not INTERPRET:
        assert not quant_dot_runs(torch.randn(1, 256), w)  # on the CPU without the interpreter


def test_tiles_come_from_the_environment_s_file_by_class_then_by_type(tmp_path, monkeypatch):
    from kvchat.kernels import quant_dot as module

    path = tmp_path / "tiles.json"
    path.write_text('{"Q4_K": [2, 4, 1], "Q4_K/long": [1, 8, 2]}')
    monkeypatch.setattr(module, "INTERPRET", False)  # the interpreter's own tiles aside
    monkeypatch.setenv(module.TILES_ENV, str(path))
    module._tiles_from_env.cache_clear()
    try:
        assert module.default_dot_tiles(_T.Q4_K, 4096, 14336) == (1, 8, 2)  # down: long rows
        assert module.default_dot_tiles(_T.Q4_K, 28672, 4096) == (2, 4, 1)  # gate+up: the type's entry
        assert module.default_dot_tiles(_T.Q6_K, 4096, 4096) == module.DEFAULT_DOT_TILES[_T.Q6_K, ""]
        path.write_text('{"Q4_K/wide": [1, 8, 2]}')
        module._tiles_from_env.cache_clear()
        with pytest.raises(ValueError, match="Q4_K/wide") as caught:
            module.default_dot_tiles(_T.Q4_K, 4096, 4096)
        assert "\n" not in str(caught.value)
    finally:
        monkeypatch.delenv(module.TILES_ENV)
        module._tiles_from_env.cache_clear()


def test_a_prefill_band_is_whole_tiles_of_rows():
    from kvchat.engine.model.quantized import (BAND_ELEMENTS, BAND_ROW_MULTIPLE, SHORT_BAND_ELEMENTS, SHORT_PREFILL,
                                               band_rows)

    for n_in in (896, 2048, 4096, 14336, 18944, 1 << 20):
        for n_tokens, elements in ((SHORT_PREFILL + 1, BAND_ELEMENTS), (SHORT_PREFILL, SHORT_BAND_ELEMENTS)):
            rows = band_rows(n_in, n_tokens)
            assert rows * n_in <= elements or rows == 1
            assert rows % BAND_ROW_MULTIPLE == 0 or rows < BAND_ROW_MULTIPLE
    assert band_rows(14336, 4096) == 1152  # not 1,170: its slices of the output would start 2-element aligned
    assert band_rows(4096, 1024) == 4 * band_rows(4096, 4096)  # a short prompt: a quarter of the launches


def test_the_reference_quantizes_x_as_llama_cpp_does():
    """Per 32 values: d = max|x| / 127 and q = round(x / d); a group of zeros has d = 0 and q = 0."""
    x = some_x(256, torch.float32, "cpu")
    xq = quantize_x_ref(x)
    groups = x.reshape(-1, 32)
    torch.testing.assert_close(xq.d, groups.abs().amax(1) / 127)
    assert xq.q.abs().max() == 127 and (xq.q.reshape(-1, 32).abs().amax(1)[xq.d > 0] == 127).all()
    assert (xq.q[32:64] == 0).all() and xq.d[1] == 0
    assert ((xq.q.float() - x.flatten() / xq.d.repeat_interleave(32)).abs()[xq.d.repeat_interleave(32) > 0]
            <= 0.5 + 1e-4).all()
    assert torch.equal(xq.sums, xq.q.float().reshape(-1, 16).sum(1))


@interpreted
def test_interpreted_integer_kernels_match_references():
    for qtype in TYPES:
        check_quant_dot(qtype, torch.bfloat16, "cpu", 37, 512)  # odd rows: the last tile is masked
        check_quant_dot(qtype, torch.float32, "cpu", 8, 768, seed=2)  # three blocks of 256: a partial tile


@interpreted
def test_interpreted_bf16_products_take_the_integer_kernels_with_x_quantized_once():
    """A quantized matrix of three parts (Q4_K and Q4_K stacked into one launch, then Q5_0, which has no integer
    kernel) times bf16 x: the Q4_K part is kernels.quant_dot's over x quantized once, the Q5_0 part the float GEMV's;
    with int8_activations off, both are the float GEMV's; and float32 x keeps the float GEMVs."""
    from kvchat.engine.model.quantized import QuantizedMatrix
    from kvchat.kernels.quant_gemv import QuantBlocks, quant_gemv

    parts = [random_blocks(_T.Q4_K, 24, 512, seed=1), random_blocks(_T.Q4_K, 8, 512, seed=2),
             random_blocks(_T.Q5_0, 8, 512, seed=3)]
    matrix = QuantizedMatrix(parts, 512, torch.bfloat16)
    assert [p.qtype for p in matrix.parts] == [_T.Q4_K, _T.Q5_0]
    x = some_x(512, torch.bfloat16, "cpu")
    got = matrix.linear(x)
    stacked = QuantBlocks.stack(parts[:2])
    assert torch.equal(got[:, :32], quant_dot(quantize_x(x), stacked, torch.empty(1, 32, dtype=torch.bfloat16)))
    assert torch.equal(got[:, 32:], quant_gemv(x, parts[2]))
    matrix.int8_activations = False
    floats = matrix.linear(x)
    assert torch.equal(floats[:, :32], quant_gemv(x, stacked)) and torch.equal(floats[:, 32:], got[:, 32:])
    assert not torch.equal(got[:, :32], floats[:, :32])  # x's rounding shows
    assert torch.nn.functional.cosine_similarity(got.float(), floats.float()).item() > 0.999
    matrix.int8_activations = True
    x32 = x.float()
    assert torch.equal(matrix.linear(x32)[:, :32], quant_gemv(x32, stacked))


@interpreted
def test_interpreted_norm_and_swiglu_quantize_the_x_they_make():
    """A decode step's x is quantized by the kernel that makes it (kernels.rms_norm, kernels.silu_mul): the same
    QuantX as quantize_x of their output, which itself is unchanged."""
    from kvchat.kernels.rms_norm import add_rms_norm
    from kvchat.kernels.silu_mul import silu_mul

    def same(a: QuantX, b: QuantX):
        assert torch.equal(a.q, b.q) and torch.equal(a.d, b.d) and torch.equal(a.sums, b.sums)

    x, res = some_x(96 * 32, torch.bfloat16, "cpu"), some_x(96 * 32, torch.bfloat16, "cpu", seed=1)
    weight = torch.rand(96 * 32, generator=torch.Generator().manual_seed(2)) + 0.5
    s, out, xq = add_rms_norm(x, res, weight, 1e-6, quantize=True)
    assert all(torch.equal(a, b) for a, b in zip((s, out), add_rms_norm(x, res, weight, 1e-6)))
    same(xq, quantize_x(out))
    gate_up = some_x(2 * 1056, torch.bfloat16, "cpu", seed=3)  # 1,056 columns: a partial block of 1,024
    act, xq = silu_mul(gate_up, quantize=True)
    assert torch.equal(act, silu_mul(gate_up))
    same(xq, quantize_x(act))
    with pytest.raises(ValueError, match="one row"):
        silu_mul(torch.zeros(2, 64, dtype=torch.bfloat16), quantize=True)


def test_the_integer_kernels_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6144, 4096), (28672, 4096), (4096, 14336), (1152, 896), (37, 512)], ids=str)
def test_gpu_quant_dot(shape, qtype, dtype):
    if shape[1] % (256 if qtype in (_T.Q4_K, _T.Q5_K, _T.Q6_K) else 32):
        pytest.skip("the row is not whole blocks of this type")
    check_quant_dot(qtype, dtype, "cuda", *shape)


@pytest.mark.gpu
def test_gpu_quantized_bf16_model_decodes_through_the_integer_kernels(models):
    """A bf16 Q4_K model kept in its blocks decodes (CUDA graphs) the float GEMVs' greedy tokens for the first steps
    at least (x's int8 rounding may flip a near-tie of a random model's logits later)."""
    from kvchat.app.bench.engine_speed import quantized_matrices
    from kvchat.engine.engine import Engine

    path = models.get(qtype=_T.Q4_K)
    replies = []
    for int8 in (True, False):
        engine = Engine(path, device="cuda", dtype=torch.bfloat16, quantized=True)
        for matrix in quantized_matrices(engine.model):
            matrix.int8_activations = int8
        prompt = engine.encode_prompt("The quick brown fox jumps over the lazy dog.")
        replies.append(engine.complete(prompt, max_tokens=16).tokens)
    same = next((i for i, (a, b) in enumerate(zip(*replies)) if a != b), len(replies[0]))
    assert same >= 4, replies
