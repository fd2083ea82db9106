"""Tokens exactly as llama.cpp makes them: the GGUF vocabulary loaded by llama.cpp with no weights (vocab_only).

We use llama-cpp-python's public low-level bindings rather than its `Llama` class, which would also build an
inference context we never use.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import threading
from collections import deque

import llama_cpp

from kvchat.errors import GGUFError

_log_lock = threading.Lock()
_recent_log: deque[str] = deque(maxlen=20)


@llama_cpp.llama_log_callback
def _collect_log(level, text, user_data):  # noqa: ARG001 - ctypes signature
    # llama.cpp prints a page of load chatter to stderr; keep it for error messages instead.
    try:
        _recent_log.append(text.decode("utf-8", "replace").strip())
    except Exception:  # noqa: BLE001 - never raise into C
        pass


def quiet_llama_logs() -> None:
    """Route llama.cpp/ggml logging into a small buffer (idempotent; safe to call from any thread)."""
    with _log_lock:
        if not getattr(quiet_llama_logs, "done", False):
            llama_cpp.llama_log_set(_collect_log, ctypes.c_void_p(0))
            quiet_llama_logs.done = True


def last_llama_error() -> str:
    errors = [line for line in _recent_log if "error" in line.lower() or "failed" in line.lower()]
    return errors[-1] if errors else ""


class Tokenizer:
    def __init__(self, path: str | os.PathLike[str]):
        quiet_llama_logs()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(os.fspath(path).encode(), params)
        if not self._model:
            detail = last_llama_error()
            raise GGUFError(f"{path}: llama.cpp cannot read its vocabulary" + (f" ({detail})" if detail else ""))
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bos_id = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos_id = llama_cpp.llama_vocab_eos(self._vocab)
        # Every end-of-generation token llama.cpp knows (EOS, EOT, <|im_end|>, <|eot_id|>, ...).
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._lock = threading.Lock()

    def close(self) -> None:
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """`special`: control-token text such as <|im_start|> becomes its token (chat templates need this)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_bos, special)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def decode(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        """The token as written in the vocabulary (special tokens included), for templates and stop checks."""
        return self.piece(token, special=True).decode("utf-8", "replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they arrive without splitting a UTF-8 character across two tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        return self._utf8.decode(self._tok.piece(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
