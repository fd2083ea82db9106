"""The engine a caller holds: model weights, tokenizer and chat format of one GGUF file."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from kvchat.engine.generate import GenerationResult, TokenCallback, generate
from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.gguf.loader import load_model
from kvchat.engine.gguf.reader import GGUFFile
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.decoder import Transformer
from kvchat.engine.reply_guard import ReplyGuard
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.text.chat_format import FORMAT_TEMPLATE, ChatFormat, chat_format_kind, chat_template
from kvchat.engine.text.tokenizer import Tokenizer
from kvchat.errors import ContextOverflowError


@dataclass
class ModelInfo:
    """What `kvchat info` prints; needs only the metadata, not the weights."""

    path: str
    config: ModelConfig
    name: str
    tensor_types: dict[str, int]
    # How chats are put to the model (engine.text.chat_format: its template, Gemma's turns, or a base model's
    # plain transcript)
    chat_format: str = FORMAT_TEMPLATE

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "ModelInfo":
        gf = GGUFFile(path)
        cfg = ModelConfig.from_gguf(gf)
        types: dict[str, int] = {}
        for t in gf.tensors.values():
            types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
        return cls(os.fspath(path), cfg, str(gf.metadata.get("general.name", "")), types,
                   chat_format_kind(gf.metadata))


class Engine:
    def __init__(self, path: str | os.PathLike[str], device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, numerics: str | None = None, quantized: bool | None = None):
        """`quantized`: keep matrices in their GGUF blocks (default: on CUDA; engine.gguf.loader.load_model)."""
        loaded = load_model(path, device, dtype, numerics, quantized)
        self.numerics = loaded.numerics
        self.path = os.fspath(path)
        self.config: ModelConfig = loaded.config
        self.model: Transformer = loaded.model
        self.load_seconds = loaded.load_seconds
        self.dequantized_types = loaded.dequantized_types  # quant types without a decode kernel (engine.gguf.loader)
        self.tokenizer = Tokenizer(path)
        self.chat = ChatFormat(self.tokenizer, chat_template(loaded.gguf.metadata))
        self.metadata = loaded.gguf.metadata
        self.chat_format = chat_format_kind(self.metadata)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, capacity: int = 256, ring: bool = False) -> KVCache:
        """`ring`: sliding-window layers keep only their window in a ring (a chat's cache; see KVCache)."""
        return self.model.new_cache(capacity, ring=ring)

    def encode_prompt(self, text: str) -> list[int]:
        tokens = self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos, special=True)
        if not tokens:
            raise ContextOverflowError("the prompt is empty")
        return tokens

    def complete(self, prompt: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
                 on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
                 cache: KVCache | None = None, stop_strings: tuple[str, ...] = (),
                 guard: ReplyGuard = ReplyGuard()) -> GenerationResult:
        cache = cache if cache is not None else self.new_cache(len(prompt) + max_tokens, ring=True)
        return generate(self.model, cache, prompt, decoder=self.tokenizer.stream_decoder(), max_tokens=max_tokens,
                        sampling=sampling, stop_tokens=self.tokenizer.eog_ids, stop_strings=stop_strings,
                        on_token=on_token, cancel=cancel, **self.guarding(guard))

    def guarding(self, guard: ReplyGuard) -> dict:
        """generate()'s guard arguments for this model: the loop check and the model's reply cap."""
        return {"guard": guard if guard.enabled else None, "reply_cap": guard.cap_for(self.metadata)}
