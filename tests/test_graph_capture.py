"""The CUDA-graph decode steps' capture and replay (engine.model.cuda_graph, the tiered cache's and LoopServe's
replays) on the CPU, through a stand-in for torch.cuda.CUDAGraph (graph_standin.py) that replays the captured
operations on the captured tensors rather than calling the step again: the CPU counterparts of test_gpu.py's and
test_decode_attention.py's graph tests (docs/testing.md). The steps take their torch paths here; the Triton kernels
they launch on CUDA are checked in the interpreter (test_decode_attention.py, test_decode_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from graph_standin import CaptureError, standin_graphs
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.model.cuda_graph import GraphedDecode, Replay, graphed_decode
from kvchat.engine.train.synthetic import REFERENCE_MODELS, REFERENCE_PROMPT

CPU = torch.device("cpu")
# Of test_gpu.py's SPECS: Llama with fp16 weights, MQA with biases, Qwen 3's head norms, Gemma 3's windows of 8.
SPECS = [dict(qtype=Q.F16), dict(arch="qwen2", style="chatml", n_kv_heads=1), REFERENCE_MODELS["qwen3-f32"],
         REFERENCE_MODELS["gemma3-f32-swa"]]
TOKENS = 16


# ---------------------------------------------------------------- the stand-in itself


def test_a_replay_reruns_the_captured_operations_on_the_captured_tensors():
    """What a CUDA graph does: device tensors read at replay, Python values frozen at capture, outputs rewritten in
    place, the step itself not called again; the capture's own outputs hold garbage until the first replay."""
    x, scale, calls = torch.zeros(3), [2.0], []

    def step():
        calls.append(1)
        return x * torch.tensor(scale[0]) + 1

    with standin_graphs() as graphs:
        replay = Replay(step, CPU)
        assert len(calls) == 3 and len(graphs.graphs) == 1  # two warm-ups and the capture, as on CUDA
        assert replay.outputs.isnan().all()
        x.fill_(5.0)
        scale[0] = 100.0
        out = replay()
        assert out is replay.outputs and torch.equal(out, torch.full((3,), 11.0))  # 5 * 2 + 1: the scale of then
        assert len(calls) == 3 and graphs.graphs[0].replays == 1
        assert torch.equal(Replay(step, CPU, capture=False)(), torch.full((3,), 501.0))  # the step called anew


@pytest.mark.parametrize("read", [lambda x: x.sum().item(), lambda x: x[x > 0], lambda x: bool(x.any())],
                         ids=["item", "boolean index", "bool"])
def test_a_host_read_inside_the_capture_is_refused(read):
    x = torch.ones(4)
    with standin_graphs(), pytest.raises(CaptureError, match="reads a device value on the host"):
        Replay(lambda: read(x), CPU)


def test_without_the_stand_in_the_cpu_refuses_to_capture():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        Replay(lambda: torch.zeros(1), CPU)


# ---------------------------------------------------------------- what a dropped cache leaves behind


def test_a_dropped_cache_and_its_captured_steps_are_freed_at_once(models):
    """A KV cache, its kept decode graph (`graphed_decode`) and a policy's slot-list step are freed as soon as they
    are dropped, not when the cycle collector runs: a cycle through a replay once kept a 32k chat's 4 GiB of K/V on
    the GPU beside the next one's, and a budgeted run ran out of memory (docs/benchmarks.md, issue 41)."""
    import gc
    import weakref

    from kvchat.engine.policies.slot_lists import SlotListDecode

    engine = Engine(models.get(**SPECS[0]), device="cpu", dtype=torch.float32)
    m = engine.model
    prompt = torch.tensor(engine.encode_prompt(REFERENCE_PROMPT))
    collecting = gc.isenabled()
    gc.disable()
    try:
        with standin_graphs():
            for make_step in (lambda cache: graphed_decode(m, cache, 96),
                              lambda cache: SlotListDecode(m, cache, 0, 96, None, capture=True)):
                cache = m.new_cache(96)
                m(prompt, cache)
                step = make_step(cache)
                step(1)
                gone = weakref.ref(cache), weakref.ref(step), weakref.ref(step._replay)
                del cache, step
                assert [ref() for ref in gone] == [None, None, None]
    finally:
        if collecting:
            gc.enable()


# ---------------------------------------------------------------- the full cache's captured step


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_captured_decode_equals_eager_decode(models, spec):
    """test_gpu.py::test_cuda_graph_decode_equals_eager_decode on the CPU: one capture, replayed per token."""
    engine = Engine(models.get(**spec), device="cpu", dtype=torch.float32)
    prompt = engine.encode_prompt(REFERENCE_PROMPT)
    with standin_graphs() as graphs:
        runs = [generate(engine.model, engine.new_cache(), prompt, decoder=engine.tokenizer.stream_decoder(),
                         max_tokens=TOKENS, cuda_graph=graph) for graph in (False, True)]
    assert [g.replays for g in graphs.graphs] == [TOKENS - 1]
    assert runs[0].tokens == runs[1].tokens


def test_captured_decode_over_window_rings_equals_eager_decode(models, monkeypatch):
    """test_gpu.py's window-ring test on the CPU: Gemma 3's window layers in rings of 12 (window 8), wrapped many
    times by the prompt and the reply; the capture's runs write a ring place that holds a live slot and put it
    back."""
    from kvchat.engine.kv import cache as cache_module

    monkeypatch.setattr(cache_module, "RING_SLACK", 4)
    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu", dtype=torch.float32)
    prompt = engine.encode_prompt(REFERENCE_PROMPT)
    caches = (engine.new_cache(), engine.new_cache(ring=True))
    with standin_graphs() as graphs:
        runs = [generate(engine.model, cache, prompt, decoder=engine.tokenizer.stream_decoder(), max_tokens=TOKENS,
                         cuda_graph=graph) for cache, graph in zip(caches, (False, True))]
    assert caches[1].ring_size == 12 and caches[1].capacity == 256 and len(graphs.graphs) == 1
    assert runs[0].tokens == runs[1].tokens


def greedy_pair(model, step, eager, token: int, n: int) -> int:
    """n greedy tokens from `token` through `step` and eagerly over the cache `eager`: the same logits each time.
    The next token."""
    for _ in range(n):
        logits = step(token).clone()
        torch.testing.assert_close(logits, model(torch.tensor([token]), eager)[-1], rtol=1e-4, atol=1e-4)
        token = int(logits.argmax())
    return token


def test_the_graph_is_kept_while_its_storage_holds_and_captured_again_when_it_moves(models):
    """graphed_decode's bookkeeping: one capture serves a cache across replies and a truncation (a retracted round);
    a grown cache or rotary table is a new tensor, so the graph is captured again, and the old one refuses to run."""
    engine = Engine(models.get(**REFERENCE_MODELS["qwen3-f32"]), device="cpu", dtype=torch.float32)
    m = engine.model
    prompt = torch.tensor(engine.encode_prompt(REFERENCE_PROMPT))
    cache, eager = m.new_cache(64), m.new_cache(64)
    token = int(m(prompt, cache)[-1].argmax())
    m(prompt, eager)
    with standin_graphs() as graphs:
        step = graphed_decode(m, cache, 48)
        token = greedy_pair(m, step, eager, token, 4)
        assert graphed_decode(m, cache, 56) is step and len(graphs.graphs) == 1  # the next reply, within capacity
        n = cache.length - 3
        cache.truncate(n)
        eager.truncate(n)
        assert graphed_decode(m, cache, 48) is step  # a shorter cache: the same storage, the same graph
        token = greedy_pair(m, step, eager, token, 3)  # written from slot n on, attending to [0, n]
        grown = graphed_decode(m, cache, cache.capacity + 1)  # more slots than the storage holds: it grows
        assert grown is not step and len(graphs.graphs) == 2 and cache.capacity == 128
        with pytest.raises(RuntimeError, match="outgrew the captured decode graph"):
            step(token)
        token = greedy_pair(m, grown, eager, token, 3)
        m.reserve_rotations(4 * m.rope.c_table.shape[0])  # the rotary table grows (a new tensor)
        again = graphed_decode(m, cache, 60)
        assert again is not grown and len(graphs.graphs) == 3
        greedy_pair(m, again, eager, token, 2)
    assert [g.replays for g in graphs.graphs] == [7, 3, 2]


def test_a_graph_kept_past_its_storage_loses_what_it_decodes(models, monkeypatch):
    """Why `fits` must hold: with its check bypassed, a graph captured before the cache grew writes its token's K/V
    into the old storage, which the stand-in keeps as a GPU would, and the cache's next step misses it (the checks
    above can fail)."""
    engine = Engine(models.get(**REFERENCE_MODELS["qwen3-f32"]), device="cpu", dtype=torch.float32)
    m = engine.model
    prompt = torch.tensor(engine.encode_prompt(REFERENCE_PROMPT))
    cache, eager = m.new_cache(64), m.new_cache(64)
    token = int(m(prompt, cache)[-1].argmax())
    m(prompt, eager)
    monkeypatch.setattr(GraphedDecode, "fits", lambda self, cache, capacity: True)
    with standin_graphs():
        step = graphed_decode(m, cache, 48)
        token = greedy_pair(m, step, eager, token, 2)
        cache.reserve(cache.capacity + 1)  # a new tensor, the slots so far copied over
        token = greedy_pair(m, step, eager, token, 1)  # right logits: the old storage holds the whole history
    want = m(torch.tensor([token]), eager)[-1]
    got = m(torch.tensor([token]), cache)[-1]  # over the new storage, where the last token's K/V never went
    assert (got - want).abs().max() > 1e-2 * want.abs().max()


# ---------------------------------------------------------------- the tiered cache's two replays


def test_tiered_graph_decode_is_eager_decode():
    """test_decode_attention.py::test_gpu_tiered_graph_decode_is_eager_decode on the CPU: Round Attention's decode
    through its two captured replays, a round brought into `upper` between them while decoding, gives the eager
    tiered decode's reply, rounds brought in and rechecks."""
    from test_decode_attention import tiered_replies

    with standin_graphs() as graphs:
        eager, graph = tiered_replies("cpu", ("eager", "graph"))
    assert eager == graph
    assert len(graphs.graphs) >= 2 and all(g.replays for g in graphs.graphs)


def test_tiered_graphs_are_captured_before_the_first_step():
    """test_decode_attention.py::test_gpu_tiered_graphs_are_captured_before_the_first_step on the CPU:
    reserve_decode captures both replays, and the reply's steps only replay them."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.kv.tiered import TieredKV
    from kvchat.engine.policies import make_policy
    from kvchat.engine.text.chat_format import Conversation
    from test_tiered_kv import QUESTION, ROUNDS, SYSTEM

    engine = Engine(DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    policy = make_policy("round-topk", engine, watershed=2, k=1)
    policy.progressive, policy.recheck_below = False, 0.0  # no round brought in: nothing is captured again
    with standin_graphs() as graphs:
        tiered = TieredKV(engine.model, policy, 512, decode="graph")
        for span in engine.chat.round_spans(Conversation(ROUNDS, SYSTEM)):
            tiered.prefill(span)
            tiered.close_round()
        logits = tiered.prefill(engine.chat.open_round_tokens(Conversation(ROUNDS, SYSTEM), QUESTION))
        tiered.reserve_decode(8)
        decoder = tiered._replayed
        lower, upper = decoder._lower, decoder._upper
        assert [lower.graph, upper.graph] == graphs.graphs
        for _ in range(4):
            logits = tiered.step(int(logits.argmax()))
    assert decoder._lower is lower and decoder._upper is upper and [g.replays for g in graphs.graphs] == [4, 4]


def test_round_attention_over_windows_in_captured_steps(models):
    """test_sliding_windows.py::test_round_attention_over_windows_in_cuda_graphs on the CPU: the packed upper
    tier's window is a device-built mask over slot positions inside the captured step."""
    from test_sliding_windows import full_run, tiered_run

    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu", dtype=torch.float32)
    with standin_graphs() as graphs:
        got, _, _ = tiered_run(engine, "graph", k=1)
    want = full_run(engine)[0]
    assert graphs.graphs and ((got - want).abs().max() / want.abs().max()) < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ---------------------------------------------------------------- LoopServe's progressive step


def test_progressive_captured_step_is_the_eager_step():
    """test_progressive_decode.py::test_gpu_the_captured_step_is_the_eager_step on the CPU: captured once and
    replayed through three choices (the per-layer lists rewritten between replays), the uncaptured step's logits."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.policies.progressive_decode import ProgressiveDecode
    from test_progressive_decode import decode, prefilled

    engine = Engine(DEFAULT_MODEL, device="cpu")
    runs = []
    with standin_graphs() as graphs:
        for capture in (True, False):
            cache, logits, _ = prefilled(engine)
            step = ProgressiveDecode(engine.model, cache, 0, 200, budget=12, interval=4, warmup=4, capture=capture)
            runs.append(decode(step, logits, 14))
            assert step.selections == 3
    assert [g.replays for g in graphs.graphs] == [14]
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)
