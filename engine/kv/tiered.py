"""Round Attention's tiered KV cache (round-attention.txt §3.2, Algorithm 1).

Layers [0, split) of every round stay on the device in `lower`, an ordinary KVCache whose slots are the tokens'
positions. Layers [split, L) of each closed round live in host memory (pinned on CUDA), token-major
[n, L - split, 2, Hkv, D] so one round is one contiguous block. For each new message:

    1. its tokens run through layers [0, w) (w = split - 1, the watershed layer), attending to every round;
    2. their queries at layer w score every earlier round (kernels.round_scores.round_mass) and the policy picks
       rounds from that mass (the first round, the attention sink holding the system prompt, is always kept);
    3. the picked rounds' upper K/V are copied to the front of `upper`, a KVCache of the upper layers, one round at
       a time (a contiguous host-to-device copy into a staging block of that round's size); rounds still there
       from the previous message move to the front instead; the message's own upper K/V follow;
    4. the message finishes layer w and the upper layers attend to `upper` as a plain prefix: fewer keys, no mask;
    5. during decoding (progressive selection, LoopServe's idea) each token's query at layer w may name a round
       that is not yet in `upper`; it is brought in before the token's upper layers run;
    6. a decoded token the model is unsure of (top probability below the policy's `recheck_below`) is rechecked:
       its queries at the upper layers are scored against every closed round's key bounds (engine.kv.key_bounds, kept
       on the device at 1/32 of the upper keys), and a round that could hold at least `recheck_mass` of its
       attention at any of them is brought in and the token's upper layers run again with it.

A closed round's upper K/V is copied back to host memory. So `upper` never needs to hold two copies of itself:
when it must grow, its buffer is let go first and the resident rounds are put back from host memory (`_grow_upper`),
and its peak is one copy of the tier plus one round, as the GPU memory plan counts (engine.memory_plan.tiered_kv).
A round not picked for `max_idle` messages is dropped from host memory; `upper_source` (the chat store) or, failing
that, a recompute brings it back when needed.

TieredKV is a KVStore (engine.kv.base): generation drives it as it drives the full cache. Its decode step replayed
from CUDA graphs is engine.kv.tiered_decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from kvchat.engine.kv.key_bounds import BoundsTable, key_bounds
from kvchat.engine.kv.tiered_decode import TieredDecode
from kvchat.engine.memory_plan import TIERED_REPLY_ROOM
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.kernels.round_scores import round_mass

# Round index -> its upper K/V token-major in host memory [n, L - split, 2, Hkv, D] (see `host_layout`), or None.
UpperSource = Callable[[int], Tensor | None]
# Free upper slots past a message when the tier is laid out for it: the reply's room (a longer reply grows the tier
# once, at its start) and a small round brought in while decoding. The GPU memory plan counts them.
REPLY_ROOM = TIERED_REPLY_ROOM
UpperHint = Callable[[list[int]], None]  # rounds about to be asked of the UpperSource, all at once
TokenSource = Callable[[int], list[int]]


@dataclass
class TieredStats:
    """What the latest message cost and kept (bench, eval and the TUI status read it)."""

    rounds: int = 0  # closed rounds before the message
    chosen: list[int] = field(default_factory=list)  # picked at the prompt
    added: list[int] = field(default_factory=list)  # brought in while decoding
    select_ms: float = 0.0  # scoring and picking at the prompt (the lower-layer prefill itself not counted)
    decode_select_ms: float = 0.0  # scoring each decoded token (progressive selection)
    transfer_ms: float = 0.0  # host-to-device copies of picked rounds' upper K/V (prompt and decoding)
    transfer_bytes: int = 0
    prompt_transfer_ms: float = 0.0  # the part before the first token
    fetched: list[int] = field(default_factory=list)  # rounds whose upper K/V had to come from `upper_source`
    recomputed: list[int] = field(default_factory=list)  # rounds whose upper K/V had to be recomputed
    dropped: list[int] = field(default_factory=list)  # rounds whose host copy was released after this message
    rechecks: int = 0  # decoded tokens whose queries were scored against every round's key bounds
    recheck_ms: float = 0.0
    found: list[int] = field(default_factory=list)  # rounds the rechecks brought in
    bounds_computed: list[int] = field(default_factory=list)  # rounds whose key bounds had to be computed


class TieredKV:
    def __init__(self, model: Transformer, policy, capacity: int = 256, decode: str | None = None):
        """`policy` is a RoundAttention policy: its `split`, `choose(mass)`, `progressive`, `max_idle`.
        `decode`: how decode steps run: "graph" (the default on CUDA) replays them from CUDA graphs, "static" runs
        the same device-tensor steps without graphs (tests), "eager" (the default elsewhere) layer by layer."""
        cfg = model.cfg
        self.decode_mode = decode or ("graph" if model.device.type == "cuda" else "eager")
        if self.decode_mode not in ("graph", "static", "eager"):
            raise ValueError(f"unknown decode mode {decode!r} (accepted: graph, static, eager)")
        self._replayed: TieredDecode | None = None
        self.model, self.policy = model, policy
        self.split = policy.split
        if not 1 <= self.split < cfg.n_layers:
            raise ValueError(f"split layer {self.split} must leave both tiers at least one of {cfg.n_layers} layers")
        self.lower = model.new_cache(capacity, range(0, self.split))
        self.upper = model.new_cache(256, range(self.split, cfg.n_layers))
        # Sliding-window layers (Gemma 3) above the split: their windows are over positions, and `upper` packs
        # rounds, so it keeps each slot's position; the rounds a window reaches are always brought in.
        self.windows = cfg.sliding_window > 0 and any(cfg.window(i) for i in range(self.split, cfg.n_layers))
        if self.windows:
            self.upper.track_positions()
        self.round_starts: list[int] = []  # closed rounds' first positions; the last ends at open_start
        self.host: list[Tensor | None] = []  # per closed round, token-major upper K/V or None
        self.tokens: list[list[int] | None] = []
        self.last_chosen: list[int] = []  # message number at which each round was last picked (or closed)
        self.resident: list[int] = []  # rounds whose upper K/V fill upper slots [0, upper_base), in that order
        self.upper_base = 0
        self.open_start: int | None = None  # position of the open round's first token; None when no round is open
        self.open_tokens: list[int] = []
        self.messages = 0
        self.upper_source: UpperSource | None = None
        self.upper_hint: UpperHint | None = None
        self.token_source: TokenSource | None = None
        self.key_bounds = BoundsTable(cfg.n_layers - self.split, cfg.n_kv_heads, cfg.head_dim, model.dtype,
                                      model.device)
        self.stats = TieredStats()
        self._pin = model.device.type == "cuda"
        # The latest decoded token's hidden state entering the upper layers and its queries [1, H, D] at each.
        self._upper_input: Tensor | None = None
        self._upper_queries: list[Tensor] = []

    # ---- sizes ----

    @property
    def length(self) -> int:
        """Tokens of the chat the cache holds (closed rounds and the open one)."""
        return self.lower.length

    @property
    def closed_end(self) -> int:
        return self.lower.length if self.open_start is None else self.open_start

    def device_bytes(self) -> int:
        """K/V bytes held on the device for the valid slots of both tiers, and the key bounds."""
        return self.lower.nbytes() + self.upper.nbytes() + self.key_bounds.nbytes()

    def full_bytes(self) -> int:
        """What a full cache would hold on the device for the same tokens."""
        return self.length * (self.lower.slot_bytes() + self.upper.slot_bytes())

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host if t is not None)

    # ---- building from stored K/V ----

    @torch.inference_mode()
    def add_closed_round(self, start: int, end: int, upper_kv: Tensor | None, tokens: list[int] | None = None,
                         bounds: Tensor | None = None) -> None:
        """Append a closed round whose lower K/V the caller has written to `lower` slots [start, end);
        `upper_kv` in segment layout [L - split, 2, Hkv, n, D], or None to fetch or recompute when needed;
        `bounds` its stored key bounds [L - split, 2, Hkv, nb, D], or None to compute them from `upper_kv` (now)
        or when a recheck needs them."""
        if self.open_start is not None or start != self.closed_end or end <= start:
            raise ValueError(f"round [{start}, {end}) does not follow the closed rounds (end {self.closed_end})")
        if bounds is None and upper_kv is not None:
            bounds = key_bounds(upper_kv[:, 0].to(self.model.device))
        self.round_starts.append(start)
        self.host.append(None if upper_kv is None else self._to_host(upper_kv))
        self.key_bounds.append(end - start, bounds)
        self.tokens.append(tokens)
        self.last_chosen.append(self.messages)
        self.lower.length = end

    # ---- a message ----

    @torch.inference_mode()
    def prefill(self, tokens: list[int], chunk: int = 4096) -> Tensor:
        """Append tokens to the open round (opening one, and picking rounds, if none is open); logits [V] of the
        last one."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if self.open_start is None:
            return self._open_round(tokens, chunk)
        logits = None
        for i in range(0, len(tokens), chunk):
            logits = self._run(tokens[i : i + chunk], progressive=False)
        return logits

    @torch.inference_mode()
    def step(self, token: int) -> Tensor:
        """Decode one token of the open round: logits [V]."""
        if self.open_start is None:
            raise RuntimeError("no round is open: prefill the message first")
        if self.decode_mode == "eager":
            logits = self._run([token], progressive=self.policy.progressive)
        else:
            logits = self._replayed_step(token)
        if self._should_recheck(logits):
            logits = self._recheck(logits)
        return logits

    def reserve_decode(self, n_tokens: int) -> None:
        """Room for `n_tokens` more tokens in both tiers, so that decode graphs captured now serve the whole reply
        (a round brought in while decoding may still grow `upper`: the graph is then captured again)."""
        self.lower.reserve(self.lower.length + n_tokens + 1)
        self._grow_upper(self.upper.length + n_tokens + 1)
        if self.decode_mode != "eager" and self.open_start is not None:
            self._decoder().prepare()

    # ---- KVStore: how generation drives this cache (engine.kv.base) ----

    def prefill_prompt(self, model: Transformer, tokens: list[int], attend: Attend = None,
                       chunk: int = 4096) -> Tensor:
        """`prefill`: the cache picks the rounds the prompt's upper layers see itself (`attend` does not apply) and
        runs its own model."""
        return self.prefill(tokens, chunk)

    def decode_step(self, model: Transformer, max_tokens: int, limit: int, *, attend: Attend = None,
                    first: int = 0, cuda_graph: bool | None = None, policy=None) -> Callable[[int], Tensor]:
        """`step`, with room in both tiers (and its decode graphs captured) for the reply. How it runs is the
        cache's `decode` mode and its policy's progressive selection: `attend`, `cuda_graph` and `policy` do not
        apply."""
        self.reserve_decode(min(max_tokens, limit - self.length))
        return self.step

    def truncate(self, position: int) -> None:
        """Forget every token from `position` on: inside the open round, or back to a closed round's start (the
        rounds from there on are forgotten, as when a reply is retracted)."""
        if self.open_start is not None and position > self.open_start:
            keep = min(position, self.lower.length) - self.open_start
            self.lower.truncate(position)
            self.upper.truncate(self.upper_base + keep)
            del self.open_tokens[keep:]
            return
        if position not in self.round_starts and position != self.closed_end:
            raise ValueError(f"position {position} is not the start of a round")
        keep = self.round_starts.index(position) if position in self.round_starts else len(self.round_starts)
        for lst in (self.round_starts, self.host, self.tokens, self.last_chosen):
            del lst[keep:]
        self.open_start, self.open_tokens = None, []
        self.lower.truncate(position)
        self.key_bounds.truncate(keep)
        if any(r >= keep for r in self.resident):
            self.resident, self.upper_base = [], 0
        self.upper.truncate(self.upper_base)  # the closed rounds still there serve the next message

    def _decoder(self) -> TieredDecode:
        if self._replayed is None:
            self._replayed = TieredDecode(self, capture=self.decode_mode == "graph")
        return self._replayed

    @torch.inference_mode()
    def close_round(self) -> int:
        """Close the open round: its upper K/V go to host memory. Returns its index."""
        if self.open_start is None:
            raise RuntimeError("no round is open")
        n = self.lower.length - self.open_start
        if n <= 0:
            raise RuntimeError("the open round holds no tokens")
        upper_kv = self.upper.kv[:, :, :, self.upper_base : self.upper_base + n]
        idx = len(self.round_starts)
        self.round_starts.append(self.open_start)
        self.host.append(self._to_host(upper_kv))
        self.key_bounds.append(n, key_bounds(upper_kv[:, 0]))
        self.tokens.append(list(self.open_tokens))
        self.last_chosen.append(self.messages)
        # The round's upper K/V stay where they are, now as one more resident round.
        self.resident.append(idx)
        self.upper_base += n
        self.open_start, self.open_tokens = None, []
        return idx

    def round_upper(self, r: int) -> Tensor | None:
        """Round r's upper K/V in segment layout [L - split, 2, Hkv, n, D] on the CPU (for saving)."""
        host = self.host[r]
        return None if host is None else host.permute(1, 2, 3, 0, 4).contiguous()

    @torch.inference_mode()
    def ensure_upper(self, r: int) -> None:
        """Hold round r's upper K/V in host memory (fetched from the store or recomputed if need be) and know its
        key bounds (for saving a round restored from a chat stored under the full cache)."""
        host = self._upper_of(r)
        if not self.key_bounds.known[r]:
            keys = host[:, :, 0].to(self.model.device, non_blocking=True)  # [n, Lu, Hkv, D]
            self.key_bounds.fill(r, key_bounds(keys.permute(1, 2, 0, 3)))

    def round_bounds(self, r: int) -> Tensor | None:
        """Round r's key bounds [L - split, 2, Hkv, nb, D] (a copy, for saving), or None if not computed."""
        bounds = self.key_bounds.round(r)
        return None if bounds is None else bounds.clone()

    # ---- internals ----

    def _open_round(self, tokens: list[int], chunk: int) -> Tensor:
        m, w = self.model, self.split - 1
        self.stats = TieredStats(rounds=len(self.round_starts))
        self.messages += 1
        start = self.lower.length
        self.open_start, self.open_tokens = start, []
        self.lower.reserve(start + len(tokens))
        # Layers below w never depend on the choice: run them for the whole message first.
        hs, positions, pieces = [], [], []
        for i in range(0, len(tokens), chunk):
            piece = tokens[i : i + chunk]
            pos = torch.arange(start + i, start + i + len(piece))
            hs.append(m.run_layers(m.embed(torch.tensor(piece)), pos, self.lower, start + i, layers=range(w)))
            positions.append(pos)
            pieces.append(piece)
        chosen = self._choose_for(hs, positions, start) if self.round_starts else []
        if self.windows:  # the rounds the sliding windows reach, whatever the choice
            chosen = sorted(set(chosen) | set(self._window_rounds(start)))
        self.stats.chosen = chosen
        self._bring_in(chosen, len(tokens))
        self.stats.prompt_transfer_ms = self.stats.transfer_ms
        logits = None
        for h, pos, piece in zip(hs, positions, pieces):
            logits = self._finish(h, pos, piece)
        self._drop_idle(chosen)
        return logits

    def _choose_for(self, hs: list[Tensor], positions: list[Tensor], start: int) -> list[int]:
        t0 = time.perf_counter()
        w, layer = self.split - 1, self.model.layers[self.split - 1]
        keys, starts = self.lower.layer(w)[0, :, :start], torch.tensor(self.round_starts)
        mass = None
        for h, pos in zip(hs, positions):  # the message's mean, chunk by chunk
            part = round_mass(layer.queries(h, self.model.rotations(pos)), keys, starts).cpu() * len(pos)
            mass = part if mass is None else mass + part
        chosen = self.policy.choose(mass / sum(len(p) for p in positions))
        self.stats.select_ms += 1000 * (time.perf_counter() - t0)
        for r in chosen:
            self.last_chosen[r] = self.messages
        return chosen

    def _window_rounds(self, start: int) -> list[int]:
        """The closed rounds holding any of the last `window - 1` positions before `start`."""
        first = start - self.model.cfg.sliding_window + 1
        return [r for r in range(len(self.round_starts)) if self._round_end(r) > first]

    def _round_end(self, r: int) -> int:
        return self.round_starts[r + 1] if r + 1 < len(self.round_starts) else self.closed_end

    def _place_positions(self, slot: int, first_position: int, n: int) -> None:
        """Record that upper slots [slot, slot + n) hold positions [first_position, first_position + n)."""
        if self.windows and n:
            self.upper.slot_positions[slot : slot + n] = torch.arange(first_position, first_position + n,
                                                                      device=self.upper.kv.device)

    def _run(self, tokens: list[int], progressive: bool) -> Tensor:
        m, w = self.model, self.split - 1
        pos = torch.arange(self.lower.length, self.lower.length + len(tokens))
        self.lower.reserve(int(pos[-1]) + 1)
        h = m.run_layers(m.embed(torch.tensor(tokens)), pos, self.lower, int(pos[0]), layers=range(w))
        if progressive and self.round_starts:
            self._add_during_decode(h, pos)
        return self._finish(h, pos, tokens)

    def _finish(self, h: Tensor, pos: Tensor, tokens: list[int]) -> Tensor:
        """Layer w (attending to every round) and the upper layers (attending to `upper`) for tokens at `pos`."""
        m, w, first = self.model, self.split - 1, int(pos[0])
        h = m.run_layers(h, pos, self.lower, first, layers=range(w, self.split))
        slot = self.upper_base + first - self.open_start
        self._grow_upper(slot + len(tokens))
        self._place_positions(slot, first, len(tokens))
        recheckable = len(tokens) == 1 and bool(self.policy.recheck_below)  # a recheck would need these
        self._upper_input, self._upper_queries = (h if recheckable else None), []
        h = m.run_layers(h, pos, self.upper, slot, layers=range(self.split, m.cfg.n_layers),
                         queries=self._upper_queries if recheckable else None)
        self.lower.length = first + len(tokens)
        self.upper.length = slot + len(tokens)
        self.open_tokens.extend(tokens)
        return m.head(h[-1:])[-1]

    def _add_during_decode(self, h: Tensor, pos: Tensor) -> None:
        t0 = time.perf_counter()
        self._add_named_round(self.model.layers[self.split - 1].queries(h, self.model.rotations(pos)), t0)

    def _add_named_round(self, query: Tensor, t0: float) -> bool:
        """The token's query at layer w [1, H, D] names the round it attends to most; bring it in if it is not
        resident. Whether it was brought in."""
        w = self.split - 1
        mass = round_mass(query, self.lower.layer(w)[0, :, : self.open_start], torch.tensor(self.round_starts))
        top = int(mass.argmax())
        self.stats.decode_select_ms += 1000 * (time.perf_counter() - t0)
        limit = max(2, len(self.stats.chosen))  # decoding may at most double what the prompt picked
        if top in self.resident or len(self.stats.added) >= limit:
            return False
        self.last_chosen[top] = self.messages
        self.stats.added.append(top)
        self._insert_before_open([top])
        return True

    def _replayed_step(self, token: int) -> Tensor:
        """`_run` for one decoded token through TieredDecode's two replays; the host looks at the token's query at
        w (progressive selection) between them. Logits [V]."""
        replayed, p = self._decoder(), self.lower.length
        replayed.inputs.set(token, p, p, self.upper_base + p - self.open_start)
        self._place_positions(self.upper_base + p - self.open_start, p, 1)
        replayed.run_lower()
        if self.policy.progressive and self.round_starts:
            t0 = time.perf_counter()
            if self._add_named_round(replayed.query_w, t0):  # the open round's upper slots moved up
                replayed.inputs.set_slot(1, self.upper_base + p - self.open_start)
                self._place_positions(self.upper_base + p - self.open_start, p, 1)
        logits, queries = replayed.run_upper()
        recheckable = bool(self.policy.recheck_below)
        self._upper_input, self._upper_queries = (replayed.h, queries) if recheckable else (None, [])
        self.lower.length = p + 1
        self.upper.length = self.upper_base + p + 1 - self.open_start
        self.open_tokens.append(token)
        return logits[-1]

    @torch.inference_mode()
    def _insert_before_open(self, rounds: list[int]) -> None:
        """Put `rounds`' upper K/V right after the resident rounds, moving the open round's slots up once."""
        self._announce(rounds)
        n, open_n = sum(self._round_length(r) for r in rounds), self.upper.length - self.upper_base
        self._grow_upper(self.upper.length + n)
        buf = self.upper.kv
        if open_n:
            moved = buf[:, :, :, self.upper_base : self.upper.length].clone()
            buf[:, :, :, self.upper_base + n : self.upper_base + n + open_n] = moved
        if open_n and self.windows:
            self._place_positions(self.upper_base + n, self.open_start, open_n)
        t0 = time.perf_counter()
        self._account_transfer(t0, self._put_rounds(rounds, self.upper_base))
        self.resident.extend(rounds)
        self.upper_base += n
        self.upper.length += n

    # ---- rechecks ----

    def _should_recheck(self, logits: Tensor) -> bool:
        below = self.policy.recheck_below
        if not below or self._upper_input is None or self.stats.rechecks >= self.policy.max_rechecks:
            return False
        if len(self.resident) >= len(self.round_starts):
            return False  # every round is already visible
        return float(torch.softmax(logits.float(), dim=-1).max()) < below

    @torch.inference_mode()
    def _recheck(self, logits: Tensor) -> Tensor:
        """Score every closed round against the latest token's queries at the upper layers, through the rounds'
        key bounds; bring in those that could get at least `recheck_mass` of its attention (the first round aside)
        at any upper layer, and run the token's upper layers again with them. Logits [V]."""
        t0 = time.perf_counter()
        m, p = self.model, self.lower.length - 1
        self._complete_bounds()
        shares = self.key_bounds.round_shares(torch.stack([q[-1] for q in self._upper_queries]))  # [Lu, R]
        if self.windows:  # a sliding-window layer reads only its window, which is always resident
            cfg = m.cfg
            shares[[i - self.split for i in range(self.split, cfg.n_layers) if cfg.window(i)]] = 0
        best = shares.amax(0)
        found = [r for r in (best >= self.policy.recheck_mass).nonzero().flatten().tolist() if r not in self.resident]
        if found:
            for r in found:
                self.last_chosen[r] = self.messages
            self.stats.found.extend(found)
            h, pos = self._upper_input, torch.tensor([p])
            self._insert_before_open(found)
            slot = self.upper_base + p - self.open_start
            logits = m.head(m.run_layers(h, pos, self.upper, slot, layers=range(self.split, m.cfg.n_layers)))[-1]
        self.stats.rechecks += 1
        self.stats.recheck_ms += 1000 * (time.perf_counter() - t0)
        return logits

    @torch.inference_mode()
    def _complete_bounds(self) -> None:
        """Compute the key bounds of rounds stored without them (chats saved before they were kept), once."""
        missing = [r for r, known in enumerate(self.key_bounds.known) if not known]
        self._announce(missing)
        for r in missing:
            self.ensure_upper(r)
            self.stats.bounds_computed.append(r)

    @torch.inference_mode()
    def _bring_in(self, rounds: list[int], message: int = 0) -> None:
        """Fill `upper` with exactly `rounds`' upper K/V, with room after them for a `message` of that many tokens
        and its reply. Rounds still on the device from the previous message stay there, moved to the front in
        their order; the others cross from host memory after them, one round at a time. If the tier must grow,
        its buffer is let go first and every round crosses (`_grow_upper`)."""
        on_device = self._resident_slots()
        kept = [r for r in self.resident if r in rounds]
        order = kept + [r for r in rounds if r not in on_device]
        self._announce([r for r in order if r not in on_device])
        n = sum(self._round_length(r) for r in rounds)
        t0 = time.perf_counter()
        need = n + message + REPLY_ROOM
        if need > self.upper.capacity:
            self.upper.reallocate(need)
            kept = []
        at, buf = 0, self.upper.kv
        for r in kept:  # moving left, a round at a time: never onto a round not yet moved
            first, size = on_device[r], self._round_length(r)
            if first != at:
                buf[:, :, :, at : at + size] = buf[:, :, :, first : first + size].clone()
                self._place_positions(at, self.round_starts[r], size)
            at += size
        moved = self._put_rounds(order[len(kept):], at)
        if moved:  # the bytes that crossed (the device-to-device moves are not counted)
            self._account_transfer(t0, moved)
        self.resident, self.upper_base, self.upper.length = order, n, n

    def _put_rounds(self, rounds: list[int], at: int) -> int:
        """Copy `rounds`' upper K/V from host memory into upper slots from `at` on, one round at a time through a
        staging block of its size (never one as large as all of them); the bytes copied."""
        buf, moved = self.upper.kv, 0
        for r in rounds:
            kv = self._upper_of(r)
            staged = kv.to(buf.device, non_blocking=True)
            buf[:, :, :, at : at + kv.shape[0]] = staged.permute(1, 2, 3, 0, 4)
            self._place_positions(at, self.round_starts[r], kv.shape[0])
            at += kv.shape[0]
            moved += kv.numel() * kv.element_size()
        return moved

    def _grow_upper(self, n_slots: int) -> None:
        """Make upper slots [0, n_slots) exist. A KVCache grows by copying into a larger buffer, the two side by
        side; the upper tier lets its buffer go first (KVCache.reallocate) and puts back what it held: the resident
        rounds from host memory, where each also lives, and the open round's slots, set aside (the message's own,
        on the device alone, and small)."""
        if n_slots <= self.upper.capacity:
            return
        length, open_n = self.upper.length, self.upper.length - self.upper_base
        open_kv = self.upper.kv[:, :, :, self.upper_base : length].clone() if open_n else None
        t0 = time.perf_counter()
        self.upper.reallocate(n_slots + REPLY_ROOM)
        moved = self._put_rounds(self.resident, 0)
        if open_kv is not None:
            self.upper.kv[:, :, :, self.upper_base : length] = open_kv
            self._place_positions(self.upper_base, self.open_start, open_n)
        self.upper.length = length
        if moved:
            self._account_transfer(t0, moved)

    def _round_length(self, r: int) -> int:
        return self._round_end(r) - self.round_starts[r]

    def _resident_slots(self) -> dict[int, int]:
        """Round -> its first slot in `upper`, for the rounds the previous message left there."""
        slots, at = {}, 0
        for r in self.resident:
            slots[r] = at
            at += self._round_length(r)
        return slots

    def _account_transfer(self, t0: float, moved_bytes: int) -> None:
        """Time the copies since t0 (waiting for the stream) and count the bytes moved."""
        if self.upper.kv.is_cuda:
            torch.cuda.current_stream(self.upper.kv.device).synchronize()
        self.stats.transfer_ms += 1000 * (time.perf_counter() - t0)
        self.stats.transfer_bytes += moved_bytes

    def _announce(self, rounds: list[int]) -> None:
        """Tell the upper source which of `rounds` it is about to be asked for, all at once, so it may read them
        side by side rather than one after another."""
        missing = [r for r in rounds if self.host[r] is None]
        if missing and self.upper_hint is not None:
            self.upper_hint(missing)

    def _upper_of(self, r: int) -> Tensor:
        """Round r's token-major upper K/V in host memory: kept, fetched from the store, or recomputed."""
        if self.host[r] is not None:
            return self.host[r]
        kv = self.upper_source(r) if self.upper_source is not None else None
        if kv is not None:
            self.stats.fetched.append(r)
            self.host[r] = kv
        else:
            self.stats.recomputed.append(r)
            upper_kv = self._recompute_upper(r)
            if not self.key_bounds.known[r]:
                self.key_bounds.fill(r, key_bounds(upper_kv[:, 0]))
            self.host[r] = self._to_host(upper_kv)
        return self.host[r]

    def _recompute_upper(self, r: int) -> Tensor:
        """Round r's upper K/V from its text: its lower layers see every earlier round (as they did), its upper
        layers the first round and itself (the rounds it saw then are not all at hand): an approximation, which
        the restore stats report."""
        m, start, end = self.model, self.round_starts[r], self._round_end(r)
        tokens = self.tokens[r] if self.tokens[r] is not None else self.token_source(r)
        if len(tokens) != end - start:
            raise RuntimeError(f"round {r} has {len(tokens)} tokens for slots [{start}, {end})")
        pos = torch.arange(start, end)
        h = m.run_layers(m.embed(torch.tensor(tokens)), pos, self.lower, start, layers=range(self.split))
        scratch = m.new_cache(end - start + 1, range(self.split, m.cfg.n_layers))
        sink = 0
        if r > 0 and self.host[0] is not None:
            sink = self.host[0].shape[0]
            scratch.reserve(sink + end - start)
            scratch.kv[:, :, :, :sink] = self.host[0].to(scratch.kv.device).permute(1, 2, 3, 0, 4)
        if self.windows:  # the sink and the round at their own positions
            scratch.track_positions()
            scratch.reserve(sink + end - start)
            scratch.slot_positions[:sink] = torch.arange(sink, device=scratch.kv.device)
            scratch.slot_positions[sink : sink + end - start] = pos.to(scratch.kv.device)
        m.run_layers(h, pos, scratch, sink, layers=range(self.split, m.cfg.n_layers))
        return scratch.kv[:, :, :, sink : sink + end - start]

    def _to_host(self, upper_kv: Tensor) -> Tensor:
        return host_layout(upper_kv, self.upper.kv.dtype, self._pin)

    def _drop_idle(self, chosen: list[int]) -> None:
        """Release the host copy of rounds not picked for `max_idle` messages (the store keeps them)."""
        limit = self.policy.max_idle
        if not limit:
            return
        for r, last in enumerate(self.last_chosen):
            if r and self.host[r] is not None and r not in chosen and self.messages - last >= limit:
                self.host[r] = None
                self.stats.dropped.append(r)


def host_layout(upper_kv: Tensor, dtype: torch.dtype, pin: bool = False) -> Tensor:
    """Segment layout [Lu, 2, Hkv, n, D] (any device) -> token-major [n, Lu, 2, Hkv, D] in host memory, pinned
    if asked (rounds read from the store stay pageable: pinning gigabytes costs more than it saves)."""
    token_major = upper_kv.permute(3, 0, 1, 2, 4)
    host = torch.empty(token_major.shape, dtype=dtype, pin_memory=pin)
    host.copy_(token_major)
    return host
