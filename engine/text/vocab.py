"""Byte-level BPE vocabularies in llama.cpp's `gpt2` tokenizer format, and a small deterministic trainer.

We only *write* vocabularies here (for the models we build and the test models); tokenizing is always done by
llama.cpp reading the vocabulary back from the GGUF file, so what we ship is exactly what llama.cpp reproduces.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise

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
        counts = Counter()
        for text in texts:
            counts.update(_WORDS.findall(text))
        # each distinct word spelt in the byte alphabet once (distinct words have distinct spellings)
        words = Counter({tuple(b2u[b] for b in w.encode("utf-8")): c for w, c in counts.items()})
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
    """The most frequent adjacent pair, merged everywhere, `n_merges` times. The pair counts are kept up to date by
    recounting only the words a merge changes (the ones holding its pair), which gives the very merges a recount of
    every word after each merge gives, in a fraction of the time."""
    items = [(w, c) for w, c in words.items() if len(w) > 1]
    pairs: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}  # pair -> the words (indices into items) holding it
    for i, (w, c) in enumerate(items):
        for pair in pairwise(w):
            pairs[pair] += c
            where.setdefault(pair, set()).add(i)
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        if not pairs:
            break
        top = max(pairs.values())  # ties broken by the pair itself: deterministic
        best = max(pair for pair, n in pairs.items() if n == top)
        merges.append(best)
        joined = best[0] + best[1]
        for i in sorted(where[best]):
            w, c = items[i]
            merged = _merge(w, best, joined)
            before, after = Counter(pairwise(w)), Counter(pairwise(merged))
            for pair, n in before.items():
                pairs[pair] -= n * c
                if not pairs[pair]:
                    del pairs[pair]
                if pair not in after:
                    where[pair].discard(i)
            for pair, n in after.items():
                pairs[pair] += n * c
                where.setdefault(pair, set()).add(i)
            items[i] = (merged, c)
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
