"""Model fingerprints: which weights, tokenizer and chat template a stored KV cache belongs to.

The GGUF file holds all three (the vocabulary and template are metadata), so the fingerprint is the sha256 of the
whole file together with our KV format version. Hashing a multi-GB file takes seconds, so the file's hash is cached
in the store by (path, size, mtime).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvchat.storage.db import Store

KV_FORMAT_VERSION = 1


def file_sha256(path: Path, store: Store | None = None) -> str:
    path = Path(path).resolve()
    st = path.stat()
    if store is not None:
        cached = store.cached_file_hash(path, st.st_size, st.st_mtime_ns)
        if cached:
            return cached
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    value = digest.hexdigest()
    if store is not None:
        store.remember_file_hash(path, st.st_size, st.st_mtime_ns, value)
    return value


def model_fingerprint(path: Path, store: Store | None = None) -> str:
    return hashlib.sha256(f"kvchat-kv-v{KV_FORMAT_VERSION}:{file_sha256(path, store)}".encode()).hexdigest()
