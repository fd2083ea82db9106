"""GGUF weights -> Transformer: every tensor's shape is checked against the config before anything is allocated,
then each is dequantized on the target device (raw bytes go to the GPU, the GPU dequantizes)."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.gguf.dequant import SUPPORTED_TYPES, dequantize
from kvchat.engine.gguf.numerics import gelu_fp16_table, input_rounding
from kvchat.engine.gguf.reader import GGUFFile, TensorInfo
from kvchat.engine.model.decoder import LayerWeights, Transformer, gelu_tanh, identity
from kvchat.engine.model.quantized import QuantizedMatrix
from kvchat.errors import GGUFError
from kvchat.kernels.quant_gemv import QUANT_GEMV_TYPES, repack


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Transformer
    gguf: GGUFFile
    load_seconds: float
    numerics: str
    # Quant types a matrix of this file came in that have no decode kernel, so were dequantized at load although
    # the rest stays quantized (engine.model.quantized): said once, by whoever loads the model for a user.
    dequantized_types: tuple[str, ...] = ()


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # fp32 on the CPU keeps us within 1e-3 of llama.cpp; bf16 on CUDA is what the tensor cores want.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, q_dim, kv_dim = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, d)
    if cfg.llama3_rope:
        shapes["rope_freqs.weight"] = (cfg.rope_dim // 2,)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (q_dim, d), p + "attn_k.weight": (kv_dim, d),
            p + "attn_v.weight": (kv_dim, d), p + "attn_output.weight": (d, q_dim), p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (cfg.ffn_dim, d), p + "ffn_up.weight": (cfg.ffn_dim, d),
            p + "ffn_down.weight": (d, cfg.ffn_dim),
        })
        if cfg.qkv_bias:
            shapes.update({p + "attn_q.bias": (q_dim,), p + "attn_k.bias": (kv_dim,), p + "attn_v.bias": (kv_dim,)})
        if cfg.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
        if cfg.post_norms:
            shapes.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    return shapes


def check_tensors(gf: GGUFFile, cfg: ModelConfig) -> None:
    for name, shape in expected_shapes(cfg).items():
        t = gf.tensors.get(name)
        if t is None:
            raise GGUFError(f"{gf.path}: tensor {name} is missing")
        if t.shape != shape:
            raise GGUFError(f"{gf.path}: tensor {name} has shape {list(t.shape)}, the metadata implies {list(shape)}")
        if t.qtype not in SUPPORTED_TYPES:
            names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise GGUFError(f"{gf.path}: tensor {name} has unsupported type {t.qtype.name} (supported: {names})")


def placed_bytes(gf: GGUFFile, cfg: ModelConfig, element_size: int, quantized: bool) -> tuple[int, int]:
    """(bytes, tensors) of the file's weights as `load_model` places them, without loading them: matrices it keeps
    in their blocks (`quantized`, a type with a decode kernel) at their stored size, other matrices at
    `element_size` bytes a weight, vectors in fp32. The fused matrices (q, k, v; gate, up) count as one tensor,
    kept in blocks only if every part can be."""
    fused = [tuple(f"blk.{i}.{n}.weight" for n in group) for i in range(cfg.n_layers)
             for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))]
    names = set(expected_shapes(cfg)) - {n for group in fused for n in group}
    total, groups = 0, fused + [(name,) for name in sorted(names)]
    for group in groups:
        infos = [gf.tensors[n] for n in group]
        if all(keeps_quantized(t, quantized) for t in infos):
            total += sum(int(t.data.nbytes) for t in infos)
        else:
            total += sum(int(np.prod(t.shape)) * (4 if len(t.shape) == 1 else element_size) for t in infos)
    return total, len(groups)


def check_memory(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, gf: GGUFFile, quantized: bool) -> None:
    """Refuse a model whose weights cannot fit (`placed_bytes`)."""
    need, _ = placed_bytes(gf, cfg, torch.tensor([], dtype=dtype).element_size(), quantized)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_ram()
    if free and need > free:
        raise GGUFError(f"{gf.path}: the weights need {need / 2**30:.1f} GiB as {str(dtype).removeprefix('torch.')} "
                        f"on {device.type}, only {free / 2**30:.1f} GiB is free")


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def raw_bytes(t: TensorInfo, device: torch.device) -> torch.Tensor:
    """The tensor's stored bytes on `device`, uint8 [rows, row bytes]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the memory map is read-only; we only read it
        raw = torch.from_numpy(t.data.reshape(-1).view(np.uint8))
    return raw.to(device, non_blocking=False).view(t.shape[0] if len(t.shape) > 1 else 1, -1)


def read_tensor(t: TensorInfo, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(raw_bytes(t, device).reshape(-1), t.qtype, t.shape, dtype)


# Types that are no quantization: a BF16/F16/F32 file keeps today's path, with nothing to say about it.
FLOATS = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def keeps_quantized(t: TensorInfo, quantized: bool) -> bool:
    """Whether a matrix stays in its file's blocks: asked for, and its type has a decode kernel (any other type is
    dequantized at load, as before)."""
    return quantized and t.qtype in QUANT_GEMV_TYPES and len(t.shape) == 2


NUMERICS = ("llama.cpp", "exact")


def default_numerics(device: torch.device, dtype: torch.dtype) -> str:
    # In fp32 on the CPU we round activations as llama.cpp's CPU back end does, so the two give the same tokens;
    # in bf16/fp16 the activations are already rounded more coarsely and there is nothing to imitate.
    return "llama.cpp" if device.type == "cpu" and dtype == torch.float32 else "exact"


def load_model(path: str | os.PathLike[str], device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, numerics: str | None = None,
               quantized: bool | None = None) -> LoadedModel:
    """numerics: "llama.cpp" rounds each matrix product's input the way llama.cpp's CPU back end does for that
    weight type (engine.gguf.numerics); "exact" multiplies by the dequantized weights as they are.
    quantized: keep the matrices in their GGUF blocks (engine.model.quantized), where their type has a decode
    kernel; default: on CUDA (on the CPU the kernels have no compiled path, and llama.cpp's numerics need the
    dequantized weights)."""
    started = time.perf_counter()
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    numerics = numerics or default_numerics(device, dtype)
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r} (accepted: {', '.join(NUMERICS)})")
    if quantized is None:
        quantized = device.type == "cuda"
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    check_tensors(gf, cfg)
    check_memory(cfg, device, dtype, gf, quantized)

    def get(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return read_tensor(gf.tensors[name], device, as_dtype)

    fallbacks: set[str] = set()

    def matrix(*names: str) -> torch.Tensor | QuantizedMatrix:
        """Rows of the named matrices stacked (a fused product): their file's blocks when each type has a decode
        kernel, else dequantized."""
        infos = [gf.tensors[n] for n in names]
        if all(keeps_quantized(t, quantized) for t in infos):
            # Repacked on the device: the file's bytes go over once, and the field arrays replace them.
            parts = [repack(raw_bytes(t, device), t.qtype, t.shape[1]) for t in infos]
            return QuantizedMatrix(parts, infos[0].shape[1], dtype)
        if quantized:
            fallbacks.update(t.qtype.name for t in infos if t.qtype not in QUANT_GEMV_TYPES and t.qtype not in FLOATS)
        return torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])

    def rounding(*names: str):
        rule = input_rounding([gf.tensors[n].qtype for n in names]) if numerics == "llama.cpp" else None
        return rule or identity

    def optional(name: str, wanted: bool) -> torch.Tensor | None:
        return get(name, torch.float32) if wanted else None

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([get(p + "attn_q.bias"), get(p + "attn_k.bias"), get(p + "attn_v.bias")])
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight", torch.float32),
            wqkv=matrix(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
            bqkv=bias,
            wo=matrix(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight", torch.float32),
            w_gate_up=matrix(p + "ffn_gate.weight", p + "ffn_up.weight"),
            w_down=matrix(p + "ffn_down.weight"),
            round_qkv=rounding(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
            round_wo=rounding(p + "attn_output.weight"),
            round_gate_up=rounding(p + "ffn_gate.weight", p + "ffn_up.weight"),
            round_down=rounding(p + "ffn_down.weight"),
            q_norm=optional(p + "attn_q_norm.weight", cfg.qk_norm),
            k_norm=optional(p + "attn_k_norm.weight", cfg.qk_norm),
            post_attn_norm=optional(p + "post_attention_norm.weight", cfg.post_norms),
            post_ffn_norm=optional(p + "post_ffw_norm.weight", cfg.post_norms),
            gelu=gelu_fp16_table if numerics == "llama.cpp" else gelu_tanh,
        ))
    model = Transformer(
        cfg,
        tok_embeddings=matrix("token_embd.weight"),
        layers=layers,
        output_norm=get("output_norm.weight", torch.float32),
        output=None if cfg.tied_output else matrix("output.weight"),
        freq_factors=get("rope_freqs.weight", torch.float32) if cfg.llama3_rope else None,
        round_output=rounding("token_embd.weight" if cfg.tied_output else "output.weight"),
    ).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return LoadedModel(cfg, model, gf, time.perf_counter() - started, numerics, tuple(sorted(fallbacks)))
