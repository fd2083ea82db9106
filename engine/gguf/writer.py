"""Writing GGUF files: the project's own exporter (for the models we train and the models the tests build).

Tensors come in as float32 numpy arrays in torch order and are stored in the chosen type; 1-D tensors (norms,
biases, rope factors) always stay F32, as llama.cpp's converters do.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.gguf.dequant import byte_size
from kvchat.engine.text.vocab import ByteBPEVocab

WRITABLE_TYPES = (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0,
)
# llama.cpp's LLAMA_FTYPE for a file whose matrices are all of one type.
_FILE_TYPE = {
    GGMLQuantizationType.F32: 0, GGMLQuantizationType.F16: 1, GGMLQuantizationType.Q4_0: 2,
    GGMLQuantizationType.Q8_0: 7, GGMLQuantizationType.Q5_0: 8, GGMLQuantizationType.BF16: 32,
}


# A tensor given lazily: its torch-order shape and a function that makes the float32 array when it is written, so
# that an 8B-shaped file never has to sit in memory whole.
LazyTensor = tuple[tuple[int, ...], Callable[[], np.ndarray]]


def write_model_gguf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, np.ndarray | LazyTensor],
                     vocab: ByteBPEVocab, chat_template: str | None = None, name: str = "kvchat-model",
                     qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                     overrides: dict[str, GGMLQuantizationType] | None = None,
                     extra: Mapping[str, int | str] | None = None) -> None:
    """`qtype` is the type of every matrix; `overrides` sets it for single tensors (e.g. keep output.weight F32);
    `extra` adds metadata keys (ints as uint32, else strings), e.g. kvchat's own `kvchat.reply_cap`."""
    overrides = overrides or {}
    for t in {qtype, *overrides.values()}:
        if t not in WRITABLE_TYPES:
            raise ValueError(f"cannot write {t.name}; quantize an F32 file with llama.cpp for K-quants")
    lazy = {n: (tuple(v.shape), (lambda v=v: v)) if isinstance(v, np.ndarray) else v for n, v in tensors.items()}
    writer = GGUFWriter(os.fspath(path), cfg.arch)
    _write_metadata(writer, cfg, name, qtype)
    _write_vocab(writer, vocab, chat_template)
    for key, value in (extra or {}).items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, str(value))
    types = {}
    for tname, (shape, _) in lazy.items():
        types[tname] = GGMLQuantizationType.F32 if len(shape) == 1 else overrides.get(tname, qtype)
        writer.add_tensor_info(tname, shape, np.dtype(np.float32), byte_size(types[tname], shape), raw_dtype=types[tname])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tname, (shape, make) in lazy.items():
        writer.write_tensor_data(_encode(np.ascontiguousarray(make(), dtype=np.float32).reshape(shape), types[tname]))
    writer.close()


def _write_metadata(w: GGUFWriter, cfg: ModelConfig, name: str, qtype: GGMLQuantizationType) -> None:
    w.add_name(name)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(cfg.rope_dim)
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)


def _write_vocab(w: GGUFWriter, vocab: ByteBPEVocab, chat_template: str | None) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        w.add_bos_token_id(vocab.id_of(vocab.bos))
    if vocab.eos is not None:
        w.add_eos_token_id(vocab.id_of(vocab.eos))
    if vocab.eot is not None:
        w.add_eot_token_id(vocab.id_of(vocab.eot))
    w.add_add_bos_token(vocab.add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _encode(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return array
    if qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        # torch rounds to nearest-even like gguf's numpy code, but multi-threaded (an 8B file is 8e9 values)
        half = torch.float16 if qtype == GGMLQuantizationType.F16 else torch.bfloat16
        return torch.from_numpy(array).to(half).view(torch.int16).numpy().view(np.uint8)
    return gguf_quants.quantize(array, qtype)
