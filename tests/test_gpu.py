"""CUDA runs: bf16 and fp16 close to llama.cpp's fp32 logits, and generation on the GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvchat.engine.engine import Engine
from kvchat.engine.parity import compare
from kvchat.engine.synthetic import REFERENCE_PROMPT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", [dict(qtype=Q.F16), dict(qtype=Q.Q4_K), dict(arch="qwen2", style="chatml")])
def test_half_precision_on_cuda_is_close_to_llama_cpp(models, dtype, spec):
    parity = compare(models.get(**spec), REFERENCE_PROMPT, device="cuda", dtype=dtype, greedy_steps=16)
    # bf16 keeps 8 bits of mantissa: ~1e-2 of the largest logit is the expected size of the difference.
    assert parity.relative_error < (3e-2 if dtype == torch.bfloat16 else 5e-3)


def test_generation_on_cuda(models):
    engine = Engine(models.get(), device="cuda")
    out = engine.complete(engine.encode_prompt(REFERENCE_PROMPT), max_tokens=16)
    assert len(out.tokens) == 16 and engine.model.tok_embeddings.is_cuda
