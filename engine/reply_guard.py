"""The generation guard: stops a reply that has gone wrong, for every model.

Two things go wrong in practice: a reply loops (the same few tokens again and again: "eathatioedaltjjaltmalt
eathatioed..." until the token limit), and a reply runs on far longer than the model ever should. The guard stops
the first when the reply's tail is one piece of 1..max_period tokens repeated at least `min_repeats` times over at
least `min_span` tokens, and the second at the model's reply cap: `kvchat.reply_cap` in the GGUF metadata (the
embedded demo model's replies are one short sentence), else DEFAULT_REPLY_CAP. Either way the reply's stop reason
says so ("repetition", "reply_cap"). On by default; `ReplyGuard.off()` (CLI `--no-guard`) turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLY_CAP_KEY = "kvchat.reply_cap"
DEMO_REPLY_CAP = 40  # the demo model answers in one sentence; anything longer has gone wrong
DEFAULT_REPLY_CAP = 4096


@dataclass(frozen=True)
class ReplyGuard:
    enabled: bool = True
    reply_cap: int | None = None  # None: the model's own cap
    min_repeats: int = 4
    max_period: int = 32
    min_span: int = 16

    @classmethod
    def off(cls) -> "ReplyGuard":
        return cls(enabled=False)

    def cap_for(self, metadata: dict) -> int | None:
        """The reply cap for a model with this GGUF metadata (None when the guard is off)."""
        if not self.enabled:
            return None
        if self.reply_cap is not None:
            return self.reply_cap
        value = metadata.get(REPLY_CAP_KEY)
        return int(value) if isinstance(value, int) and value > 0 else DEFAULT_REPLY_CAP

    def loops(self, tokens: list[int]) -> bool:
        return self.enabled and repeating_tail(tokens, self.min_repeats, self.max_period, self.min_span) > 0


def repeating_tail(tokens: list[int], min_repeats: int = 4, max_period: int = 32, min_span: int = 16) -> int:
    """The period p of the shortest piece that the end of `tokens` repeats at least `min_repeats` times in a row
    over at least `min_span` tokens, or 0 when the tail does not loop. Only the last step's token is new, so a
    caller that checks after every token sees a loop as soon as it qualifies."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        repeats = max(min_repeats, -(-min_span // p))  # a short period must repeat more to count
        if repeats * p > n:
            break
        tail = tokens[n - p:]
        if all(tokens[n - (k + 1) * p: n - k * p] == tail for k in range(1, repeats)):
            return p
    return 0


# What a user is told when a reply was stopped (the CLI on stderr, the app under the reply); a reply cut at the
# length limit is plain to see.
STOP_NOTES = {
    "cancelled": "stopped",
    "repetition": "stopped: the reply kept repeating itself",
    "reply_cap": "stopped at the model's reply cap",
}
