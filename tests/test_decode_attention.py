"""The split-KV decode attention kernel (kernels.decode_attention) against its torch definition, and the decode
steps built on it (engine.model.cuda_graph, the tiered cache's replays) against eager decoding.

As for kernels.round_scores, the Triton kernel runs on the CPU only in triton's interpreter: the `interpreted`
tests skip themselves in the ordinary run and `test_the_kernel_in_triton_s_interpreter` runs them in a child pytest
with TRITON_INTERPRET=1. The GPU tests (`gpu` marker) cover the full grid of head layouts, head sizes, dtypes and
lengths up to 64k, and the captured graphs.
"""

from __future__ import annotations


import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels import decode_attention as kernel_module
from kvchat.kernels.decode_attention import decode_attention, decode_attention_ref, unsupported_reason
from kvchat.kernels._triton import INTERPRET

interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (H, Hkv, D, length, capacity, dtype). Under the interpreter key blocks are 32 and there are up to 4 splits:
# the lengths cross blocks and splits, stop one short of and one past a block, and fill the cache exactly.
INTERPRETER_CASES = [
    (4, 4, 64, 1, 64, torch.float32),  # MHA, one key: the token itself
    (8, 2, 128, 300, 400, torch.float32),  # GQA 4:1
    (8, 1, 64, 31, 40, torch.float16),  # MQA
    (16, 2, 32, 33, 33, torch.bfloat16),  # GQA 8:1, the cache exactly full
    (8, 2, 80, 129, 200, torch.float32),  # a head size that is not a power of two, padded and masked
    (4, 2, 256, 97, 128, torch.bfloat16),
    (2, 1, 64, 8192, 8192, torch.float16),  # a long length, few heads: the interpreter is slow (64k: GPU cases)
]

# The GPU grid: head layouts MHA, GQA 4:1 and 8:1, MQA; head sizes 64, 128, 256; every dtype; lengths from one
# key to 64k, some odd, and capacities beyond the length.
GPU_HEADS = [(8, 8), (32, 8), (32, 4), (16, 1)]
GPU_LENGTHS = [(1, 16), (7, 300), (1000, 1000), (4097, 8192), (65536, 65536)]
GPU_CASES = [(h, hkv, d, n, cap, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)
             for h, hkv in GPU_HEADS for d in (64, 128, 256) for n, cap in GPU_LENGTHS
             if not (n == 65536 and (d == 256 or dtype == torch.float32))]  # memory: 64k only where it fits fast
GPU_CASES += [(32, 8, 80, 777, 1024, torch.bfloat16), (28, 4, 128, 32768, 40000, torch.bfloat16)]


def case_id(case) -> str:
    h, hkv, d, n, cap, dtype = case
    return f"H{h}kv{hkv}-D{d}-n{n}-C{cap}-{str(dtype).removeprefix('torch.')}"


def random_cache(n_heads, n_kv_heads, head_dim, capacity, dtype, device, seed=0):
    """q and a cache [2, Hkv, C, D] as the engine holds it (k and v are views of one tensor). Queries 3x larger
    than keys, so that attention is peaked rather than nearly uniform, where any weighting would look right."""
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(n_heads, head_dim, generator=gen) / head_dim**0.25).to(device=device, dtype=dtype)
    kv = torch.randn(2, n_kv_heads, capacity, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, kv


def tolerances(dtype: torch.dtype) -> dict:
    # Both sides accumulate in float32; the kernel rounds the probabilities to the cache's dtype before the
    # product with V (as flash attention does), so half-precision outputs get a few units of their last place.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]


def check_against_reference(case, device, slots: bool = False, n_splits: int | None = None, window: int = 0):
    n_heads, n_kv_heads, head_dim, n, capacity, dtype = case
    q, kv = random_cache(n_heads, n_kv_heads, head_dim, capacity, dtype, device)
    # Garbage past the length: a kernel reading beyond it would be caught.
    kv[:, :, n:] = float("nan")
    index = None
    if slots:  # the first n of a shuffled list of the valid slots, with garbage entries past n
        index = torch.cat([torch.randperm(n), torch.full((7,), capacity - 1)]).to(device)
    length = torch.tensor([n], device=device)
    if window:  # garbage before the window too: a sliding-window layer must not read it
        kv[:, :, : max(0, n - window)] = float("nan")
    got = decode_attention(q, kv[0], kv[1], length, slots=index, n_splits=n_splits, window=window)
    want = decode_attention_ref(q, kv[0], kv[1], length, slots=index, window=window)
    assert got.shape == q.shape and got.dtype == dtype and got.device == q.device
    torch.testing.assert_close(got, want, **tolerances(dtype))


# --- on the CPU in triton's interpreter (run through test_the_kernel_in_triton_s_interpreter) ---

@interpreted
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_interpreted_kernel_matches_reference(case):
    check_against_reference(case, "cpu")


@interpreted
@pytest.mark.parametrize("n_splits", [1, 3, 16])
def test_interpreted_subset_of_slots_and_split_counts(n_splits):
    # 16 splits over 100 keys: most splits are empty and must weigh nothing in the merge.
    check_against_reference((8, 2, 64, 100, 160, torch.float32), "cpu", slots=True, n_splits=n_splits)
    check_against_reference((8, 2, 64, 100, 160, torch.bfloat16), "cpu", slots=True, n_splits=n_splits)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_a_slot_list_per_kv_head(dtype):
    # LoopServe's per-head choice: each KV head its own shuffled list, garbage past the count.
    q, kv = random_cache(8, 2, 64, 160, dtype, "cpu")
    kv[:, :, 120:] = float("nan")
    gen = torch.Generator().manual_seed(1)
    slots = torch.stack([torch.randperm(120, generator=gen)[:90] for _ in range(2)])
    slots = torch.cat([slots, torch.full((2, 5), 159)], dim=1)
    length = torch.tensor([90])
    got = decode_attention(q, kv[0], kv[1], length, slots=slots, n_splits=3)
    torch.testing.assert_close(got, decode_attention_ref(q, kv[0], kv[1], length, slots=slots), **tolerances(dtype))
    one = decode_attention_ref(q, kv[0], kv[1], length, slots=slots[0])
    assert not torch.allclose(got, one)  # the second head's list was read, not the first's


@interpreted
@pytest.mark.parametrize("n, window", [(300, 8), (300, 100), (40, 64), (97, 97)])
def test_interpreted_sliding_window(n, window):
    # A window shorter than a key block, longer than the length, crossing blocks, and exactly the length.
    # (Gemma 3's head size of 256 runs on the GPU: the interpreter takes seconds per such case.)
    check_against_reference((4, 1, 64, n, 320, torch.float32), "cpu", window=window)


def check_ring(case, device, window: int, ring: int):
    """A sliding-window layer kept in a ring (slot s at s % ring): the kernel over the ring equals the reference
    over the same keys laid out by slot; every ring place outside the window holds NaN."""
    n_heads, n_kv_heads, head_dim, n, dtype = case
    q, linear = random_cache(n_heads, n_kv_heads, head_dim, n, dtype, device)
    kv = torch.full((2, n_kv_heads, ring, head_dim), float("nan"), dtype=dtype, device=device)
    first = max(0, n - window)
    kv[:, :, torch.arange(first, n, device=device) % ring] = linear[:, :, first:n]
    length = torch.tensor([n], device=device)
    got = decode_attention(q, kv[0], kv[1], length, window=window, ring=ring)
    torch.testing.assert_close(got, decode_attention_ref(q, linear[0], linear[1], length, window=window),
                               **tolerances(dtype))
    torch.testing.assert_close(decode_attention_ref(q, kv[0], kv[1], length, window=window, ring=ring), got,
                               **tolerances(dtype))


@interpreted
@pytest.mark.parametrize("n, window, ring", [(300, 8, 40), (40, 64, 96), (1000, 100, 130), (97, 97, 97)])
def test_interpreted_window_in_a_ring(n, window, ring):
    # The window wrapping round the ring, a chat shorter than the window, many laps, and a ring of the window alone.
    check_ring((4, 1, 64, n, torch.float32), "cpu", window, ring)
    check_ring((8, 2, 64, n, torch.bfloat16), "cpu", window, ring)


def test_a_ring_shorter_than_the_window_is_refused():
    q, kv = random_cache(4, 1, 64, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="a ring of 32 slots takes a window of at most that"):
        decode_attention(q, kv[0], kv[1], torch.tensor([40]), window=64, ring=32)


@interpreted
def test_interpreted_length_is_read_from_the_device_tensor():
    # One call site, the length changed in place between calls (what a replayed graph sees).
    q, kv = random_cache(8, 2, 64, 200, torch.float32, "cpu")
    length = torch.tensor([1])
    for n in (1, 2, 64, 65, 200):
        length.fill_(n)
        torch.testing.assert_close(decode_attention(q, kv[0], kv[1], length),
                                   decode_attention_ref(q, kv[0], kv[1], n), **tolerances(torch.float32))


@interpreted
def test_interpreted_static_decode_is_greedy_decode():
    """The embedded model (fp32, llama.cpp numerics) decodes the same tokens through the kernel step as eagerly."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.model.cuda_graph import GraphedDecode
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.decoder import decode_kernel_runs

    engine = Engine(DEFAULT_MODEL, device="cpu")
    m = engine.model
    assert decode_kernel_runs(engine.config, m.dtype, m.device)
    prompt = engine.encode_prompt("My dog is called Rex. Our canoe is called Blue Heron. What is my dog called?")

    def greedy(static: bool) -> list[int]:
        cache = m.new_cache(256)
        logits = m(torch.tensor(prompt), cache)[-1]
        step = GraphedDecode(m, cache, 256, capture=False) if static else (lambda t: m(torch.tensor([t]), cache)[-1])
        tokens = [int(logits.argmax())]
        for _ in range(2):
            tokens.append(int(step(tokens[-1]).argmax()))
        return tokens

    assert greedy(static=True) == greedy(static=False)


def tiered_replies(device: str, modes: tuple[str, ...], max_tokens: int = 10) -> list[tuple]:
    """Round Attention's decode of one question on the embedded model (fp32), once per decode mode: the reply,
    the rounds brought in while decoding, the rechecks and the rounds left resident."""
    from test_tiered_kv import QUESTION, ROUNDS, SYSTEM

    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.text.chat_format import Conversation
    from kvchat.engine.engine import Engine
    from kvchat.engine.generate import generate
    from kvchat.engine.policies import make_policy
    from kvchat.engine.kv.tiered import TieredKV

    engine = Engine(DEFAULT_MODEL, device=device, dtype=torch.float32)
    runs = []
    for mode in modes:
        # Layer 4 is the model's calibrated watershed: from lower layers the first pick misses the sister's round,
        # the reply is "You haven't told me that yet." and no round is ever brought in.
        tiered = TieredKV(engine.model, make_policy("round-topk", engine, watershed=4, k=1), 512, decode=mode)
        for span in engine.chat.round_spans(Conversation(ROUNDS, SYSTEM)):
            tiered.prefill(span)
            tiered.close_round()
        prompt = engine.chat.open_round_tokens(Conversation(ROUNDS, SYSTEM), QUESTION)
        out = generate(engine.model, tiered, prompt, decoder=engine.tokenizer.stream_decoder(),
                       max_tokens=max_tokens, stop_tokens=engine.tokenizer.eog_ids, stop_strings=engine.chat.stop_strings)
        runs.append((out.tokens, tiered.stats.added, tiered.stats.rechecks, tiered.resident))
    assert runs[0][1], "no round was brought in while decoding: the test would not cover the slot move"
    return runs


@interpreted
def test_interpreted_tiered_replayed_steps_are_eager_steps():
    """Round Attention's decode through the two device-tensor steps: the same reply, rounds brought in and
    rechecks as the eager tiered decode."""
    # 3 tokens: a round is brought in by the third (the GPU test decodes 10, through a second one)
    eager, static = tiered_replies("cpu", ("eager", "static"), max_tokens=3)
    assert eager == static


@interpreted
def test_interpreted_decode_over_window_rings(models, monkeypatch):
    """Gemma 3's window layers kept in rings of 12 (window 8): the kernel step (the one a CUDA graph captures)
    decodes what eager steps over a cache of every slot do."""
    from kvchat.engine.kv import cache as cache_module
    from kvchat.engine.model.cuda_graph import GraphedDecode
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.decoder import decode_kernel_runs
    from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT

    monkeypatch.setattr(cache_module, "RING_SLACK", 4)
    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")
    m = engine.model
    assert decode_kernel_runs(engine.config, m.dtype, m.device)
    prompt = torch.tensor(engine.encode_prompt(REFERENCE_PROMPT))
    runs = []
    for ring in (False, True):
        cache = m.new_cache(128, ring=ring)
        logits = [m(prompt, cache)[-1]]
        step = GraphedDecode(m, cache, 128, capture=False) if ring else (lambda t: m(torch.tensor([t]), cache)[-1])
        for _ in range(2):
            logits.append(step(int(logits[-1].argmax())).clone())
        runs.append(torch.stack(logits))
    assert cache.ring_size == 12 and cache.length > 2 * 12
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5 * float(runs[0].abs().max()))


def test_the_kernel_in_triton_s_interpreter():
    if INTERPRET:
        pytest.skip("already in the interpreter")
    # + split counts, per-head lists, windows, rings, length, 3 engine tests
    assert passed_in_interpreter(__file__) == len(INTERPRETER_CASES) + 3 + 2 + 4 + 4 + 4


# --- in this process: what the kernel refuses, and the engine's fallback ---

@pytest.mark.parametrize("shape, reason", [
    ((32, 8, 512, torch.bfloat16), "head size 512"),
    ((32, 8, 128, torch.float64), "dtype torch.float64"),
    ((32, 6, 128, torch.bfloat16), "32 query heads over 6 KV heads"),
    ((256, 1, 64, torch.float16), "256 query heads per KV head"),
])
def test_unsupported_shapes_are_named(shape, reason, monkeypatch):
    monkeypatch.setattr(kernel_module, "triton_kernel_runs_on", lambda device: True)
    assert reason in unsupported_reason(*shape, "cuda")


def test_unsupported_shape_falls_back_to_sdpa_and_says_so_once(models, caplog):
    """A decode step on a shape the kernel does not take (a head size of 288; on the CPU without the interpreter,
    no Triton at all) attends through SDPA with a device-built mask: the eager step's logits, one log line."""
    from kvchat.engine.model import decoder as model_module
    from kvchat.engine.model.cuda_graph import GraphedDecode
    from kvchat.engine.engine import Engine

    m = Engine(models.get(d_model=576, n_heads=2, n_kv_heads=1), device="cpu").model
    assert m.cfg.head_dim == 288
    prompt = torch.arange(5, 25)
    eager, static = m.new_cache(64), m.new_cache(64)
    m(prompt, eager), m(prompt, static)
    step = GraphedDecode(m, static, 64, capture=False)
    model_module._KERNEL_CHECKED.clear()
    with caplog.at_level("WARNING", logger="kvchat.engine.model.decoder"):
        for token in (3, 9, 4):
            torch.testing.assert_close(step(token), m(torch.tensor([token]), eager)[-1], rtol=1e-5, atol=1e-5)
    lines = [r.message for r in caplog.records if "decode attention kernel unavailable" in r.message]
    assert len(lines) == 1 and "\n" not in lines[0]


def test_bad_calls_raise_value_errors():
    q, kv = random_cache(8, 2, 64, 32, torch.float32, "cpu")
    n = torch.tensor([4])
    with pytest.raises(ValueError, match="q \\[H, D\\]"):
        decode_attention(q[None], kv[0], kv[1], n)
    with pytest.raises(ValueError, match="length must be one int32/int64"):
        decode_attention(q, kv[0], kv[1], torch.tensor([4.0]))
    with pytest.raises(ValueError, match="share a device"):
        decode_attention(q.half(), kv[0], kv[1], n)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, kv[0].transpose(1, 2).contiguous().transpose(1, 2), kv[1], n)


# --- on the GPU ---

@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_kernel_matches_reference(case):
    check_against_reference(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads", [8, 1])
def test_gpu_subset_of_slots(dtype, n_kv_heads):
    check_against_reference((32, n_kv_heads, 128, 5000, 9000, dtype), "cuda", slots=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, window", [(5000, 512), (300, 512), (32768, 4096), (1, 512)])
def test_gpu_sliding_window(dtype, n, window):
    # Gemma 3 270M's layout: 4 query heads over one KV head of 256.
    check_against_reference((4, 1, 256, n, 40000, dtype), "cuda", window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 300, 5000, 32768])
def test_gpu_window_in_a_ring(dtype, n):
    check_ring((4, 1, 256, n, dtype), "cuda", 512, 2560)  # gemma-3-270m's window in the engine's ring


@pytest.mark.gpu
def test_gpu_one_captured_graph_serves_every_length():
    q, kv = random_cache(32, 8, 128, 40000, torch.bfloat16, "cuda")
    length = torch.tensor([40000], device="cuda")
    decode_attention(q, kv[0], kv[1], length)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, kv[0], kv[1], length)
    for n in (1, 100, 4097, 32768, 40000):
        length.fill_(n)
        graph.replay()
        torch.testing.assert_close(out, decode_attention_ref(q, kv[0], kv[1], n), **tolerances(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_tiered_graph_decode_is_eager_decode():
    """The tiered cache's captured replays (a round brought in between them) decode what its eager steps
    decode."""
    eager, graph = tiered_replies("cuda", ("eager", "graph"))
    assert eager == graph


@pytest.mark.gpu
def test_gpu_tiered_graphs_are_captured_before_the_first_step():
    """reserve_decode captures both replays (the reply's first step only replays them, as the full cache's does)."""
    from test_tiered_kv import QUESTION, ROUNDS, SYSTEM

    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.text.chat_format import Conversation
    from kvchat.engine.engine import Engine
    from kvchat.engine.policies import make_policy
    from kvchat.engine.kv.tiered import TieredKV

    engine = Engine(DEFAULT_MODEL, device="cuda", dtype=torch.float32)
    policy = make_policy("round-topk", engine, watershed=2, k=1)
    policy.progressive, policy.recheck_below = False, 0.0  # no round brought in: nothing is captured again
    tiered = TieredKV(engine.model, policy, 512, decode="graph")
    for span in engine.chat.round_spans(Conversation(ROUNDS, SYSTEM)):
        tiered.prefill(span)
        tiered.close_round()
    logits = tiered.prefill(engine.chat.open_round_tokens(Conversation(ROUNDS, SYSTEM), QUESTION))
    tiered.reserve_decode(8)
    decoder = tiered._replayed
    lower, upper = decoder._lower, decoder._upper
    assert lower is not None and lower.graph is not None and upper is not None and upper.graph is not None
    for _ in range(4):
        logits = tiered.step(int(logits.argmax()))
    assert decoder._lower is lower and decoder._upper is upper
