"""Bad GGUF files and bad arguments: one line naming the problem, a non-zero exit, no traceback, no hang."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cli_run import kvchat as run_kvchat
from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.engine import Engine
from kvchat.engine.gguf.writer import write_model_gguf
from kvchat.engine.train.synthetic import llama_quantize, make_vocab
from kvchat.errors import GGUFError


def kvchat(*args: str) -> subprocess.CompletedProcess:
    return run_kvchat(*args, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, status: int = 1) -> None:
    """One line naming the problem, with the exit status of a user's error (1; 2 for usage): never the CLI's last
    line of defence ("internal error", 70), which would mean an unexpected exception got that far."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvchat: error: ")
    assert "internal error" not in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.returncode == status, (proc.returncode, lines[0])
    for needle in needles:
        assert needle in lines[0], lines[0]


def base_config(**changes) -> ModelConfig:
    vocab, _ = make_vocab("llama3")
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                      vocab_size=len(vocab.tokens), context_length=64, rms_eps=1e-5, rope_base=10000.0, rope_dim=64,
                      rope_neox=False, rope_freq_scale=1.0, qkv_bias=False, tied_output=True, llama3_rope=False)
    return replace(cfg, **changes)


def write_header_only(path: Path, cfg: ModelConfig) -> Path:
    """Metadata that claims `cfg` over a single small embedding tensor."""
    vocab, _ = make_vocab("llama3")
    import numpy as np

    write_model_gguf(path, cfg, {"token_embd.weight": np.zeros((len(vocab.tokens), 256), np.float32)}, vocab)
    return path


@pytest.mark.parametrize("cmd", ["generate", "info"])
def test_missing_file(tmp_path, cmd):
    args = [cmd, "--model", str(tmp_path / "nope.gguf")] + (["hi"] if cmd == "generate" else [])
    assert_one_line_error(kvchat(*args), "no such file")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am a text file\n" * 10)
    assert_one_line_error(kvchat("info", "--model", str(path)), "not a GGUF file")


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.3, 0.9, 0.9999])
def test_truncated(tmp_path, models, fraction):
    src = models.get()
    data = src.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: max(1, int(len(data) * fraction))])
    assert_one_line_error(kvchat("generate", "--model", str(path), "hi"), f"{path}: truncated GGUF file: it holds "
                          f"{path.stat().st_size:,} bytes, its metadata and tensors need at least")


def test_an_unexpected_exception_on_a_bad_input_path_fails_these_checks(tmp_path, models, monkeypatch):
    """The checks above tell a user's error from a bug: an exception no one expected, where a truncated file is
    read, reaches the CLI's last line of defence ("internal error", exit 70), and they fail on it."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(models.get().read_bytes()[:4096])

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr("kvchat.engine.gguf.reader._check_header", broken)
    proc = kvchat("generate", "--model", str(path), "hi")
    assert proc.returncode == 70
    with pytest.raises(AssertionError, match="internal error: RuntimeError: injected"):
        assert_one_line_error(proc, str(path))


def test_garbled_bytes_never_crash_or_hang(tmp_path, models):
    """Random corruption of the header and metadata: either it still loads, or one clean error line."""
    data = bytearray(models.get().read_bytes())
    rng = random.Random(7)
    script = ("import sys\nfrom kvchat.engine.engine import Engine\nfrom kvchat.errors import KvchatError\n"
              "for p in sys.argv[1:]:\n"
              "    try: Engine(p, device='cpu')\n    except KvchatError: pass\n")
    paths = []
    for i in range(12):
        corrupt = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            corrupt[rng.randrange(0, 4096)] = rng.randrange(256)
        path = tmp_path / f"garbled{i}.gguf"
        path.write_bytes(bytes(corrupt))
        paths.append(str(path))
    proc = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unsupported_architecture(tmp_path):
    path = write_header_only(tmp_path / "gemma.gguf", base_config(arch="gemma"))
    assert_one_line_error(kvchat("info", "--model", str(path)), "unsupported architecture 'gemma'", "llama, qwen2")


@pytest.mark.parametrize("field,value,needle", [
    ("n_layers", 10**7, "absurd n_layers"),
    ("d_model", 2**31, "absurd d_model"),
    ("n_kv_heads", 3, "cannot be shared"),
    ("vocab_size", 2**31, "absurd vocab_size"),
])
def test_absurd_dimensions(tmp_path, field, value, needle):
    path = write_header_only(tmp_path / "absurd.gguf", base_config(**{field: value}))
    assert_one_line_error(kvchat("info", "--model", str(path)), needle)


def test_metadata_that_does_not_match_the_tensors(tmp_path):
    path = write_header_only(tmp_path / "liar.gguf", base_config(n_layers=2))
    with pytest.raises(GGUFError, match="tensor .* is missing"):
        Engine(path, device="cpu")


def test_unsupported_tensor_type(tmp_path, models):
    path = tmp_path / "q4_1.gguf"
    llama_quantize(models.get(), path, ftype=3, keep_output_f32=False)  # LLAMA_FTYPE_MOSTLY_Q4_1
    assert_one_line_error(kvchat("generate", "--model", str(path), "hi"), "unsupported type Q4_1", "Q4_K")


def test_prompt_longer_than_context(models):
    path = models.get(context_length=32)
    proc = kvchat("generate", "--model", str(path), "--max-tokens", "4", "word " * 200)
    assert_one_line_error(proc, "context", "32")


# click's range checks are usage errors (2); a device name is checked by kvchat itself (1)
STATUS = {"temperature": 2, "top-p": 2, "max-tokens": 2, "unknown device": 1}


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--max-tokens", "0"], "max-tokens"),
    (["--device", "tpu"], "unknown device"),
])
def test_bad_options(models, args, needle):
    proc = kvchat("generate", "--model", str(models.get()), *args, "hi")
    assert_one_line_error(proc, needle, status=STATUS[needle])


def test_a_chat_message_empty_or_longer_than_the_context_is_refused_before_anything_is_saved(models):
    import json as json_

    path = models.get(context_length=64, style="chatml", arch="qwen2")
    sid = run_kvchat("new", "--model", str(path)).stdout.strip()
    run_kvchat("send", sid, "hello", "--max-tokens", "2")
    for message in ("", "   \n\t ", "word " * 300):
        proc = run_kvchat("send", sid, message, "--max-tokens", "2", check=False)
        assert_one_line_error(proc, "context" if message.strip() else "empty")
    proc = run_kvchat("send", sid, "-", "--max-tokens", "2", check=False, stdin="  \n")
    assert_one_line_error(proc, "the message is empty")
    [chat] = json_.loads(run_kvchat("sessions", "--json").stdout)
    assert chat["n_rounds"] == 1  # only the first message's round


def test_gemma3_metadata_we_cannot_honour_is_refused(tmp_path):
    """A window longer than the context, and a Gemma 3 / Qwen 3 file without its head norms: one line each."""
    import numpy as np

    from kvchat.engine.train.synthetic import random_tensors

    wide = write_header_only(tmp_path / "wide.gguf", base_config(arch="gemma3", sliding_window=4096))
    assert_one_line_error(kvchat("info", "--model", str(wide)), "sliding window 4096", "context of 64 tokens")
    for arch in ("gemma3", "qwen3"):
        cfg = base_config(arch=arch, qk_norm=True, post_norms=arch == "gemma3", rope_neox=True)
        tensors = {name: make() for name, (_, make) in random_tensors(cfg, 0).items()
                   if not name.endswith("attn_k_norm.weight")}
        vocab, _ = make_vocab("llama3")
        tensors["token_embd.weight"] = np.zeros((len(vocab.tokens), 256), np.float32)
        path = tmp_path / f"{arch}.gguf"
        write_model_gguf(path, cfg, tensors, vocab)
        assert_one_line_error(kvchat("generate", "--model", str(path), "--device", "cpu", "hi"),
                              "tensor blk.0.attn_k_norm.weight is missing")
