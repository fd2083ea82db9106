"""Per-layer KV budgets (the base of engine.policies.xkv, .uniform and .pyramid): the new message's prefill reads the
whole chat, then the reply reads, in each global layer, only the input slots that layer's budget keeps.

What is scored (XKV's Alg. 2, SnapKV's observation window): the attention the input's last `window` tokens pay
each earlier input slot, per layer and KV head — softmax probabilities over the keys each of them saw (causal),
summed over the window's tokens and the KV head's query heads (kernels/slot_mass.py, the kernel LoopServe's
selection runs) — then averaged over `pool` neighbouring slots, so that a value of several tokens is kept whole.
The paper's `ps` is 7; kvchat's default is 15, chosen on a development set of the embedded model's held-out chats
(policy comparison at budget 0.4: recall 34.0% with 7, 36.4% with 15, 36.0% with 31, 34.4% with 63, the full cache
41.1%; without pooling 2.7% on the report sets, where it was first tried). The paper's `ows` is 8; kvchat's window
is 32: in a chat the input ends with the chat template's end of turn and the assistant's header, so the last 8
tokens hold only the question's last words (on the embedded model: ' my', ' dog', '?' and five template tokens).
On the same development set at 0.4: 92 of 253 answers with 8, 95 with 16, 97 with 24, 98 with 32, 94 with 48 and
64; an oracle scoring with the expected reply's own attention keeps all 104 of the full cache's, so the window is
what loses answers (docs/benchmarks.md, "What a choice of 0.4 can keep"). Other ways of scoring the same window
(the most any one token or query head pays a slot, each token's attention renormalized, the pool shifted back) moved
recall by at most one answer (docs/probes/xkv_score_variants.py). What the oracle has and the window lacks is the
reply's own start: with `head`, the reply's first tokens decode over every slot and then join the window, and the
choice is made after them. It gained 3 answers of 6 on the development set at 4 tokens, and lost one on the report
sets (docs/benchmarks.md, "With the window of 32"): it is off by default, and a short answer decoded mostly over
the full cache says little of the choice. With `lookahead` (16 by default) the reply's start is found before the
choice: at the reply's first token the full cache's own greedy continuation is decoded for 16 tokens and their
queries join the window's (`LookAheadThenBudget`). On the model shipped since 2026-11-28, whose answers copy values
of up to 16 characters, the window alone keeps 131 of the full cache's 166 development answers at 0.4, looking 8
tokens ahead 160, 16 tokens ahead 166 (docs/benchmarks.md, "XKV looking ahead"). Those tokens are then the reply's
own start wherever the sampler picks them (`keep_ahead`): nothing is decoded twice, and the choice is made where
the reply leaves them (for a greedy reply, `head` 16 with the look-ahead's choice; what the choice alone keeps is
measured with `keep_ahead=false`). The look-ahead runs in the budget's own step, so a message captures one graph:
at 32k on the 8B shape on an H200 the reply's second token comes 136-180 ms after the first, its capture included
(docs/benchmarks.md, "the look-ahead kept"); the first token, which the prefill gives, is not delayed.

The pool takes its slots' mean (the paper's); `pooling="max"` takes the best of them instead (a value's slots each
keep the score of its most attended token). Max was the default for a day: on the development set of the model
before it gave 101 answers against 98 at 0.4 and 96 against 93 at 0.2, but on the report sets it was a wash
(90/86/68 against 91/82/71 at 0.4/0.2/0.1), and on real text (gemma-3-270m) it raised the KL at 8k and budget 0.4 by
28-86% for every policy (xkv 0.585 against 0.315) for 1-4% less at 2k and 0.2/0.1 (docs/benchmarks.md, "Max
pooling").

Decisions the paper leaves open, made here once:
* The window's own slots are always kept and counted in the budget: a layer keeps `window` + n_i input slots, and
  the policy's budget is the mean of those over the global layers. A budget below the window is refused.
* Scores and budgets are per layer (the paper's w_i: the KV heads' scores summed); within a layer each KV head keeps
  its own top n_i slots by its own score (SnapKV, per head), because K/V are stored and read per KV head.
* No minimum beyond the window (the paper's allocation list starts at zero): a layer whose attention is all on the
  window may keep nothing else.
* Sliding-window layers (Gemma 3) are outside the budget: they read at most their window already.
* The scores come from the message's own prefill (the chat's K/V are all on the device while a message is read):
  the window's queries are recomputed after the prefill for its `window` tokens (their K/V written back as they
  were), so there is no mini-prefill. The full K/V stays where it is: each message chooses again over everything
  the chat has, so a fact left out for one reply can come back for a later one.

The decode is engine.policies.slot_lists' (one CUDA graph; the reply reads all of itself), or with `working_set`
engine.kv.working_set's over the kept slots alone; engine.kv.host_resident keeps a chat's K/V in host memory and
streams each message through the device, scoring on the way. A budget that keeps every input slot of every layer
runs the engine's own decode step: budget 1.0 gives the full cache's tokens exactly.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.host_resident import HostResidentKV
from kvchat.engine.kv.working_set import LayerWorkingSet, WorkingSetDecode
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import QueryTap, Transformer
from kvchat.engine.policies.base import KVPolicy
from kvchat.engine.policies.progressive_decode import ProgressiveDecode, layer_groups
from kvchat.engine.policies.slot_lists import SlotListDecode
from kvchat.errors import KvchatError
from kvchat.kernels.slot_mass import slot_mass

# Scores of one group of layers stay under this without the Triton kernel (as engine.policies.progressive_decode).
SCORE_BYTES = 256 << 20


@dataclass
class BudgetChoice:
    """What one message's reply reads: per layer (all layers, sliding-window ones at their window) the input slots
    kept by each KV head, the window included, and the share of the layer's scored attention they hold."""

    input_slots: int  # slots [0, input_slots) were the input (history and message)
    kept: list[int]  # per layer: input slots each KV head reads
    retention: list[float]  # per global layer: R_i(n_i), the kept share of its pooled window scores
    global_layers: list[int] = field(default_factory=list)

    @property
    def mean_kept(self) -> float:
        """The mean kept input slots over the global layers."""
        return sum(self.kept[i] for i in self.global_layers) / max(len(self.global_layers), 1)

    @property
    def kept_share(self) -> float:
        return self.mean_kept / max(self.input_slots, 1)


# pooling="max": the share of the neighbourhood's mean added to its best score, which orders slots of one plateau
# (mean <= best, so it moves a slot past another only where their best scores are within this share of each other)
MAX_POOL_TIE_BREAK = 2.0 ** -8


@dataclass(eq=False)
class LayerBudgetPolicy(KVPolicy):
    """A budget of input slots per global layer for the reply; subclasses decide how it is shared (`allocate`)."""

    budget: float = 0.2  # share of the input's slots a global layer keeps on average, window included, in (0, 1]
    tokens: int = 0  # instead of `budget`: input slots a global layer keeps on average (0: use `budget`)
    window: int = 32  # the observation window: the input's last tokens, always kept, whose attention is scored
    pool: int = 15  # slots pooled into each score (odd; the paper has 7: docs/benchmarks.md, "XKV")
    # "avg" (the default, the paper's): each slot scored by its neighbours' mean; "max": by the best of them
    pooling: str = "avg"
    # Beyond the paper: each layer's slots chosen again every 16 reply tokens by the reply's own queries (LoopServe's
    # progressive decode, engine.policies.progressive_decode), the layer keeping its budget; off: chosen once.
    progressive: bool = False
    # Beyond the paper: the reply's first `head` tokens read every slot, and their queries join the window's in the
    # score (an answer's own start points at where it was told better than the question's words do). 0: the paper's.
    head: int = 0
    # Beyond the paper: at the reply's first token (the prefill's), that token and the next `lookahead` - 1 are
    # decoded greedily over every slot; their queries join the window's in the score (the idea of Lookahead
    # Q-Cache's pseudo queries, made by the model itself). 16 by default (docs/benchmarks.md, "XKV looking ahead");
    # 0: the paper's. A policy with `head` uses that instead. A host-resident chat has no full cache on the device to
    # look ahead over: it chooses from the window.
    lookahead: int = 16
    # Beyond the paper: the look-ahead's tokens are the reply's first ones where the sampler picks them (handed the
    # full cache's logits they were decoded with, not decoded again over the budget: exact, and 16 fewer steps); off:
    # taken back, and the whole reply decodes over the kept slots — what a measure of the choice alone runs, since
    # a short answer then never reads the budget (docs/benchmarks.md, "The look-ahead kept").
    keep_ahead: bool = True
    # Beyond the paper: the reply decodes over a working set that holds each layer's kept slots alone, in a tensor of
    # its own (engine.kv.working_set: the device bytes are the budget's, and attention reads contiguous slots);
    # off: over the full cache through per-layer slot lists. Not with `progressive` (its choice changes).
    working_set: bool = False
    # Beyond the paper: the chat's K/V lives in host memory, each message streamed through the device one layer at a
    # time and the reply decoded over a working set (engine.kv.host_resident): the device holds the budget's K/V,
    # not the chat's. The app turns it on when the full cache does not fit the GPU memory budget.
    host_resident: bool = False
    # the latest message's choice (for stats, the chat's stored budgets and tests): state, not parameters
    last_choice: BudgetChoice | None = field(default=None, init=False, repr=False)
    choice_share: float = field(default=0.0, init=False, repr=False)  # the mean kept share of the choice being made
    _window_tokens: list[int] = field(default_factory=list, init=False, repr=False)
    _decoded: int = field(default=0, init=False, repr=False)  # of the window, reply tokens (`head`)

    def __post_init__(self):
        if not 0 < self.budget <= 1:
            raise KvchatError(f"the KV budget is a share of the chat's K/V in (0, 1], not {self.budget}")
        if self.window < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise KvchatError("window is a count of tokens (at least 1) and pool an odd count of slots")
        if (self.working_set or self.host_resident) and self.progressive:
            which = "working_set" if self.working_set else "host_resident"
            raise KvchatError(f"{which}=true decodes over the slots chosen once: not with progressive=true")
        if self.head < 0 or (self.head and (self.working_set or self.host_resident or self.progressive)):
            raise KvchatError("head is a count of reply tokens (0 or more), and not with working_set, host_resident "
                              "or progressive")
        if self.lookahead < 0:
            raise KvchatError(f"lookahead is a count of reply tokens (0 or more), not {self.lookahead}")
        if self.pooling not in ("avg", "max"):
            raise KvchatError(f"pooling is avg or max, not {self.pooling!r}")
        if self.tokens < 0 or (self.tokens and self.tokens < self.window):
            raise KvchatError(f"a KV budget of {self.tokens} tokens is smaller than the always-kept window of "
                              f"{self.window} tokens")

    @abstractmethod
    def allocate(self, scores: Tensor, total: int, shares: Tensor | None = None) -> list[int]:
        """Share `total` slots among the global layers, given their pooled scores [G, N] (each row normalized to
        sum to 1; N candidate slots per layer) and, where measured, how far each layer's attention moves the
        residual stream over the window ([G], QueryTap.attention_shares): n_i per layer, each at most N, summing to
        min(total, G * N)."""

    def weighs_layers(self) -> bool:
        """Whether `allocate` reads the layers' attention shares (else they are not measured: none of the
        prefill's or the choice's work goes to them)."""
        return False

    def kept_per_layer(self, input_slots: int) -> int:
        """Input slots a global layer keeps on average (window included) for an input of `input_slots`."""
        wanted = self.tokens or math.ceil(self.budget * input_slots)
        return min(input_slots, max(wanted, self.window))

    def chat_cache(self, model: Transformer, capacity: int):
        if not self.host_resident:
            return None
        return HostResidentKV(model, self, capacity)

    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        # The message reads the whole chat; its last tokens are the window scored after its prefill, whose queries
        # the prefill itself keeps (QueryTap), so they need not run through every layer again.
        self._window_tokens = list(new_tokens[-self.window:])
        self._decoded = 0
        self.last_choice = None  # until this message's reply chooses
        if model is not None and not self.host_resident:  # a host-resident chat scores as it streams the message
            model.query_tap = QueryTap(self.window, norms=self.weighs_layers())
        return None

    @torch.inference_mode()
    def choose(self, model: Transformer, cache: KVCache) -> tuple[BudgetChoice, list[Tensor | None]]:
        """The budgets and, per layer, the kept input slots [Hkv, n_i] (None: the layer keeps every slot) for the
        cache's input (slots [0, cache.length), ending with the window tokens handed to `visible_slots`)."""
        cfg, first = model.cfg, cache.length
        n_win = min(len(self._window_tokens), first)
        if not self.scores_needed(cfg, first, n_win):
            return self.keep_everything(cfg, first)
        scores, shares = self._scores(model, cache, cfg.global_layers, self._window_tokens[-n_win:],
                                      min(self._decoded, n_win))  # [G, Hkv, N], [G]
        return self.choice_from_scores(cfg, scores, first, n_win, shares)

    @torch.inference_mode()
    def choose_looking_ahead(self, model: Transformer, cache: KVCache, ahead: list[int], kept: int = 0
                             ) -> tuple[BudgetChoice, list[Tensor | None]]:
        """`choose` with the cache's last len(ahead) slots holding `ahead`, reply tokens decoded over every slot
        after the input: their queries join the window's in the score, then all but the first `kept` of them are
        taken out of the cache (the choice is over the input alone, as `choose`'s)."""
        cfg, first = model.cfg, cache.length - len(ahead)
        n_win = min(len(self._window_tokens), first)
        try:
            if not self.scores_needed(cfg, first, n_win):
                return self.keep_everything(cfg, first)
            # [G, Hkv, first - n_win]: the window's and the look-ahead's tokens score the slots before the window
            scores, shares = self._scores(model, cache, cfg.global_layers,
                                          self._window_tokens[-n_win:] + list(ahead), len(ahead))
        finally:
            cache.truncate(first + kept)
        return self.choice_from_scores(cfg, scores, first, n_win, shares)

    def scores_needed(self, cfg, first: int, n_win: int) -> bool:
        """Whether an input of `first` slots, the last n_win of them the window, is scored at all (else every
        layer keeps every slot: nothing to score, or a budget holding everything)."""
        return bool(cfg.global_layers) and n_win > 0 and first - n_win > 0 and self.kept_per_layer(first) < first

    @staticmethod
    def keep_everything(cfg, first: int) -> tuple[BudgetChoice, list[Tensor | None]]:
        kept = [first if not cfg.window(i) else min(first, cfg.window(i)) for i in range(cfg.n_layers)]
        return (BudgetChoice(first, kept, [1.0] * len(cfg.global_layers), cfg.global_layers),
                [None] * cfg.n_layers)

    def choice_from_scores(self, cfg, scores: Tensor, first: int, n_win: int, shares: Tensor | None = None
                           ) -> tuple[BudgetChoice, list[Tensor | None]]:
        """`choose` from the global layers' pooled window scores [G, Hkv, first - n_win] (`pooled`) and their
        attention's shares of the residual stream over the window ([G] or None: `allocate`)."""
        globals_ = cfg.global_layers
        candidates, average = first - n_win, self.kept_per_layer(first)
        per_layer = scores.sum(1)
        per_layer = per_layer / per_layer.sum(1, keepdim=True).clamp_min(1e-30)
        total = len(globals_) * (average - n_win)
        self.choice_share = average / max(first, 1)  # the kept share this choice gives (window included)
        counts = self.allocate(per_layer, total, shares)
        if len(counts) != len(globals_) or any(not 0 <= n <= candidates for n in counts):
            raise RuntimeError(f"{self.name} allocated {counts} for {len(globals_)} layers of {candidates} slots")
        # R_i(n_i) of every layer read back at once (one wait for the device, not one a layer)
        ordered = per_layer.sort(dim=1, descending=True).values.cumsum(1)
        at = torch.tensor([max(n - 1, 0) for n in counts], device=ordered.device)[:, None]
        retention = [r if n else 0.0 for r, n in zip(ordered.gather(1, at)[:, 0].tolist(), counts)]
        window_slots = torch.arange(candidates, first, device=scores.device, dtype=torch.long)
        # Every layer's slots ranked in one sort, then each layer's first n_i put in slot order: at 32k on the 8B
        # shape on an H100, 6.7 ms against 14.9 for a topk a layer (docs/probes/xkv_choice_cost.py, 2026-11-28).
        order = scores.argsort(dim=2, descending=True) if max(counts) else None  # [G, Hkv, N]
        slots: list[Tensor | None] = [None] * cfg.n_layers
        kept = [min(first, cfg.window(i)) for i in range(cfg.n_layers)]
        for j, layer in enumerate(globals_):
            best = order[j, :, : counts[j]].sort(dim=1).values if counts[j] else window_slots.new_empty(
                cfg.n_kv_heads, 0)
            chosen = torch.cat([best, window_slots.expand(cfg.n_kv_heads, -1)], dim=1)
            slots[layer] = chosen.to(torch.int32)
            kept[layer] = chosen.shape[1]
        return BudgetChoice(first, kept, retention, globals_), slots

    def _scores(self, model: Transformer, cache: KVCache, layers: list[int], tokens: list[int], after: int = 0
                ) -> tuple[Tensor, Tensor | None]:
        """Pooled window scores [G, Hkv, N] of the global `layers` over the input before the window (its last
        `after` tokens the reply's, decoded since the message's prefill), and the layers' attention shares of the
        residual stream over the window's input tokens ([G]: QueryTap.attention_shares)."""
        cfg = model.cfg
        first, n_win = cache.length, len(tokens)
        queries, shares = prefill_window(model, cache, layers, tokens, after,
                                         with_shares=self.weighs_layers())  # [L, T, H, D], [G] or None
        out = []
        per_layer_bytes = cfg.n_heads * n_win * first * 4
        for group, at in layer_groups(model, cache, layers, per_layer_bytes, SCORE_BYTES):
            keys = cache.keys_of(group, first)
            out.append(slot_mass(queries[at], keys, first - n_win, None, cfg.softmax_scale))
        return self.pooled(torch.cat(out)), shares  # [G, Hkv, N], [G]

    def pooled(self, mass: Tensor) -> Tensor:
        """Window scores [G, Hkv, N] averaged (or maxed) over `pool` neighbouring slots."""
        if self.pool > 1:
            g, h, n = mass.shape
            flat = mass.view(g * h, 1, n)
            mean = F.avg_pool1d(flat, self.pool, stride=1, padding=self.pool // 2, count_include_pad=False)
            if self.pooling == "max":
                # The best neighbour's score is a plateau pool slots wide around each peak: within it, the slots
                # whose neighbourhood holds more attention first (a budget that ends inside a plateau keeps the
                # value's slots, not whichever a top-n picks among equals: "Mir" for "Mira" otherwise).
                best = F.max_pool1d(flat, self.pool, stride=1, padding=self.pool // 2)
                mass = (best + mean * MAX_POOL_TIE_BREAK).view(g, h, n)
            else:
                mass = mean.view(g, h, n)
        return mass

    def decode_step(self, model: Transformer, cache: KVCache, prompt_start: int, attend: Attend, capacity: int,
                    cuda_graph: bool | None):
        if attend is not None or cache.slot_positions is not None:
            raise KvchatError(f"the {self.name} KV policy runs on the full cache of a chat, not a restricted view")
        if self.head and self.kept_per_layer(cache.length + self.head) < cache.length + self.head:
            return ReplyHeadThenBudget(self, model, cache, prompt_start, capacity, cuda_graph)
        scored = self.scores_needed(model.cfg, cache.length, min(len(self._window_tokens), cache.length))
        if self.lookahead and scored and lookahead_undoable(cache, model.cfg, self.lookahead):
            return LookAheadThenBudget(self, model, cache, prompt_start, capacity, cuda_graph)
        return self.budget_step(model, cache, prompt_start, capacity, cuda_graph)

    def budget_step(self, model: Transformer, cache: KVCache, prompt_start: int, capacity: int,
                    cuda_graph: bool | None, chosen: tuple[BudgetChoice, list[Tensor | None]] | None = None):
        """The reply's step over the slots chosen now, or `chosen` already (None: every slot kept, the engine's own
        step)."""
        choice, slots = chosen or self.choose(model, cache)
        self.last_choice = choice
        if all(s is None for s in slots):
            return None  # every slot kept: the engine's own step, the full cache's tokens exactly
        if self.working_set:
            cache.reserve(capacity)  # the reply's K/V go back here when it ends: no growth beside the working set
            windows = [model.cfg.window(i) for i in range(model.cfg.n_layers)]
            working = LayerWorkingSet.gather(cache, slots, windows, capacity - cache.length)
            return WorkingSetDecode(model, cache, working, capacity, cuda_graph)
        if self.progressive:
            step = ProgressiveDecode(model, cache, prompt_start, capacity, attend=None, capture=cuda_graph,
                                     pool=self.pool, layer_budgets=choice.kept)
        else:
            step = SlotListDecode(model, cache, prompt_start, capacity, None, cuda_graph)
        write_lists(step, slots)
        return step


def write_lists(step: SlotListDecode, slots: list[Tensor | None]) -> None:
    """Each layer's kept input slots into a slot-list step (a layer without a list keeps what it lists)."""
    for layer, kept in enumerate(slots):
        if kept is not None:
            step.write(layer, kept)


class BudgetAfterReplyStart:
    """A reply step that starts over the whole cache and then goes on over the budget's kept slots: what the two ways
    of letting the reply's start inform the choice (`ReplyHeadThenBudget`, `LookAheadThenBudget`) share."""

    def __init__(self, policy: LayerBudgetPolicy, model: Transformer, cache: KVCache, prompt_start: int,
                 capacity: int, cuda_graph: bool | None):
        self.policy, self.model, self.cache = policy, model, cache
        self.prompt_start, self.capacity, self.cuda_graph = prompt_start, capacity, cuda_graph
        self.step = None

    def budget_step(self, chosen: tuple[BudgetChoice, list[Tensor | None]] | None = None):
        """The reply's step over the kept slots (chosen now, or `chosen`); the cache's own if every slot is kept."""
        cache = self.cache
        return self.policy.budget_step(self.model, cache, self.prompt_start, self.capacity, self.cuda_graph,
                                       chosen) or cache.decode_step(self.model, self.capacity - cache.length,
                                                                    self.capacity, cuda_graph=self.cuda_graph)

    def finish(self) -> None:
        finish = getattr(self.step, "finish", None)
        if finish is not None:
            finish()


class ReplyHeadThenBudget(BudgetAfterReplyStart):
    """The reply's first `policy.head` tokens decode over the whole cache (the cache's own step), then the budgets are
    chosen with those tokens in the window (their queries computed once, in one pass of the head's tokens) and the
    reply goes on over the kept slots."""

    def __init__(self, policy: LayerBudgetPolicy, model: Transformer, cache: KVCache, prompt_start: int,
                 capacity: int, cuda_graph: bool | None):
        super().__init__(policy, model, cache, prompt_start, capacity, cuda_graph)
        self.left = policy.head
        self.step = cache.decode_step(model, policy.head + 1, capacity, cuda_graph=cuda_graph)
        self.chosen = False

    @torch.inference_mode()
    def __call__(self, token: int) -> Tensor:
        if not self.chosen and not self.left:
            self.chosen = True
            self.step = self.budget_step()
        if self.chosen:
            return self.step(token)
        self.left -= 1
        self.policy._window_tokens.append(token)
        self.policy._decoded += 1
        # The message's tap is kept aside: an eager step would feed it and a graphed one not; the head's queries are
        # run once, together, at the choice on every device.
        tap, self.model.query_tap = self.model.query_tap, None
        try:
            return self.step(token)
        finally:
            self.model.query_tap = tap


def lookahead_undoable(cache: KVCache, cfg, n: int) -> bool:
    """Whether `n` tokens written after the cache's input can be taken back: a sliding-window layer's ring must
    still hold its window of the input after them (engine.kv.cache.KVCache.holds_window) — a ring as large as the
    cache never wraps, a full one keeps RING_SLACK positions beyond its window."""
    ring = getattr(cache, "ring_size", 0)
    return not ring or ring >= cache.capacity or ring >= cfg.sliding_window - 1 + n


class LookAheadThenBudget(BudgetAfterReplyStart):
    """At the reply's first token: `policy.lookahead` tokens decoded greedily from it over the whole cache, whose
    queries join the window's when the budgets are chosen.

    With `policy.keep_ahead` (the default) those tokens are the reply's own as far as the sampler picks them: each
    is handed the logits the full cache gave it (they were computed already), and the budgets are chosen only when
    the reply leaves the look-ahead — where the sampler picks another token, or after its last — with the tokens
    kept so far staying in the cache and read by every later token. A reply that ends inside its look-ahead read the
    whole cache; its choice is made after it, for the chat's figures (`finish`). Without it, the look-ahead is taken
    back out of the cache and the reply decodes over the kept slots from its first token.

    On the slot lists (the default decode) one step serves both, so a message captures one CUDA graph: the look-ahead
    runs with every slot listed, and the choice rewrites the lists. A working set, or a progressive choice, looks
    ahead through the cache's own step first (a working set holds the kept slots alone; progressive decoding
    chooses from the reply's queries, so its look-ahead is always taken back)."""

    def __init__(self, policy: LayerBudgetPolicy, model: Transformer, cache: KVCache, prompt_start: int,
                 capacity: int, cuda_graph: bool | None):
        super().__init__(policy, model, cache, prompt_start, capacity, cuda_graph)
        self.first = cache.length  # the reply's first slot
        self.ahead: list[int] = []  # the look-ahead's tokens, the reply's first one first
        self.ahead_logits: list[Tensor] = []  # the full cache's logits after each of them
        self.fed = 0  # reply tokens handed to this step so far
        self.looked = False
        self.lists = not (policy.working_set or policy.progressive)  # the look-ahead runs in the budget's step
        self.keep = policy.keep_ahead and not policy.progressive
        if self.lists:  # made (its graph captured) here, where a reply's decode step is set up; every slot listed
            # until the choice rewrites the lists. A full-cache step an earlier reply left on the cache is let go
            # first: the GPU memory plan counts one decode graph (app.session.memory).
            if getattr(cache, "graphed_decode", None) is not None:
                cache.graphed_decode = None
            self.step = SlotListDecode(model, cache, prompt_start, capacity, None, cuda_graph)

    @torch.inference_mode()
    def __call__(self, token: int) -> Tensor:
        if not self.looked:
            self._look_ahead(token)
            self.looked = True
            if not self.ahead_logits:  # taken back (or no room to look ahead at all): chosen now
                self._choose(0)
        if self.ahead_logits:
            if self.fed < len(self.ahead_logits) and token == self.ahead[self.fed]:
                self.fed += 1
                return self.ahead_logits[self.fed - 1]
            self._choose(self.fed)  # the reply leaves the look-ahead here
        self.fed += 1
        return self.step(token)

    def _look_ahead(self, token: int) -> None:
        policy, model, cache, first = self.policy, self.model, self.cache, self.first
        n = min(policy.lookahead, self.capacity - first - 1)
        ahead, logits = [token], []
        # The message's query tap is kept aside while looking ahead (as ReplyHeadThenBudget's): the look-ahead's
        # queries are run once, together, at the choice.
        tap, model.query_tap = model.query_tap, None
        graphed = getattr(cache, "graphed_decode", None)
        try:
            if self.lists:
                look = self.step
            else:
                look = cache.decode_step(model, n + 1, self.capacity, cuda_graph=self.cuda_graph)
            for i in range(n):
                out = look(ahead[i])
                # kept as a clone: a captured step's logits are its graph's output, which its next replay overwrites
                if self.keep:
                    logits.append(out.clone())
                if i + 1 < n:
                    ahead.append(int(out.argmax()))
            look = out = None  # (a graph this look-ahead captured is freed once nothing holds it)
        except BaseException:
            cache.truncate(first)  # nothing of a look-ahead that failed stays in the chat's cache
            raise
        finally:
            model.query_tap = tap
            if getattr(cache, "graphed_decode", None) is not graphed:
                # A full-cache step the look-ahead captured is let go before the budget's step is captured: the GPU
                # memory plan counts one decode graph (app.session.memory), and a chat's cache grows to each
                # message's need, so the next message could not replay it anyway.
                cache.graphed_decode = None
        self.ahead, self.ahead_logits = ahead[:n], logits

    def _choose(self, kept: int) -> None:
        """The budgets chosen with the look-ahead's queries; its first `kept` tokens stay in the cache as the reply's
        (read by every later token), the rest are taken out."""
        policy, first = self.policy, self.first
        # no longer replaying, whatever the choice does: a choice that fails has taken the look-ahead's unkept
        # tokens out already, and `finish` must not choose (and cut) again
        self.ahead_logits = []
        choice, slots = policy.choose_looking_ahead(self.model, self.cache, self.ahead, kept=kept)
        if self.lists:
            policy.last_choice = choice
            write_lists(self.step, slots)  # each list then names the reply's slots, those kept included
            return
        if kept:  # a working set gathers the reply's kept slots with the input's
            reply = torch.arange(first, first + kept, dtype=torch.int32, device=self.model.device)
            slots = [s if s is None else torch.cat([s, reply.to(s.device).expand(s.shape[0], -1)], 1)
                     for s in slots]
        self.step = self.budget_step((choice, slots))

    def finish(self) -> None:
        if self.ahead_logits:
            # The reply ended inside its look-ahead, having read the whole cache. The choice is still made (after
            # the reply, so nobody waits for it) for the figures a chat keeps of its budgets; what the reply did not
            # take leaves the cache either way, and a choice that fails costs those figures alone.
            self.ahead_logits = []
            try:
                if self.cache.length == self.first + len(self.ahead):  # the whole look-ahead still in the cache
                    self.policy.last_choice = self.policy.choose_looking_ahead(self.model, self.cache, self.ahead,
                                                                               kept=self.fed)[0]
            except Exception:  # noqa: BLE001 - the reply stands; a failure of its own is reported by its caller
                pass
            finally:
                self.cache.truncate(self.first + self.fed)
        super().finish()


@torch.inference_mode()
def prefill_queries(model: Transformer, cache: KVCache, layers: list[int], tokens: list[int], after: int = 0
                    ) -> Tensor:
    """The queries [L, T, H, D] of the cache's last T slots, which hold `tokens`, at `layers` (the others zeros):
    those the message's prefill kept (the model's QueryTap, read once: no later prefill feeds it), the last `after`
    (reply tokens decoded since the prefill, which decode steps do not tap) run once together; or, if the tap did not
    keep the rest, `window_queries`' (every layer, run again)."""
    return prefill_window(model, cache, layers, tokens, after, with_shares=False)[0]


def prefill_window(model: Transformer, cache: KVCache, layers: list[int], tokens: list[int], after: int = 0,
                   with_shares: bool = True) -> tuple[Tensor, Tensor | None]:
    """`prefill_queries`' queries, and `layers`' attention shares of the residual stream [len(layers)] over the
    window's tokens before the reply's `after` (QueryTap.attention_shares), from the same place: the message's
    prefill, or the window run again (`with_shares=False`: the queries alone, and None)."""
    tap, model.query_tap = model.query_tap, None
    ours = tap is not None and after < len(tokens)
    kept = tap.queries(layers, cache.length - after, len(tokens) - after) if ours else None
    shares = None
    if kept is not None and with_shares:
        shares = tap.attention_shares(layers, cache.length - after, len(tokens) - after)
    if kept is None or (with_shares and shares is None):
        rerun = model.query_tap = QueryTap(len(tokens), norms=True) if with_shares else None  # the shares too
        try:
            queries = window_queries(model, cache, tokens)
        finally:
            model.query_tap = None
        if rerun is None:
            return queries, None
        return queries, rerun.attention_shares(layers, cache.length - after, len(tokens) - after)
    cfg = model.cfg
    queries = next(iter(kept.values())).new_zeros(cfg.n_layers, len(tokens), cfg.n_heads, cfg.head_dim)
    for layer, q in kept.items():
        queries[layer, : len(tokens) - after] = q
    if after:  # the reply's tokens decoded since the prefill (a policy's `head`): run once, all together
        queries[:, len(tokens) - after :] = window_queries(model, cache, tokens[len(tokens) - after :])
    return queries, shares


def window_queries(model: Transformer, cache: KVCache, tokens: list[int]) -> Tensor:
    """The queries [L, T, H, D] of the cache's last T input slots, which hold `tokens`, at every layer: those tokens
    run again over the cache (their K/V, rewritten on the way, are put back as they were)."""
    cfg, first = model.cfg, cache.length
    start = first - len(tokens)
    layers = cache.layers
    saved = cache.read(layers, start, first)
    queries: list[Tensor] = []
    positions = torch.arange(start, first)
    try:
        model.run_layers(model.embed(torch.tensor(tokens)), positions, cache, start, queries=queries)
    finally:
        cache.write(layers, start, saved)
    return torch.stack([q.reshape(len(tokens), cfg.n_heads, cfg.head_dim) for q in queries])
