"""The quantized decode GEMVs (kernels.quant_gemv) against their reference (gguf's dequantizer, then F.linear), on
the CPU in triton's interpreter (through a child pytest, as in test_decode_kernels) and on the GPU.

The weights are random bytes in each format, every bit pattern of nibbles, high bits, packed scales and signs, with
the fp16 scale fields set to finite values (random bytes there would make NaNs and infinities no file holds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from kvchat.kernels._triton import INTERPRET
from kvchat.kernels.quant_gemv import (QUANT_GEMV_TYPES, QuantBlocks, dequantize_rows, quant_gemv,
                                      quant_gemv_ref, quant_gemv_runs, repack)
from triton_interpreter import passed_in_interpreter

_T = GGMLQuantizationType
interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="run by test_the_kernels_in_triton_s_interpreter with TRITON_INTERPRET=1")
TYPES = sorted(QUANT_GEMV_TYPES, key=lambda t: t.name)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Byte offsets of each block's fp16 scales.
FP16_FIELDS = {_T.Q8_0: (0,), _T.Q4_0: (0,), _T.Q5_0: (0,), _T.Q4_K: (0, 2), _T.Q5_K: (0, 2), _T.Q6_K: (208,)}


def random_matrix(qtype: GGMLQuantizationType, n_out: int, n_in: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n_out, row bytes]: random blocks of `qtype` whose fp16 scales are finite, of either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scale = rng.uniform(0.5, 2.0, (n_out, n_in // block)) * rng.choice([-1, 1], (n_out, n_in // block)) / 64
        raw[:, :, at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n_out, -1))


def random_blocks(qtype, n_out, n_in, seed=0, device="cpu") -> QuantBlocks:
    return repack(random_matrix(qtype, n_out, n_in, seed).to(device), qtype, n_in)


def check_quant_gemv(qtype, dtype, device, n_out, n_in, seed=0):
    w = random_blocks(qtype, n_out, n_in, seed, device)
    x = torch.randn(1, n_in, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    # quant_gemv falls back to the reference where its kernel does not run: compared with it, that could not fail.
    assert quant_gemv_runs(x, w), "quant_gemv would fall back to its reference for these inputs"
    got, want = quant_gemv(x, w), quant_gemv_ref(x, w)
    # The same float32 products summed in another order, then one rounding to the output dtype: a few units of
    # float32's last place against the sum's size in float32, one unit of the last place otherwise.
    scale = want.float().abs().max().item()
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
    out = torch.full((1, n_out + 3), 7.0, dtype=dtype, device=device)  # into a slice of a fused output
    quant_gemv(x, w, out=out[:, 2:2 + n_out])
    torch.testing.assert_close(out[:, 2:2 + n_out], got)
    assert (out[:, :2] == 7).all() and (out[:, 2 + n_out:] == 7).all()


def check_dequantize_rows(qtype, dtype, device, n_out, n_in, seed=0):
    """The prefill's dequantizer against the engine's (bit for bit in float32 and on the GPU; the interpreter rounds
    to 16-bit floats by truncation where the GPU rounds to nearest: one unit in the last place)."""
    from kvchat.engine.gguf.dequant import dequantize

    raw = random_matrix(qtype, n_out, n_in, seed).to(device)
    got = dequantize_rows(repack(raw, qtype, n_in), dtype)
    want = dequantize(raw.reshape(-1), qtype, (n_out, n_in), dtype)
    if dtype == torch.float32 or device != "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **{torch.float16: dict(rtol=1e-3, atol=0),
                                                 torch.bfloat16: dict(rtol=8e-3, atol=0)}[dtype])


def test_what_the_kernels_do_not_take_goes_to_the_reference():
    w = random_blocks(_T.Q4_K, 4, 256)
    assert not quant_gemv_runs(torch.randn(2, 256), w)  # two rows: a prefill's work, not a GEMV
    assert not quant_gemv_runs(torch.randn(1, 512), w)  # a row of another length
    x = torch.randn(1, 256)
    if not INTERPRET:  # on the CPU without the interpreter: no kernel runs, and the answer is still the reference's
        assert not quant_gemv_runs(x, w)
        torch.testing.assert_close(quant_gemv(x, w), quant_gemv_ref(x, w), rtol=0, atol=0)
        assert dequantize_rows(w, torch.float32) is None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacking_keeps_every_byte_and_the_rows(qtype):
    """The fields hold the file's bytes, no more, and give them back in the file's order; row slices and gathered
    rows are those rows' blocks."""
    raw = random_matrix(qtype, 7, 512, seed=3)
    w = repack(raw, qtype, 512)
    assert w.nbytes == raw.numel() and w.n_out == 7 and torch.equal(w.file_bytes(), raw)
    assert all(f.is_contiguous() for f in w.fields)
    assert torch.equal(w.row_slice(2, 5).file_bytes(), raw[2:5])
    assert torch.equal(w.take(torch.tensor([6, 0, 6])).file_bytes(), raw[[6, 0, 6]])
    with pytest.raises(ValueError, match=f"{qtype.name} matrix of 256 columns"):
        repack(raw, qtype, 256)


def test_the_reference_is_the_engines_dequantizer():
    from kvchat.engine.gguf.dequant import dequantize

    for qtype in TYPES:
        raw = random_matrix(qtype, 5, 512, seed=1)
        x = torch.randn(1, 512)
        exact = torch.nn.functional.linear(x, dequantize(raw.reshape(-1), qtype, (5, 512)))
        torch.testing.assert_close(quant_gemv_ref(x, repack(raw, qtype, 512)), exact, rtol=0, atol=0)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreted_kernels_match_references(dtype):
    for qtype in TYPES:
        check_quant_gemv(qtype, dtype, "cpu", 37, 512)  # odd rows: the last tile is masked; two blocks of 256
        check_quant_gemv(qtype, dtype, "cpu", 8, 256 * 3, seed=2)  # an odd number of blocks (Q8_0: 24)
        check_dequantize_rows(qtype, dtype, "cpu", 37, 256 * 3)


# Synthetic models (tests/conftest.py `models`) in each type with a kernel: Llama, Qwen 2 (q, k, v biases), Qwen 3
# (head norms, tied output: the token table is the output matrix).
MODEL_SPECS = [dict(qtype=_T.Q4_K), dict(qtype=_T.Q6_K), dict(arch="qwen2", style="chatml", qtype=_T.Q4_K),
               dict(arch="qwen3", style="chatml", qtype=_T.Q8_0, tied=True), dict(qtype=_T.Q4_0, seed=1),
               dict(qtype=_T.Q5_0, seed=1), dict(qtype=_T.Q5_K, style="mistral", seed=4)]


def check_quantized_model(path, device: str, max_tokens: int = 12, dtype: torch.dtype | None = None):
    """A model kept in its blocks against the same file dequantized at load: prefill logits (band by band through
    cuBLAS or the CPU's matmul: exactly the same weights), then greedy decoding (through the GEMVs)."""
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.quantized import QuantizedMatrix

    engines = [Engine(path, device=device, dtype=dtype, numerics="exact", quantized=q) for q in (False, True)]
    layer = engines[1].model.layers[0]
    assert all(isinstance(w, QuantizedMatrix) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert isinstance(engines[1].model.tok_embeddings, QuantizedMatrix)
    prompt = engines[0].encode_prompt("The quick brown fox jumps over the lazy dog.")
    logits, texts = [], []
    for engine in engines:
        cache = engine.new_cache(len(prompt) + 32)
        with torch.inference_mode():
            logits.append(engine.model(torch.tensor(prompt), cache, all_logits=True).float())
        texts.append(engine.complete(prompt, max_tokens=max_tokens).tokens)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)
    assert texts[1] == texts[0]


@interpreted
def test_interpreted_quantized_model_matches_the_dequantized_one(models):
    # One model in the interpreter (each decode step runs every kernel in Python); every one on the GPU.
    check_quantized_model(models.get(**MODEL_SPECS[2]), "cpu", max_tokens=2)


def test_a_quantized_model_on_the_cpu_without_kernels_is_still_the_same_model(models):
    """Without the kernels (no interpreter) every product dequantizes its bands: slow, never wrong."""
    check_quantized_model(models.get(**MODEL_SPECS[0]), "cpu")


def test_the_kernels_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(DTYPES) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(28672, 4096), (4096, 14336), (37, 512)], ids=str)
def test_gpu_dequantize_rows(shape, qtype, dtype):
    check_dequantize_rows(qtype, dtype, "cuda", *shape)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", MODEL_SPECS, ids=str)
def test_gpu_quantized_model_matches_the_dequantized_one(models, spec):
    # In float32: the two paths differ only in how the sums are ordered (bf16 would round those differences into
    # the logits of a random model, whose top tokens are close).
    check_quantized_model(models.get(**spec), "cuda", dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1152, 896), (37, 512)],
                         ids=str)
def test_gpu_quant_gemv(shape, qtype, dtype):
    if shape[1] % GGML_QUANT_SIZES[qtype][0]:
        pytest.skip("the row is not whole blocks of this type")
    check_quant_gemv(qtype, dtype, "cuda", *shape)


def test_a_type_without_a_kernel_is_dequantized_at_load_and_said(models, monkeypatch):
    """Kept quantized where it can be: a file's matrices of a type with no kernel (here Q5_K, its kernel taken away)
    are dequantized, and the loader names the type for the notice a user sees (app/session/service.py); a type
    with a kernel names nothing."""
    from kvchat.engine.engine import Engine
    from kvchat.engine.gguf import loader
    from kvchat.engine.model.quantized import QuantizedMatrix

    q5_path = models.get(qtype=_T.Q5_K, style="mistral", seed=4)
    assert Engine(q5_path, device="cpu", quantized=True).dequantized_types == ()
    monkeypatch.setattr(loader, "QUANT_GEMV_TYPES", QUANT_GEMV_TYPES - {_T.Q5_K})
    q5 = Engine(q5_path, device="cpu", quantized=True)
    assert q5.dequantized_types == ("Q5_K",) and not isinstance(q5.model.layers[0].wqkv, QuantizedMatrix)
    assert Engine(models.get(**MODEL_SPECS[0]), device="cpu", quantized=True).dequantized_types == ()
    assert Engine(q5_path, device="cpu").dequantized_types == ()


def test_neighbouring_parts_of_one_type_stack_into_one_launch():
    """q, k (Q4_K) and v (Q6_K), as a Q4_K_M file mixes them: the first two become one part, the product is the
    three matrices' stacked, whichever way it runs."""
    from kvchat.engine.model.quantized import QuantizedMatrix

    raws = [(random_matrix(_T.Q4_K, 6, 512, seed=1), _T.Q4_K), (random_matrix(_T.Q4_K, 2, 512, seed=2), _T.Q4_K),
            (random_matrix(_T.Q6_K, 2, 512, seed=3), _T.Q6_K)]
    m = QuantizedMatrix([repack(raw, qtype, 512) for raw, qtype in raws], 512, torch.float32)
    assert [(p.qtype, p.n_out) for p in m.parts] == [(_T.Q4_K, 8), (_T.Q6_K, 2)] and m.n_out == 10
    x = torch.randn(3, 512)
    want = torch.cat([quant_gemv_ref(x, repack(raw, qtype, 512)) for raw, qtype in raws], dim=1)
    torch.testing.assert_close(m.linear(x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(m.linear(x[:1]), want[:1], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="one quantization type"):
        QuantBlocks.stack([repack(raws[0][0], _T.Q4_K, 512), repack(raws[2][0], _T.Q6_K, 512)])
