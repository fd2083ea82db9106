"""The model's shape, read from GGUF metadata keys (no table of model names)."""

from __future__ import annotations

from dataclasses import dataclass, asdict
from typing import Any

from kvchat.engine.gguf_file import SUPPORTED_ARCHS, GGUFFile
from kvchat.errors import GGUFError


# llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) for `llama` (its converter permutes Q/K to match) and the two
# halves (x[i], x[i + d/2]) for `qwen2`: LLAMA_ROPE_TYPE_NORM vs LLAMA_ROPE_TYPE_NEOX.
_NEOX_ROPE = {"llama": False, "qwen2": True}

# Bounds that no real decoder exceeds; past them the metadata is garbled and we refuse before allocating.
_LIMITS = {
    "n_layers": 512,
    "d_model": 65_536,
    "n_heads": 1024,
    "head_dim": 1024,
    "ffn_dim": 1 << 20,
    "vocab_size": 1 << 22,
    "context_length": 1 << 24,
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int  # leading dims of each head that are rotated
    rope_neox: bool
    rope_freq_scale: float  # linear rope scaling: positions are multiplied by this
    qkv_bias: bool
    tied_output: bool
    llama3_rope: bool  # per-dimension frequency factors from the file's rope_freqs tensor

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ModelConfig":
        md, name = gf.metadata, gf.path
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(f"{name}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def key(suffix: str, default: Any = None, kind: type = int) -> Any:
            value = md.get(f"{arch}.{suffix}", default)
            if value is None:
                raise GGUFError(f"{name}: metadata key {arch}.{suffix} is missing")
            if isinstance(value, list) or isinstance(value, str) or isinstance(value, bool):
                raise GGUFError(f"{name}: metadata key {arch}.{suffix} has an unexpected value {str(value)[:40]!r}")
            return kind(value)

        d_model = key("embedding_length")
        n_heads = key("attention.head_count")
        n_kv_heads = key("attention.head_count_kv", n_heads)
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise GGUFError(f"{name}: {n_heads} attention heads cannot be shared by {n_kv_heads} KV heads")
        head_dim = key("attention.key_length", d_model // n_heads if d_model % n_heads == 0 else 0)
        if key("attention.value_length", head_dim) != head_dim:
            raise GGUFError(f"{name}: different key and value head sizes are not supported")
        embd = gf.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{name}: tensor token_embd.weight is missing")
        vocab_size = key("vocab_size", embd.shape[0])
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear") and not (scaling == "llama3"):
            raise GGUFError(f"{name}: unsupported rope scaling {scaling!r} (supported: none, linear, llama3)")
        cfg = cls(
            arch=arch,
            n_layers=key("block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn_dim=key("feed_forward_length"),
            vocab_size=vocab_size,
            context_length=key("context_length", 4096),
            rms_eps=key("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_base=key("rope.freq_base", 10000.0, float),
            rope_dim=key("rope.dimension_count", head_dim),
            rope_neox=_NEOX_ROPE[arch],
            rope_freq_scale=1.0 / factor if scaling == "linear" else 1.0,
            qkv_bias="blk.0.attn_q.bias" in gf.tensors,
            tied_output="output.weight" not in gf.tensors,
            llama3_rope="rope_freqs.weight" in gf.tensors,
        )
        cfg.validate(str(name))
        return cfg

    def validate(self, name: str = "model") -> None:
        for field, limit in _LIMITS.items():
            value = getattr(self, field)
            if not 0 < value <= limit:
                raise GGUFError(f"{name}: absurd {field} = {value} in the metadata (expected 1 to {limit})")
        if self.rope_dim <= 0 or self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise GGUFError(f"{name}: rope dimension {self.rope_dim} does not fit head size {self.head_dim}")
        if not (self.rms_eps > 0 and self.rope_base > 0):
            raise GGUFError(f"{name}: non-positive rms epsilon or rope base in the metadata")
