"""Our torch dequantizers against gguf.quants' numpy reference: equal bit for bit, on CPU and (when present) CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from kvchat.engine.gguf import dequant
from kvchat.engine.gguf.dequant import SUPPORTED_TYPES, byte_size, dequantize

SHAPES = [(3, 256), (2, 5, 512), (1, 256 * 3)]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each block's fp16 scale fields (d, and dmin where there is one).
FP16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_raw(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid stored bytes for a tensor of `shape`: random bits everywhere, finite modest fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        # Real values rather than random bits: random bits include NaNs, which never compare equal.
        values = rng.standard_normal(shape, dtype=np.float32) * 3
        return quants.quantize(values, qtype).view(np.uint8).reshape(-1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = rng.uniform(-2, 2, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype)).reshape(shape))


def test_supported_types():
    assert SUPPORTED_TYPES == frozenset(FLOAT_TYPES + QUANT_TYPES)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FLOAT_TYPES + QUANT_TYPES, ids=lambda t: t.name)
def test_matches_reference(qtype, shape):
    raw = random_raw(qtype, shape)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0], ids=lambda t: t.name)
def test_matches_reference_on_quantized_floats(qtype):
    shape = (4, 256)
    values = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    raw = quants.quantize(values, qtype).reshape(-1)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", FLOAT_TYPES + QUANT_TYPES, ids=lambda t: t.name)
def test_many_passes_match_one(qtype, dtype, monkeypatch):
    # Tiny passes, so that a tensor is decoded in several pieces, the last one short.
    shape = (5, 512)
    raw = random_raw(qtype, shape, seed=2)
    monkeypatch.setattr(dequant, "_CPU_PASS_ELEMS", 768)
    monkeypatch.setattr(dequant, "_CUDA_PASS_ELEMS", 768)
    got = dequantize(torch.from_numpy(raw), qtype, shape, dtype=dtype)
    assert torch.equal(got, reference(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", FLOAT_TYPES + QUANT_TYPES, ids=lambda t: t.name)
def test_unaligned_bytes(qtype):
    # The bytes may be a slice of a larger buffer starting at an odd address.
    shape = (2, 256)
    raw = random_raw(qtype, shape, seed=3)
    padded = torch.zeros(raw.size + 1, dtype=torch.uint8)
    padded[1:] = torch.from_numpy(raw)
    assert torch.equal(dequantize(padded[1:], qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.BF16, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_output_dtype(qtype):
    shape = (3, 256)
    raw = random_raw(qtype, shape)
    got = dequantize(torch.from_numpy(raw), qtype, shape, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == shape
    assert torch.equal(got, reference(raw, qtype, shape).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_wrong_byte_count(qtype):
    shape = (2, 256)
    raw = torch.from_numpy(random_raw(qtype, shape))
    for bad in (raw[:-1], torch.cat((raw, raw[:1]))):
        with pytest.raises(ValueError, match=f"needs {raw.numel()} bytes, got {bad.numel()}"):
            dequantize(bad, qtype, shape)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_row_not_block_multiple(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    shape = (2, block_size + 16)
    with pytest.raises(ValueError, match="not a multiple"):
        dequantize(torch.zeros(1000, dtype=torch.uint8), qtype, shape)
    with pytest.raises(ValueError, match="not a multiple"):
        byte_size(qtype, shape)


def test_unsupported_type():
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(torch.zeros(84, dtype=torch.uint8), T.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="Q2_K"):
        byte_size(T.Q2_K, (1, 256))


def test_raw_must_be_uint8_bytes():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(256, dtype=torch.float32), T.F32, (256,))
    with pytest.raises(ValueError, match="1-D"):
        dequantize(torch.zeros(2, 512, dtype=torch.uint8), T.F32, (256,))


@pytest.mark.parametrize("shape", SHAPES + [(256,), (4, 0, 256)], ids=str)
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_byte_size(qtype, shape):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert byte_size(qtype, shape) == int(np.prod(shape)) // block_size * type_size


def test_empty_tensor():
    got = dequantize(torch.zeros(0, dtype=torch.uint8), T.Q4_K, (0, 256))
    assert got.shape == (0, 256)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pass_elems", [None, 768], ids=["one-pass", "many-passes"])
@pytest.mark.parametrize("qtype", FLOAT_TYPES + QUANT_TYPES, ids=lambda t: t.name)
def test_cuda_matches_reference(qtype, pass_elems, monkeypatch):
    if pass_elems is not None:
        monkeypatch.setattr(dequant, "_CUDA_PASS_ELEMS", pass_elems)
    shape = (2, 5, 512)
    raw = random_raw(qtype, shape)
    expected = reference(raw, qtype, shape)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize(torch.from_numpy(raw).cuda(), qtype, shape, dtype=dtype)
        assert got.device.type == "cuda" and got.dtype == dtype and got.shape == shape
        assert torch.equal(got.cpu(), expected.to(dtype))
