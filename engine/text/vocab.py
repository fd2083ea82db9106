"""Byte-level BPE vocabularies in llama.cpp's `gpt2` tokenizer format, and a small deterministic trainer.

We only *write* vocabularies here (for the models we build and the test models); tokenizing is always done by
llama.cpp reading the vocabulary back from the GGUF file, so what we ship is exactly what llama.cpp reproduces.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

# llama.cpp token types
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# Roughly GPT-2's pre-tokenizer with ASCII classes; llama.cpp applies its own regex when tokenizing, so this only
# shapes which merges are learned, never whether tokenization is exact.
_WORDS = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (BPE tokens are stored in this alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@dataclass
class ByteBPEVocab:
    tokens: list[str]  # in GPT-2 byte alphabet, specials verbatim
    token_types: list[int]
    merges: list[str]  # "left right", in rank order
    special_ids: dict[str, int] = field(default_factory=dict)
    bos: str | None = None
    eos: str | None = None
    eot: str | None = None
    add_bos: bool = False
    pre: str = "default"  # llama.cpp pre-tokenizer name

    @classmethod
    def train(cls, texts: list[str], n_merges: int, specials: list[str], **kw) -> "ByteBPEVocab":
        b2u = byte_to_unicode()
        words = Counter()
        for text in texts:
            for w in _WORDS.findall(text):
                words[tuple(b2u[b] for b in w.encode("utf-8"))] += 1
        merges = _learn_merges(words, n_merges)
        tokens = [b2u[b] for b in range(256)] + [a + b for a, b in merges]
        types = [NORMAL] * len(tokens)
        special_ids = {}
        for s in specials:
            special_ids[s] = len(tokens)
            tokens.append(s)
            types.append(CONTROL)
        return cls(tokens, types, [f"{a} {b}" for a, b in merges], special_ids, **kw)

    def id_of(self, token: str | None) -> int | None:
        return None if token is None else self.special_ids[token]


def _learn_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    words = {w: c for w, c in words.items() if len(w) > 1}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]  # ties broken by the pair itself: deterministic
        merges.append(best)
        joined = best[0] + best[1]
        words = {_merge(w, best, joined): c for w, c in words.items()}
        words = {w: c for w, c in words.items() if len(w) > 1}
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str], joined: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
