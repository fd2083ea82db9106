"""Issue 41's measuring tools for quantized weights: `kvchat bench engine --qtype` in every type the bench makes
(llama.cpp's quantizer, cached), its per-context peak GPU memory, and docs/probes/quant_agreement.py (the same file
kept in its blocks against dequantized at load: top-1 agreement and logit differences, prefill and decode apart).

The probe runs here on small models on the CPU, through the bands every product dequantizes (that a quantized
model's decode runs the GEMV kernels, in triton's interpreter, is test_quant_gemv's), and on CUDA through the
captured decode step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvchat.app.bench import engine_speed
from kvchat.kernels.quant_gemv import QUANT_GEMV_TYPES

PROBE = Path(__file__).resolve().parents[1] / "docs" / "probes" / "quant_agreement.py"
# test_quant_gemv's first and last models (built once per run for both files); the second's output is its token table
Q4_MODEL = {"qtype": Q.Q4_K}
QWEN3_Q8 = {"arch": "qwen3", "style": "chatml", "qtype": Q.Q8_0, "tied": True}


def probe():
    spec = importlib.util.spec_from_file_location("quant_agreement", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- bench engine --qtype ---------------------------------------------------------------------------------------

def test_the_bench_types_are_llama_cpps_file_types():
    import llama_cpp

    from kvchat.app.bench.commands import BENCH_QTYPES

    assert BENCH_QTYPES == ["BF16", *engine_speed.QTYPES]  # the CLI's choices: no torch import to name them
    assert engine_speed.QTYPES == {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
                                   "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
                                   "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


@pytest.fixture
def small_shapes(monkeypatch):
    """model_file builds a small model wherever it would build a shape's BF16 file (the real shapes are GBs)."""
    from kvchat.engine.train.synthetic import make_model

    built = []

    def small(path, shape, qtype):
        built.append((shape, qtype))
        return make_model(path, qtype=qtype, keep_output_f32=False)

    monkeypatch.setattr(engine_speed, "make_shaped_model", small)
    return built


def test_each_quantized_type_is_made_by_llama_cpp_once_and_kept(small_shapes, tmp_path, monkeypatch):
    from kvchat.engine.gguf.reader import GGUFFile

    quantize = engine_speed.llama_quantize
    calls = []
    monkeypatch.setattr(engine_speed, "llama_quantize", lambda *a, **k: (calls.append(a[2]), quantize(*a, **k)))
    # The types each file's matrices come in: llama.cpp's own mixes (the _M types keep some in a larger type).
    want = {"Q4_K_M": {Q.Q4_K, Q.Q6_K}, "Q5_K_M": {Q.Q5_K, Q.Q6_K}, "Q6_K": {Q.Q6_K}, "Q8_0": {Q.Q8_0}}
    for qtype, ftype in engine_speed.QTYPES.items():
        path = engine_speed.model_file(tmp_path, "llama-3.2-1b", qtype)
        assert path == tmp_path / f"llama-3.2-1b-{qtype}.gguf" and calls[-1] == ftype
        types = {t.qtype for name, t in GGUFFile(path).tensors.items() if len(t.shape) == 2}
        assert types == want[qtype], (qtype, types)
        assert engine_speed.model_file(tmp_path, "llama-3.2-1b", qtype) == path  # cached: not quantized again
    assert len(calls) == 4 and small_shapes == [("llama-3.2-1b", Q.BF16)]  # one BF16 source for all four
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="Q5_K_M"):
        engine_speed.model_file(tmp_path, "llama-3.2-1b", "Q3_K_M")


def test_bench_engine_takes_the_new_types_and_reports_per_context_memory(small_shapes, tmp_path):
    from cli_run import kvchat

    out = tmp_path / "engine.json"
    shown = kvchat("bench", "engine", "--shape", "llama-3.2-1b", "--qtype", "Q5_K_M", "--weights", "both",
                   "--context", "48", "--device", "cpu", "--cache-dir", str(tmp_path / "models"),
                   "--json", str(out)).stdout
    dequantized, quantized = json.loads(out.read_text())
    assert dequantized["qtype"] == quantized["qtype"] == "Q5_K_M"
    assert (dequantized["weights"], quantized["weights"]) == ("dequantized", "quantized")
    # A type without a decode kernel is dequantized at load, and said (Q5_K had none at first); the rest stays in
    # its blocks.
    without = [] if Q.Q5_K in QUANT_GEMV_TYPES else ["Q5_K"]
    assert quantized["dequantized_types"] == without and dequantized["dequantized_types"] == []
    assert ("Q5_K matrices dequantized at load" in shown) == bool(without)
    assert quantized["weights_gib"] < dequantized["weights_gib"]
    ctx = quantized["contexts"][0]
    assert ctx["context"] == 48 and ctx["decode_tokens_per_s"] > 0
    assert ctx["peak_gpu_gib"] is None and ctx["peak_reserved_gib"] is None  # the CPU: no such figure
    assert "| context | prefill tok/s | decode tok/s |" in shown and "| 48 |" in shown


def test_bench_engine_refuses_an_unknown_type():
    from cli_run import kvchat

    proc = kvchat("bench", "engine", "--qtype", "Q3_K_M", check=False)
    assert proc.returncode != 0 and "Q3_K_M" in proc.stderr and "Q8_0" in proc.stderr


@pytest.mark.gpu
def test_gpu_peak_memory_per_context(models):
    """Each context's peak is its own (the allocator's peak reset before it), the model included, never above the
    whole run's; reserved memory holds the allocated."""
    figures = engine_speed.bench_file(models.get(**Q4_MODEL), "small", "Q4_K", [64, 512], "cuda", log=lambda s: None,
                                      quantized=True)
    weights = figures.weights_gib
    for c in figures.contexts:
        assert weights < c.peak_gpu_gib <= c.peak_reserved_gib and c.peak_gpu_gib <= figures.peak_gpu_gib
    assert figures.contexts[0].peak_gpu_gib < figures.contexts[1].peak_gpu_gib  # a longer context takes more


# --- the agreement probe ----------------------------------------------------------------------------------------

def test_compare_counts_agreement_where_the_reference_is_sure():
    compare = probe().compare
    reference = torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.02, 0.0], [0.0, 2.0, 1.0], [5.0, 0.0, 4.9]])
    got = torch.tensor([[3.0, 1.0, 0.0], [1.1, 1.0, 0.0], [0.0, 1.0, 1.5], [5.0, 0.0, 4.9]])
    r = compare(reference, got, margin=0.05)
    # Row 1 is a near-tie (0.02 apart): its flip does not count; row 2 is sure (1.0 apart) and flips.
    assert r["positions"] == 4 and r["confident_positions"] == 3 and r["confident_disagreements"] == 1
    assert r["top1_agreement"] == pytest.approx(2 / 3) and r["top1_agreement_all_positions"] == 0.5
    assert r["max_abs_logit_diff"] == pytest.approx(1.0) and r["mean_abs_logit_diff"] == pytest.approx(1.62 / 12)
    assert compare(reference[1:2], got[1:2])["top1_agreement"] is None  # no sure position: no figure


def check_probe(path, positions: int, decode: int, monkeypatch, **kw) -> dict:
    """The probe on the CPU in fp32, counting the one-row products of matrices kept in their blocks."""
    from kvchat.engine.model.quantized import QuantizedMatrix

    rows = []
    real = QuantizedMatrix.linear
    monkeypatch.setattr(QuantizedMatrix, "linear", lambda self, x, bias=None, xq=None: (rows.append(x.shape[0]),
                                                                                         real(self, x, bias, xq))[1])
    result = probe().agreement(path, "cpu", positions=positions, decode=decode, **kw)
    json.dumps(result)
    assert result["matrices_kept_quantized"] > 0 and result["dequantized_types"] == []
    assert result["prefill"]["positions"] == positions and result["decode"]["positions"] == decode
    # The same weights, products summed in another order (float32): the same answers.
    for part in ("prefill", "decode"):
        figures = result[part]
        assert figures["confident_positions"] > 0 and figures["top1_agreement"] == 1.0, figures
        assert figures["max_abs_logit_diff"] < 1e-3 and figures["mean_abs_logit_diff"] < 1e-4
    assert rows.count(1) >= decode * 4  # each decoded token: one-row products (q/k/v, o, gate/up, down per layer)
    assert positions in rows  # the prefill: one product of every position
    return result


def test_the_probe_on_the_cpu_without_kernels(models, monkeypatch):
    check_probe(models.get(**Q4_MODEL), 96, 12, monkeypatch)


def test_the_probe_follows_the_reference_s_greedy_tokens(models, monkeypatch):
    module = probe()
    from kvchat.engine.gguf.loader import load_model

    path = models.get(**QWEN3_Q8)
    result = check_probe(path, 40, 6, monkeypatch, source="greedy", seed=3)
    assert result["source"] == "greedy"
    model = load_model(path, "cpu", numerics="exact", quantized=False).model
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, model.cfg.vocab_size, (16,), generator=gen)
    tokens = module.greedy_tokens(model, prefix, 40)
    assert tokens[:16].tolist() == prefix.tolist() and len(tokens) == 40
    prefill, _ = module.path_logits(model, tokens, 6)
    assert tokens[16:].tolist() == prefill[15:-1].argmax(-1).tolist()  # each token: the argmax after the last


def test_the_probe_refuses_what_it_cannot_measure(models):
    module = probe()
    with pytest.raises(ValueError, match="decode"):
        module.agreement(models.get(**Q4_MODEL), "cpu", positions=8, decode=8)
    with pytest.raises(ValueError, match="context"):
        module.agreement(models.get(**Q4_MODEL), "cpu", positions=4096, decode=8)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [Q4_MODEL, QWEN3_Q8], ids=str)
def test_gpu_probe_through_the_captured_decode(models, spec):
    """On CUDA the decode positions run the captured step (the GEMVs in a CUDA graph); in float32 the two kinds of
    weights differ only in how sums are ordered."""
    result = probe().agreement(models.get(**spec), "cuda", torch.float32, positions=256, decode=32)
    assert result["cuda_graph"] and result["matrices_kept_quantized"] > 0
    for part in ("prefill", "decode"):
        # (test_quant_gemv's bound for these models' logits: 1e-3 plus 1e-3 of each logit)
        assert result[part]["top1_agreement"] == 1.0 and result[part]["max_abs_logit_diff"] < 1e-2, result[part]
