"""KV policies decide which cached tokens a new message's tokens attend to (kvpress-style: one policy per file, a
dataclass of its parameters plus its hooks, one abstract method, a table of all of them in engine.policies).

A policy is pure: whatever it needs from its model's calibration (Round Attention's watershed layer, Krul's checked
layer pairs) is one of its parameters, handed to it by whoever builds it (app/session/policies.py measures or reads
the calibration); `calibration_needed` names the parameters still missing."""

from __future__ import annotations

import contextlib
import inspect
from abc import ABC, abstractmethod
from typing import Callable, Iterator

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.model.attention import Attend
from kvchat.engine.model.decoder import Transformer
from kvchat.errors import KvchatError


class KVPolicy(ABC):
    # Class attributes, not dataclass fields (no annotation in the subclasses): they name the kind, not a setting.
    name = ""
    tiered = False  # runs on an engine.kv.tiered.TieredKV (device and host tiers) rather than a KVCache

    @classmethod
    def construct(cls, **options) -> "KVPolicy":
        """cls(**options), naming any option it does not take in a one-line error."""
        accepted = inspect.signature(cls.__init__).parameters
        unknown = [name for name in options if name not in accepted or name == "self"]
        if unknown:
            raise KvchatError(f"the {cls.name} KV policy takes no option {', '.join(unknown)}")
        try:
            return cls(**options)
        except TypeError as exc:  # a value of the wrong kind ("pool=abc" from the command line)
            raise KvchatError(f"the {cls.name} KV policy's options {options} do not fit: {exc}") from None

    def calibration_needed(self) -> tuple[str, ...]:
        """The parameters still missing that come from the model's calibration ("watershed", "pairs"): the builder
        measures or reads them and hands them in (dataclasses.replace). Empty: the policy is ready to run."""
        return ()

    def calibration_wanted(self) -> tuple[str, ...]:
        """Parameters left unset that the model's calibration improves but the policy runs without (XKV's layer
        costs): a builder with the model measures or reads them and hands them in; make_policy leaves them unset."""
        return ()

    def uncalibrated(self, option: str):
        """The value of a wanted option (`calibration_wanted`) when its calibration cannot be made."""
        raise ValueError(f"{self.name} wants no calibrated {option!r}")

    def check_model(self, model: Transformer) -> None:
        """Refuse, in one line (KvchatError), a model this policy cannot run on; nothing to check by default."""

    @abstractmethod
    def visible_slots(self, cache: KVCache, round_starts: list[int], new_tokens: list[int],
                      model: Transformer | None = None) -> Attend:
        """Cache slots the next round's tokens may attend to: None for all of them, slots [S] for every layer, or a
        SplitAttend (all slots below a layer, chosen ones from it up).

        `round_starts` holds the first slot of every round in the cache (the rounds end where the next begins and
        the last ends at cache.length); `new_tokens` are the next round's tokens, not yet in the cache."""

    def prepare(self, model: Transformer, cache: KVCache, round_starts: list[int],
                history: list[int]) -> Callable[[], None] | None:
        """Make the closed rounds' K/V (slots [0, cache.length), of the tokens `history`) what this policy gives a
        new message to read, when that is not simply the cache (Krul: the merged layers as a restore gives them
        back); returns what undoes it, or None when nothing changed."""
        return None

    @contextlib.contextmanager
    def for_message(self, model: Transformer, cache: KVCache, round_starts: list[int], history: list[int],
                    new_tokens: list[int]) -> Iterator[Attend]:
        """The policy prepared for one message over a full cache (`prepare`), undone after it even on an error;
        yields what the message attends to (`visible_slots`)."""
        undo = self.prepare(model, cache, round_starts, history)
        try:
            yield self.visible_slots(cache, round_starts, new_tokens, model=model)
        finally:
            if undo is not None:
                undo()

    def chat_cache(self, model: Transformer, capacity: int):
        """A cache of this policy's own for a chat (an engine.kv.base.KVStore), or None: the engine's full cache
        (a tiered policy's is engine.kv.tiered.TieredKV, made by whoever runs it)."""
        return None

    def decode_step(self, model: Transformer, cache: KVCache, prompt_start: int, attend: Attend, capacity: int,
                    cuda_graph: bool | None) -> Callable[[int], object] | None:
        """The decode step (token -> logits [V]) this policy runs after the prompt (slots [prompt_start,
        cache.length)) was prefilled under `attend`, for a reply up to slot `capacity`; None: the engine's own
        (LoopServe: attention over the input slots its recent tokens choose)."""
        return None
