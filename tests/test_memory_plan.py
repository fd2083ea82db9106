"""The GPU memory budget (`--gpu-memory`, engine/memory_plan.py): the planner on made-up sizes (the full cache fits,
the tiered cache does, nothing does), sizes as users write them, the weights counted without loading them, and the
commands refusing in one line, or putting a chat on the tiered cache, before anything is committed.

On a machine without CUDA `--gpu-memory` does nothing; the command tests make the CPU stand in for a GPU with a
budget (app.session.memory.memory_budget, the one place that asks the device), so the same planning runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cli_run import kvchat
from kvchat.app.session import memory
from kvchat.engine.engine import Engine
from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine import memory_plan
from kvchat.engine.memory_plan import (
    GIB,
    MIB,
    MemoryNeeds,
    parse_size,
    plan_memory,
    size_words,
    upper_share_tokens,
    weight_bytes,
    workspace_bytes,
)
from kvchat.errors import GPUMemoryError

KV = 4096  # bytes per token and layer: 8 KV heads x 128 dims x K and V in bf16 (the 8B shape)


def needs(budget_gib: float, **changes) -> MemoryNeeds:
    """A made-up chat: 4 GiB of weights, 1 GiB of workspace, 32 layers, 32,768 tokens (4 GiB of K/V)."""
    base = {"budget": int(budget_gib * GIB), "weights": 4 * GIB, "workspace": GIB, "kv_per_token_layer": KV,
            "layers": 32, "tokens": 32768, "upper_tokens": 8192, "picked_tokens": 6144, "largest_round": 1000,
            "restore_window": GIB}
    return MemoryNeeds(**{**base, **changes})


def test_the_full_cache_when_it_fits():
    plan = plan_memory(needs(11))
    # weights, workspace, the K/V and the restore's 1 GiB of segments in flight
    assert (plan.kind, plan.needed, plan.kv, plan.message) == ("full", 10 * GIB, 4 * GIB, "")
    assert plan_memory(needs(10)).kind == "full"  # exactly at the budget


def test_the_tiered_cache_when_only_it_fits():
    n = needs(9.99, split=8)
    plan = plan_memory(n)
    lower = 8 * 32768 * KV  # every token's lower layers (1 GiB)
    room = memory_plan.TIERED_REPLY_ROOM
    # the picked rounds, the message and reply (2,048 new tokens), the free room, and the open round's slots set
    # aside while the tier grows (larger than the largest round, 1,000 tokens, crossing from host memory)
    upper = 24 * (8192 + room + 2048) * KV
    bounds = 24 * 1024 * KV  # one block's minimum and maximum key per 32 tokens
    assert plan.kind == "tiered"
    assert plan.kv == lower + upper + bounds
    assert plan.needed == 5 * GIB + max(lower + GIB, lower + upper + bounds)
    assert plan.message.startswith("the K/V of a 32,768-token chat with its message and reply (4 GiB) does not fit "
                                   "in --gpu-memory 10 GiB beside the weights; it runs on the tiered cache (Round "
                                   "Attention: layers below 8 on the GPU")
    # A round larger than the new tokens is the block in flight.
    assert plan_memory(replace(n, largest_round=3000)).kv == lower + 24 * (8192 + room + 3000) * KV + bounds


def test_refused_when_even_the_tiered_cache_does_not_fit():
    plan = plan_memory(needs(6, split=16))
    assert plan.kind == "refused" and plan.short == plan.needed - 6 * GIB > 0
    assert "even on the tiered cache (layers below 16 on the GPU) it needs" in plan.message
    assert plan.message.endswith("more than --gpu-memory 6 GiB")
    assert "\n" not in plan.message


def test_without_a_split_the_least_any_split_needs_decides_whether_to_calibrate():
    # At split 1 (every upper layer above a small lower tier) it would fit: find the model's split, plan again.
    assert plan_memory(needs(6.7)).kind == "tiered"
    plan = plan_memory(needs(6.5))
    assert plan.kind == "refused" and "even on the tiered cache it needs at least" in plan.message


def test_refused_when_the_weights_and_workspace_alone_do_not_fit():
    plan = plan_memory(needs(4, tokens=0))
    assert plan.kind == "refused" and plan.needed == 5 * GIB
    assert plan.message == ("the model needs 4 GiB of GPU memory for its weights and 1 GiB of workspace; "
                            "--gpu-memory 4 GiB is 1 GiB short")
    free = plan_memory(needs(4.5, budget_name=""))
    assert free.message.endswith("the 4.5 GiB free on the GPU is 512 MiB short")


def test_a_raw_completion_is_never_tiered():
    plan = plan_memory(needs(9.5, can_tier=False))
    assert plan.kind == "refused" and plan.message.startswith("32,768 tokens of K/V (4 GiB) need 10 GiB")


def test_sliding_window_layers_hold_at_most_their_ring():
    ring = needs(100, ring_layers=24, ring_tokens=4096 + 2048)
    assert plan_memory(ring).kv == KV * (8 * 32768 + 24 * 6144)


def test_the_upper_share_is_the_first_round_and_twice_the_top_tenth_of_the_others():
    rounds = [100] + [10 * i for i in range(1, 21)]  # 20 rounds after the first: 2 picked, 4 with progressive
    assert upper_share_tokens(rounds) == 100 + 200 + 190 + 180 + 170
    assert upper_share_tokens([50]) == 50 and upper_share_tokens([]) == 0


def test_the_plan_s_bands_are_the_products_bands():
    """engine/ plans what engine.model.quantized allocates (the numbers are written twice: the plan is pure
    arithmetic, importing no model code); a short prompt's larger bands stay within what its activations save on
    the 8B shape, and are planned on a small model, where they do not."""
    from kvchat.engine.model import quantized

    assert memory_plan.BAND_BYTES == 2 * quantized.BAND_ELEMENTS
    assert memory_plan.SHORT_BAND_BYTES == 2 * quantized.SHORT_BAND_ELEMENTS
    assert memory_plan.SHORT_PREFILL == quantized.SHORT_PREFILL
    big = ModelConfig(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                      vocab_size=128256, context_length=131072, rms_eps=1e-5, rope_base=5e5, rope_dim=128,
                      rope_neox=False, rope_freq_scale=1.0, qkv_bias=False, tied_output=False, llama3_rope=True)
    small = ModelConfig(arch="llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                        vocab_size=1000, context_length=8192, rms_eps=1e-5, rope_base=1e4, rope_dim=64,
                        rope_neox=False, rope_freq_scale=1.0, qkv_bias=False, tied_output=False, llama3_rope=False)
    per_token = 2 * 4096 + 48 * 128 + 32 * 128 + 3 * 14336
    extra = workspace_bytes(big, 2, 8192, quantized=True) - workspace_bytes(big, 2, 8192, quantized=False)
    assert extra == 2 * memory_plan.BAND_BYTES  # the chunk's own bands are the higher of the two
    assert 2048 * per_token * 2 + 2 * memory_plan.SHORT_BAND_BYTES <= 4096 * per_token * 2 + extra
    extra = workspace_bytes(small, 2, 8192, quantized=True) - workspace_bytes(small, 2, 8192, quantized=False)
    assert extra > 2 * memory_plan.SHORT_BAND_BYTES - 4096 * 1600 * 2  # the larger bands, less the few saved


def test_the_8b_shape_at_32k():
    """The figures docs/architecture.md quotes: the 8B shape in Q4_K_M (4.58 GiB of weights on the GPU), a 32k
    chat of 51 rounds, a 512-token reply; the tiered cache at the watershed the benchmarks use (layer 4, split 5)."""
    cfg = ModelConfig(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                      vocab_size=128256, context_length=131072, rms_eps=1e-5, rope_base=5e5, rope_dim=128,
                      rope_neox=False, rope_freq_scale=1.0, qkv_bias=False, tied_output=False, llama3_rope=True)
    tokens, chat = 32768 + 64 + 513, 32768
    workspace = workspace_bytes(cfg, 2, tokens, quantized=True, graphs=1, weight_tensors=196)
    assert 900 * MIB < workspace < GIB  # 480 MiB of prefill activations, 64 of bands, 64 of rotary tables, slack
    picked = upper_share_tokens([642] * 51)

    def plan(budget, split=None):
        return plan_memory(MemoryNeeds(budget=budget, weights=int(4.58 * GIB), kv_per_token_layer=KV, layers=32,
                                       tokens=tokens, split=split, upper_tokens=picked + tokens - chat,
                                       picked_tokens=picked, largest_round=642, workspace=workspace_bytes(
                                           cfg, 2, tokens, True, graphs=1 if split is None else 2,
                                           weight_tensors=196)))

    assert plan(12 * GIB).kind == "full" and plan(12 * GIB).needed < 11 * GIB
    assert plan(8 * GIB).kind == "tiered" and plan(8 * GIB, split=5).kind == "tiered"
    # before the split is known, the message names no split and the least K/V any would hold
    assert "(Round Attention: its lower layers on the GPU" in plan(8 * GIB).message
    assert ", at least 1." in plan(8 * GIB).message and "layers below 5" in plan(8 * GIB, split=5).message
    assert plan(8 * GIB, split=16).kind == "refused"
    assert plan(5 * GIB).message.startswith("the model needs 4.6 GiB of GPU memory for its weights and")


@pytest.mark.parametrize("text, size", [("8GiB", 8 * GIB), ("12GB", 12 * GIB), ("8G", 8 * GIB),
                                        ("7.5GiB", int(7.5 * GIB)), ("8192MiB", 8 * GIB), (" 512 mb ", 512 * MIB),
                                        ("1TiB", 1 << 40), ("64KiB", 64 << 10)])
def test_sizes_as_users_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text, why", [("8", "no unit"), ("eight GiB", "not a size"), ("-1GiB", "not a size"),
                                       ("0GiB", "no memory"), ("8PiB", "not a size"), ("", "not a size"),
                                       ("8 GiB GiB", "not a size")])
def test_bad_sizes(text, why):
    with pytest.raises(ValueError, match=why):
        parse_size(text)


def test_sizes_written_back():
    assert [size_words(n) for n in (8 * GIB, int(7.5 * GIB), 512 * MIB)] == ["8GiB", "7.5GiB", "512MiB"]


@pytest.mark.parametrize("spec", [{}, {"qtype": Q.Q8_0}, {"arch": "qwen2", "style": "chatml"}, {"tied": True}])
def test_the_weights_are_counted_as_the_loader_places_them(models, spec):
    path = models.get(**spec)
    engine = Engine(path, device="cpu")
    on_cpu, tensors = weight_bytes(path, "cpu")
    assert on_cpu == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert tensors == 15 + (6 if spec.get("arch") == "qwen2" else 0) - (1 if spec.get("tied") else 0)
    on_gpu, _ = weight_bytes(path, "cuda")  # Q8_0 matrices in their blocks, the rest in bf16, vectors in fp32
    assert on_gpu < on_cpu / (3 if spec.get("qtype") == Q.Q8_0 else 1.9)


# ---- the commands, with the CPU standing in for a GPU with a budget


@pytest.fixture
def cpu_budget(monkeypatch):
    """--gpu-memory applied on the CPU as it is on CUDA (the budget as given; no cap on torch's allocator)."""
    def budget(device, requested, name="--gpu-memory"):
        return memory.Budget(torch.device("cpu"), requested, name) if requested is not None else None

    monkeypatch.setattr(memory, "memory_budget", budget)


def test_gpu_memory_does_nothing_on_the_cpu(models):
    out = kvchat("generate", "--model", str(models.get()), "--gpu-memory", "1MiB", "--max-tokens", "4", "--json",
                 "Hello")
    assert len(json.loads(out.stdout)["tokens"]) == 4 and out.stderr == ""


@pytest.mark.parametrize("args", [["generate", "Hello"], ["send", "S", "Hello"], ["eval"], ["bench"], []])
def test_a_bad_size_is_a_one_line_usage_error(args):
    out = kvchat(*args[:1], "--gpu-memory", "8 gigs", *args[1:], check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("kvchat: error: ") and "'8 gigs' is not a size" in lines[0]


def test_before_a_command_it_is_the_apps_option():
    out = kvchat("--gpu-memory", "8GiB", "sessions", check=False)
    assert out.returncode == 1 and "--gpu-memory and --kv-budget before a command apply to the app only" in out.stderr


def test_a_budget_below_the_weights_is_refused_before_loading(models, cpu_budget, monkeypatch):
    path = models.get()
    monkeypatch.setattr(Engine, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    out = kvchat("generate", "--model", str(path), "--gpu-memory", "64MiB", "Hello", check=False)
    weights = weight_bytes(path, "cpu")[0]
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"kvchat: error: the model needs {weights / MIB:.0f} MiB of GPU memory for its "
                                 f"weights and ")
    assert out.stderr.rstrip().endswith("--gpu-memory 64 MiB is " + out.stderr.split(" is ")[-1].strip())


def chat_with_rounds(model, n: int = 3) -> str:
    sid = kvchat("new", "--model", str(model)).stdout.strip()
    for i in range(n):
        kvchat("send", sid, f"Remember the number {i}.", "--max-tokens", "8")
    return sid


def planned(path, sid: str, message: str, max_tokens: int, split: int | None = None):
    """The chat's plans as `send` makes them, at a budget of 1 TiB: (full cache, tiered cache at `split`)."""
    from kvchat.engine.text.chat_format import Conversation
    from kvchat.storage.db import Store

    engine = Engine(path, device="cpu")
    budget = memory.Budget(torch.device("cpu"), 1 << 40, "--gpu-memory")
    rounds = Store().rounds(sid)
    new = len(engine.chat.open_round_tokens(Conversation([], None), message)) + max_tokens + 1
    lengths = [r.token_end - r.token_start for r in rounds]
    full = plan_memory(memory.chat_needs(engine, budget, rounds[-1].token_end, new, lengths))
    n = memory.chat_needs(engine, budget, rounds[-1].token_end, new, lengths, split=split)
    return full, plan_memory(replace(n, budget=full.needed - 1)), n


def test_a_send_that_cannot_fit_is_refused_with_its_message_not_committed(models, cpu_budget):
    path = models.get()
    sid = chat_with_rounds(path)
    rounds = len(json.loads(kvchat("show", sid, "--json").stdout)["rounds"])
    n = planned(path, sid, "And now?", 8)[2]
    budget = (n.weights + n.workspace) // 1024 + 1  # KiB: the weights fit, no chat's K/V beside them
    assert budget * 1024 < plan_memory(replace(n, budget=budget * 1024)).needed
    out = kvchat("send", sid, "And now?", "--gpu-memory", f"{budget}KiB", "--max-tokens", "8", check=False)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("kvchat: error: the K/V of a ")
    assert "even on the tiered cache it needs at least" in out.stderr
    assert len(json.loads(kvchat("show", sid, "--json").stdout)["rounds"]) == rounds  # nothing committed


def test_a_chat_whose_kv_does_not_fit_whole_runs_on_the_tiered_cache(models, cpu_budget, monkeypatch):
    """Between what the tiered cache needs and what the full cache needs, a full-cache send runs on the tiered
    cache at the model's watershed (here a stored calibration), says so once, and `show` has it."""
    from kvchat.app.session.artifacts import save_calibration
    from kvchat.engine.calibrate.watershed import Calibration
    from kvchat.storage.db import Store
    from kvchat.storage.fingerprint import model_fingerprint

    from kvchat.engine import memory_plan

    # A test model's K/V is a few hundred KiB: the tiered cache's second decode graph and its free room would outweigh
    # what it saves.
    monkeypatch.setattr(memory_plan, "GRAPH_POOL", 0)
    monkeypatch.setattr(memory_plan, "TIERED_REPLY_ROOM", 0)
    path = models.get(n_layers=4)
    save_calibration(Calibration(model_fingerprint(path, Store()), "t", 4, 1, [0.0] * 4, 1, "mt_bench", 0, "today"))
    sid = chat_with_rounds(path, 4)
    full, tiered, _ = planned(path, sid, "What was the first number?", 8, split=2)
    assert full.kind == "full" and tiered.kind == "tiered" and tiered.needed < full.needed
    out = kvchat("send", sid, "What was the first number?", "--gpu-memory", f"{(full.needed - 1) // 1024}KiB",
                 "--max-tokens", "8", "--json")
    assert json.loads(out.stdout)["kv_policy"] == "round"
    assert out.stderr.count("runs on the tiered cache (Round Attention: layers below 2 on the GPU") == 1
    assert "runs on the tiered cache" in json.loads(kvchat("show", sid, "--json").stdout)["last_restore"]["notes"][0]
    # With room to spare the chat runs as asked.
    out = kvchat("send", sid, "And the second?", "--gpu-memory", "8GiB", "--max-tokens", "8", "--json")
    assert json.loads(out.stdout)["kv_policy"] == "full" and "tiered" not in out.stderr


def test_the_budget_is_enforced_before_the_model_loads(monkeypatch):
    """On CUDA the budget caps torch's allocator (its per-process memory fraction of the card's total)."""
    from kvchat.engine import memory_plan

    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # torch refuses a device without an index here (a bare "cuda"): the call must get the index.
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, device: calls.append((f, device)) if isinstance(device, int) else 1 / 0)
    assert memory_plan.device_budget("cuda", 8 * GIB) == (8 * GIB, "--gpu-memory")
    assert calls == [(0.1, 0)]
    assert memory_plan.device_budget("cuda", None) == (42 * GIB, "")  # what is free, this process's cache too
    assert memory_plan.device_budget("cuda:1", 64 * GIB) == (42 * GIB, "")  # more than the card has free
    assert calls == [(0.1, 0), (0.8, 1)]


@pytest.mark.gpu
def test_on_cuda_an_allocation_past_the_budget_fails(models):
    from kvchat.app.session.service import ChatService

    try:
        service = ChatService(device="cuda", gpu_memory=2 * GIB)
        assert service.budget().bytes == 2 * GIB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
        with pytest.raises(GPUMemoryError, match="--gpu-memory 1 MiB is"):
            ChatService(device="cuda", gpu_memory=1 * MIB).engine(models.get())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
