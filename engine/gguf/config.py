"""The model's shape, read from GGUF metadata keys (no table of model names)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvchat.engine.gguf.reader import SUPPORTED_ARCHS, GGUFFile
from kvchat.errors import GGUFError

# llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) for `llama` (its converter permutes Q/K to match) and the two
# halves (x[i], x[i + d/2]) for the others: LLAMA_ROPE_TYPE_NORM vs LLAMA_ROPE_TYPE_NEOX.
_NEOX_ROPE = {"llama": False, "qwen2": True, "qwen3": True, "gemma3": True}
# Gemma 3's sliding-window layers: llama.cpp fixes their pattern (five local layers, then one global: its
# set_swa_pattern(6)) and their RoPE (base 10,000, no scaling) in code, not in the file's metadata.
GEMMA3_SWA_PATTERN = 6
GEMMA3_SWA_ROPE_BASE = 10_000.0

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
    # Qwen 3 and Gemma 3 additions; the defaults are Llama/Qwen 2's.
    qk_norm: bool = False  # RMSNorm of each query and key head (weights [D]) before RoPE
    post_norms: bool = False  # Gemma: RMSNorm of the attention's and the MLP's outputs before each residual add
    gelu_ffn: bool = False  # Gemma: GELU (tanh approximation) gates the MLP instead of SiLU
    embed_scale: float = 1.0  # Gemma: embeddings are multiplied by sqrt(d_model)
    attn_scale: float = 0.0  # softmax scale of q.k; 0 means 1/sqrt(head_dim)
    sliding_window: int = 0  # keys a sliding-window layer sees (itself included); 0: no such layers
    swa_pattern: int = 0  # layer i slides iff i % swa_pattern < swa_pattern - 1
    rope_base_swa: float = 0.0  # the sliding layers' RoPE base (unscaled); 0: the same table as the others
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when set

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int:
        """Keys the layer's attention reaches back (0: all of them)."""
        if self.sliding_window and self.swa_pattern and layer % self.swa_pattern < self.swa_pattern - 1:
            return self.sliding_window
        return 0

    @property
    def global_layers(self) -> list[int]:
        """The layers that attend to the whole chat (all of them without sliding windows)."""
        return [i for i in range(self.n_layers) if not self.window(i)]

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
            qk_norm=arch in ("qwen3", "gemma3"),
            **(_gemma3_fields(key, n_heads, head_dim, d_model) if arch == "gemma3" else {}),
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
        if self.sliding_window < 0 or self.sliding_window > self.context_length:
            raise GGUFError(f"{name}: sliding window {self.sliding_window} outside the context of "
                            f"{self.context_length} tokens")
        if self.final_softcap < 0 or self.attn_scale < 0 or not self.embed_scale > 0:
            raise GGUFError(f"{name}: negative logit soft-cap, attention scale or embedding scale in the metadata")


def _gemma3_fields(key, n_heads: int, head_dim: int, d_model: int) -> dict[str, Any]:
    """What llama.cpp's gemma3 graph adds to a Llama layer, read as it reads it (llama_load_hparams for GEMMA3)."""
    window = key("attention.sliding_window", 0)
    n_layers = key("block_count")
    return dict(
        post_norms=True, gelu_ffn=True, embed_scale=math.sqrt(d_model),
        # Gemma 3 27B (62 layers) scales queries by 1/sqrt(d_model / n_heads), the others by 1/sqrt(head size).
        attn_scale=1.0 / math.sqrt(d_model / n_heads if n_layers == 62 else head_dim),
        sliding_window=window, swa_pattern=GEMMA3_SWA_PATTERN if window else 0,
        rope_base_swa=GEMMA3_SWA_ROPE_BASE if window else 0.0,
        final_softcap=key("final_logit_softcapping", 0.0, float),
    )
