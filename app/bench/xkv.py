"""XKV's speed figures (`kvchat bench xkv`): decode over the full cache against decode over per-layer budgets
(xkv, and the uniform baseline at the same budget), on a real chat's tokens (MT-Bench in the model's template),
each pair in the same run. xkv here shares its budget by the paper's equal weights (`make_policy`: no layer costs
are measured for a random-weight shape); the model's layer costs move slots between layers, not their number, so the
bytes a step reads and its time are the same.

Per context and budget: tokens/s of each (the median of `repeats` runs of `decode_tokens` greedy steps, the step
built — a CUDA graph captured — before the clock starts); the bytes each step reads (the weights as placed, plus
the K/V the lists name: measured from the lists, not assumed from the budget); the bound those bytes set on the
speed-up (bytes of the full step / bytes of the budgeted one) and the share of it reached; the time the choice
takes after a prefill (the window's queries recomputed, scored, allocated: what it adds to the time to first
token) beside the prefill's own. The full step at 256 tokens measures the part of a step no budget removes, and with
it each row's time bound (the full step less the K/V time its budget leaves unread: the byte bound counts a weight
byte and a K/V byte alike, and the step does not read them at one speed). For xkv as a chat runs it (the look-ahead
kept), the time to the reply's second token and the pause where the reply leaves the look-ahead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kvchat.app.bench.loopserve import CHUNK, chat_tokens, decode_rates
from kvchat.engine.engine import Engine
from kvchat.engine.kv.host_resident import HostResidentKV
from kvchat.app.bench.engine_speed import quantized_matrices
from kvchat.engine.model.cuda_graph import decoder_step
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.budgets import LayerBudgetPolicy, LookAheadThenBudget
from kvchat.engine.timing import sync, timed_runs

# The new message: the context's last tokens, as many as the policies' observation window scores by default.
MESSAGE_TOKENS = LayerBudgetPolicy.window
LOOKAHEAD = LayerBudgetPolicy.lookahead  # the policies' default look-ahead (docs/benchmarks.md, "XKV looking ahead")
FLOOR_CONTEXT = 256  # the short context whose full step is the part of a step no budget removes


@dataclass
class XKVFigures:
    model: str
    device: str
    contexts: list[dict] = field(default_factory=list)


def weight_bytes(engine: Engine) -> int:
    """The bytes of weights one decode step reads (as placed on the device; quantized matrices in their blocks)."""
    kept = quantized_matrices(engine.model)
    return sum(p.numel() * p.element_size() for p in engine.model.parameters()) + sum(m.nbytes for m in kept)


def kv_bytes_read(engine: Engine, kept: list[int], reply: int) -> int:
    """K/V bytes one decode step reads when layer i reads kept[i] input slots per KV head, plus `reply` tokens."""
    cfg = engine.config
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * engine.model.dtype.itemsize
    return sum(n + reply for n in kept) * per_slot


@torch.inference_mode()
def decode_figures(engine: Engine, context: int, budgets: list[float], repeats: int = 3,
                   decode_tokens: int = 128) -> dict:
    model, device = engine.model, engine.device
    tokens = chat_tokens(engine, context)
    capacity = context + decode_tokens + 2
    window = tokens[-MESSAGE_TOKENS:].tolist()

    def prefill():
        cache = model.new_cache(capacity)
        for s in range(0, context, CHUNK):
            model(tokens[s : s + CHUNK], cache)
        return cache

    prefill_s = timed_runs(prefill, device, 1)[0]
    cache = prefill()

    def rates(make_step) -> list[float]:
        return decode_rates(cache, context, make_step, device, repeats, decode_tokens)

    weights = weight_bytes(engine)
    full_kv = kv_bytes_read(engine, [context] * engine.config.n_layers, decode_tokens // 2)
    figures: dict = {"context": context, "prefill_s": prefill_s, "weight_bytes": weights,
                     "full_kv_bytes": kv_bytes_read(engine, [context] * engine.config.n_layers, decode_tokens),
                     "full": {"tok_s": rates(lambda: decoder_step(model, cache, capacity, None)),
                              "bytes_per_token": weights + full_kv}, "budgets": []}
    full_rate = statistics.median(figures["full"]["tok_s"])
    # The step's cost that no budget removes (the weights, launches, the head): the full step at a short context.
    # With it the K/V's share of the full step's time is measured, and with that the time bound of a budget (the
    # byte bound counts a weight byte and a K/V byte alike; the step does not read them at one speed).
    floor = FLOOR_CONTEXT if context > 2 * FLOOR_CONTEXT else 0
    floor_rate = step_floor_rate(engine, tokens, repeats, decode_tokens) if floor else None
    figures["floor"] = {"context": floor, "tok_s": floor_rate}
    for budget in budgets:
        # xkv twice: through slot lists over the full cache, and over a working set of the kept slots alone
        # (each looking ahead, the default: its step is ready after the look-ahead, the choice and the first budgeted
        # token), and xkv choosing from the window alone (the paper's choice: ready after the choice)
        # The look-ahead is taken back in these rows (`keep_ahead=false`): the greedy reply would otherwise follow
        # it, and its first tokens would come from the full cache's logits, not from the budgeted step timed here.
        for name, working_set, lookahead in (("xkv", False, LOOKAHEAD), ("xkv", True, LOOKAHEAD),
                                             ("uniform", False, LOOKAHEAD), ("xkv", False, 0)):
            policy = make_policy(name, engine, budget=budget, working_set=working_set, lookahead=lookahead,
                                 keep_ahead=False)
            cache.length = context
            policy.visible_slots(cache, [], window, model=model)
            choose_s = timed_runs(lambda: policy.choose(model, cache), device, 3)
            made: list = []
            last_step: list = []
            ready_s: list = []

            def step(policy=policy, made=made, last_step=last_step, ready_s=ready_s, lookahead=lookahead):
                cache.length = context
                last_step.clear()  # the latest only: each holds a captured graph
                sync(device)
                t0 = time.perf_counter()
                s = policy.decode_step(model, cache, context - len(window), None, capacity, None)
                if lookahead:
                    s(1)  # the look-ahead, the choice and the budgeted step's first token
                sync(device)
                ready_s.append(time.perf_counter() - t0)
                made.append(policy.last_choice)
                last_step[:] = [s]
                return s

            tok_s = rates(step)
            made_step = last_step[0].step if isinstance(last_step[0], LookAheadThenBudget) else last_step[0]
            working_bytes = made_step.working.device_bytes() if working_set else None
            last_step.clear()
            figures["budgets"].append({
                "policy": name + ("+working-set" if working_set else "") + ("" if lookahead else "+window"),
                "budget": budget, "working_set_bytes": working_bytes, "choose_ms": 1e3 * statistics.median(choose_s),
                # decode_step made and ready (the choice, the graph's capture; with a look-ahead, it and the first
                # budgeted token too): what delays the reply's second token (the first comes from the prefill)
                "ready_ms": 1e3 * statistics.median(ready_s[1:] or ready_s),
                **(kept_ahead_figures(engine, cache, context, window, budget, capacity)
                   if (name, working_set, lookahead) == ("xkv", False, LOOKAHEAD) else {}),
                **speed_figures(engine, made[-1], tok_s, weights, full_kv, full_rate, decode_tokens, floor_rate)})
        figures["budgets"].append(host_resident_figures(engine, cache, tokens, budget, repeats, decode_tokens,
                                                        weights, full_kv, full_rate, floor_rate))
    return figures


def step_floor_rate(engine: Engine, tokens: torch.Tensor, repeats: int, decode_tokens: int) -> float:
    """Tokens/s of the full cache's step after the chat's first FLOOR_CONTEXT tokens (in a cache of its own): the
    part of a decode step that no KV budget removes (weights, launches, the head)."""
    model = engine.model
    short = model.new_cache(FLOOR_CONTEXT + decode_tokens + 2)
    model(tokens[:FLOOR_CONTEXT], short)
    return statistics.median(decode_rates(short, FLOOR_CONTEXT, lambda: decoder_step(
        model, short, FLOOR_CONTEXT + decode_tokens + 2, None), engine.device, repeats, decode_tokens))


def time_bound(full_rate: float, floor_rate: float, kv_read: int, full_kv: int) -> float:
    """The speed-up a step reading `kv_read` of the full step's `full_kv` K/V bytes can have at best: the full
    step's time less the share of its K/V time (the full step's time above the floor's) left unread."""
    full_s, floor_s = 1 / full_rate, 1 / floor_rate
    return full_s / (floor_s + max(full_s - floor_s, 0.0) * kv_read / full_kv)


def kept_ahead_figures(engine: Engine, cache, context: int, window: list[int], budget: float, capacity: int,
                       runs: int = 3) -> dict:
    """xkv as a chat runs it (the look-ahead kept): the time from the reply's first token to its second (the step
    made, its graph captured, the look-ahead decoded: what a user waits for once the first token shows), and the
    pause where the reply leaves the look-ahead (the choice, the lists rewritten, the first budgeted token)."""
    model, device = engine.model, engine.device
    second, leave = [], []

    def clock() -> float:
        sync(device)
        return time.perf_counter()

    for _ in range(runs + 1):  # the first warms up
        policy = make_policy("xkv", engine, budget=budget)
        cache.length = context
        policy.visible_slots(cache, [], window, model=model)
        t0 = clock()
        step = policy.decode_step(model, cache, context - len(window), None, capacity, None)
        if not isinstance(step, LookAheadThenBudget):  # no look-ahead here (a budget keeping every slot, say)
            return {}
        step(1)
        t1 = clock()
        # a token the look-ahead did not pick
        step((step.ahead[1] + 1) % engine.config.vocab_size if len(step.ahead) > 1 else 1)
        t2 = clock()
        second.append(t1 - t0)
        leave.append(t2 - t1)
        step.finish()
        del step
    return {"second_token_ms": 1e3 * statistics.median(second[1:]),
            "leave_ms": 1e3 * statistics.median(leave[1:])}


def speed_figures(engine: Engine, choice, tok_s: list[float], weights: int, full_kv: int, full_rate: float,
                  decode_tokens: int, floor_rate: float | None = None) -> dict:
    """A budgeted decode's rates beside the full cache's: the bytes a step reads (weights and the K/V the choice
    keeps, the reply half written), the bound those bytes set on the speed-up, and the share of it reached; with the
    full step's rate at a short context (`floor_rate`), the time bound too: the full step's time less the part of its
    K/V time the budget does not read."""
    kv_read = kv_bytes_read(engine, choice.kept, decode_tokens // 2)
    read = weights + kv_read
    bound = (weights + full_kv) / read
    speedup = statistics.median(tok_s) / full_rate
    out = {"tok_s": tok_s, "kept_share": choice.kept_share, "bytes_per_token": read, "speedup": speedup,
           "bound": bound, "share_of_bound": speedup / bound,
           "retention": sum(choice.retention) / max(len(choice.retention), 1)}
    if floor_rate:
        out["time_bound"] = time_bound(full_rate, floor_rate, kv_read, full_kv)
        out["share_of_time_bound"] = speedup / out["time_bound"]
    return out


@torch.inference_mode()
def host_resident_figures(engine: Engine, cache, tokens, budget: float, repeats: int, decode_tokens: int,
                          weights: int, full_kv: int, full_rate: float, floor_rate: float | None = None) -> dict:
    """xkv with the chat's K/V in host memory (engine.kv.host_resident): the history copied there from the
    device cache layer by layer (as a restore would place it), the message (the last MESSAGE_TOKENS) streamed through
    the device, then the reply over the working set. The K/V the device holds is measured twice: as the cache
    accounts it (one staged layer while reading, the working set while writing) and as the allocator saw it (its
    peak above what was allocated before, the bench's own full cache aside)."""
    model, device, cfg = engine.model, engine.device, engine.config
    context = len(tokens)
    history = context - MESSAGE_TOKENS
    policy = make_policy("xkv", engine, budget=budget, working_set=True)
    hk = HostResidentKV(model, policy, context + decode_tokens + 2)
    for layer in range(cfg.n_layers):
        hk.host.write(range(layer, layer + 1), 0, cache.read(range(layer, layer + 1), 0, history))
    hk.host.length = history
    window = tokens[history:].tolist()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    stream_s = timed_runs(lambda: (hk.truncate(history), hk.prefill_prompt(model, window)), device, repeats)
    tok_s = decode_rates(hk.host, context, lambda: hk.decode_step(model, decode_tokens + 1, 1 << 30), device,
                         repeats, decode_tokens)
    allocated = (torch.cuda.max_memory_allocated(device) - before) if device.type == "cuda" else None
    return {"policy": "xkv+host", "budget": budget, "working_set_bytes": hk.device_bytes(),
            "stage_bytes": hk.peak_stage_bytes, "allocator_peak_bytes": allocated,
            "stream_ms": 1e3 * statistics.median(stream_s),
            "choose_ms": None,  # chosen inside the stream, not after it
            **speed_figures(engine, policy.last_choice, tok_s, weights, full_kv, full_rate, decode_tokens, floor_rate)}


def bench_model(engine: Engine, contexts: list[int], budgets: list[float], repeats: int = 3, log=print,
                decode_tokens: int = 128) -> XKVFigures:
    figures = XKVFigures(str(engine.path), torch.cuda.get_device_name(engine.device)
                         if engine.device.type == "cuda" else "cpu")
    for context in contexts:
        f = decode_figures(engine, context, budgets, repeats, decode_tokens)
        figures.contexts.append(f)
        full = f["full"]
        log(f"  {context} tokens: prefill {f['prefill_s'] * 1e3:,.0f} ms; full decode "
            f"{statistics.median(full['tok_s']):.1f} tok/s ({min(full['tok_s']):.1f}-{max(full['tok_s']):.1f}), "
            f"{full['bytes_per_token'] / 2**20:,.1f} MiB a token"
            + (f"; at {f['floor']['context']} tokens {f['floor']['tok_s']:.1f} tok/s (the part no budget removes)"
               if f.get("floor", {}).get("tok_s") else ""))
        for b in f["budgets"]:
            held = (f"; working set {b['working_set_bytes'] / 2**20:,.1f} MiB of the full cache's "
                    f"{f['full_kv_bytes'] / 2**20:,.1f}" if b["working_set_bytes"] is not None else "")
            if "stage_bytes" in b:
                held += (f"; the message streamed through the device in {b['stream_ms']:,.1f} ms, one layer staged "
                         f"at a time ({b['stage_bytes'] / 2**20:,.1f} MiB)")
                if b["allocator_peak_bytes"] is not None:
                    held += f"; allocator peak {b['allocator_peak_bytes'] / 2**20:,.1f} MiB above the run's start"
            choice = "" if b["choose_ms"] is None else f"choice {b['choose_ms']:.1f} ms; "
            if b.get("ready_ms") is not None:
                choice += f"step ready in {b['ready_ms']:.1f} ms; "
            if b.get("second_token_ms") is not None:
                choice += (f"look-ahead kept: second token after {b['second_token_ms']:.1f} ms, leaving it "
                           f"{b['leave_ms']:.1f} ms; ")
            if b.get("time_bound") is not None:
                choice += f"{b['share_of_time_bound']:.0%} of the time bound's {b['time_bound']:.2f}x; "
            log(f"    {b['policy']:<8} {b['budget']:g}: {statistics.median(b['tok_s']):.1f} tok/s "
                f"({min(b['tok_s']):.1f}-{max(b['tok_s']):.1f}), {b['kept_share']:.1%} of the K/V read, "
                f"{b['bytes_per_token'] / 2**20:,.1f} MiB a token; {b['speedup']:.2f}x of the bound's "
                f"{b['bound']:.2f}x ({b['share_of_bound']:.0%}); {choice}attention kept "
                f"{b['retention']:.1%}{held}")
    return figures


def as_dict(figures: XKVFigures) -> dict:
    return asdict(figures)
