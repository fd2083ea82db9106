"""Generation: greedy and sampled, stops, streaming, cancellation from another thread, and the CLI around it."""

from __future__ import annotations

import json
import threading
import time

import pytest
from cli_run import kvchat
import torch

from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams, sample

PROMPT = "Tell me a story about a dragon"


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models.get(), device="cpu")


def run(engine, max_tokens=24, **kw):
    return generate(engine.model, engine.new_cache(), engine.encode_prompt(PROMPT),
                    decoder=engine.tokenizer.stream_decoder(), max_tokens=max_tokens, **kw)


def test_greedy_is_deterministic_and_respects_the_limit(engine):
    a, b = run(engine), run(engine)
    assert a.tokens == b.tokens and len(a.tokens) == 24 and a.stop_reason == "max_tokens"


def test_top_k_one_is_greedy(engine):
    greedy = run(engine).tokens
    assert run(engine, sampling=SamplingParams(temperature=1.5, top_k=1, seed=3)).tokens == greedy


def test_seed_replays_and_differs_from_greedy(engine):
    params = SamplingParams(temperature=1.0, seed=42)
    a, b = run(engine, sampling=params), run(engine, sampling=params)
    assert a.tokens == b.tokens
    assert a.tokens != run(engine).tokens
    assert run(engine, sampling=SamplingParams(temperature=1.0, seed=43)).tokens != a.tokens


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.7), gen)) for _ in range(300)}
    assert seen == {0, 1}


def test_stops_on_end_of_generation_token(engine):
    first = run(engine, max_tokens=5).tokens
    stopped = run(engine, stop_tokens=frozenset({first[2]}))
    assert stopped.stop_reason == "eog" and stopped.tokens == first[:3]
    assert engine.tokenizer.decode(first[:2]) == stopped.text


def test_stops_on_stop_string(engine):
    full = run(engine, max_tokens=16)
    target = full.text[len(full.text) // 2:][:3]
    assert target
    stopped = run(engine, max_tokens=16, stop_strings=(target,))
    assert stopped.stop_reason == "stop_string" and target not in stopped.text


def test_streaming_callback_sees_every_piece(engine):
    pieces = []
    result = run(engine, on_token=lambda tok, piece: pieces.append(piece))
    assert "".join(pieces) == result.text


def test_the_first_token_is_shown_before_the_decode_step_is_built(engine, monkeypatch):
    # Building the step captures CUDA graphs on a GPU (tens of ms at long contexts): the user sees the first token
    # first, and neither the first-token time nor the decode rate counts the setup (it is reported apart).
    from kvchat.engine import generate as generate_module

    events, build = [], generate_module.decode_steps

    def slow_build(*args, **kwargs):
        events.append("built")
        time.sleep(0.3)
        return build(*args, **kwargs)

    monkeypatch.setattr(generate_module, "decode_steps", slow_build)
    result = run(engine, max_tokens=6, on_token=lambda tok, piece: events.append("token"))
    assert events[:3] == ["token", "built", "token"] and events.count("built") == 1
    assert result.decode_setup_seconds >= 0.3 > result.first_token_seconds
    assert result.decode_seconds < 0.3 or result.decode_seconds < result.decode_setup_seconds
    one = run(engine, max_tokens=1, on_token=lambda tok, piece: events.append("token"))
    assert len(one.tokens) == 1 and events.count("built") == 1  # a one-token reply needs no decode step


def test_cancel_from_another_thread(engine):
    cancel = threading.Event()
    seen = []

    def on_token(tok, piece):
        seen.append(tok)
        if len(seen) == 3:
            threading.Thread(target=cancel.set).start()

    result = run(engine, max_tokens=500, on_token=on_token, cancel=cancel)
    assert result.stop_reason == "cancelled" and len(result.tokens) < 500


def test_context_limit_stops_decoding(models):
    engine = Engine(models.get(context_length=32), device="cpu")
    prompt = engine.encode_prompt(PROMPT)
    result = generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                      max_tokens=1000)
    assert result.stop_reason == "context" and len(prompt) + len(result.tokens) <= 33


def test_cli_generate_json_and_stream_agree(engine, models):
    path = str(models.get())
    as_json = kvchat("generate", "--model", path, "--max-tokens", "12", "--json", PROMPT, check=False)
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["tokens"] == run(engine, max_tokens=12).tokens
    streamed = kvchat("generate", "--model", path, "--max-tokens", "12", PROMPT, check=False)
    assert streamed.returncode == 0 and streamed.stdout == out["text"] + "\n"


def test_cli_generate_sampling_with_seed(models):
    path = str(models.get())
    args = ("generate", "--model", path, "--max-tokens", "12", "--temperature", "0.9", "--top-k", "40",
            "--top-p", "0.95", "--seed", "5", "--json", PROMPT)
    a, b = json.loads(kvchat(*args, check=False).stdout), json.loads(kvchat(*args, check=False).stdout)
    assert a["tokens"] == b["tokens"]


def test_cli_info(models):
    proc = kvchat("info", "--model", str(models.get(arch="qwen2", style="chatml", tied=True)), "--json", check=False)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["architecture"] == "qwen2" and facts["layers"] == 2 and facts["heads"] == 4
    assert facts["kv_heads"] == 2 and facts["head_size"] == 64 and facts["context_length"] == 2048
    assert facts["kv_bytes_per_token_f16"] == 2 * 2 * 2 * 64 * 2
    text = kvchat("info", "--model", str(models.get()), check=False)
    assert "kv bytes per token" in text.stdout and "context length" in text.stdout
