"""Building a KV policy for a model, with what its calibration gives: the one place policies meet the files.

engine.policies are pure (their parameters and their hooks); a round policy needs the model's watershed layer, a
checked Krul policy the model's checked layer pairs, and XKV weighs its layers by the model's layer costs.
`build_policy` hands them in: read from $KVCHAT_HOME (app/session/artifacts.py) or, on the model's first use,
measured now (engine/calibrate/, seconds to minutes, reported to `progress(done, total)`) and stored for every later
use. `chat_policy` is what a chat runs under.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from kvchat.app.session.artifacts import (
    load_calibration,
    load_layer_costs,
    load_merge_calibration,
    load_trigger_calibration,
    save_calibration,
    save_layer_costs,
    save_merge_calibration,
    save_trigger_calibration,
)
from kvchat.engine.calibrate.layer_costs import LayerCostCalibration, calibrate_layer_costs
from kvchat.engine.calibrate.merge_check import MergeCalibration, calibrate_merges, default_check_chats
from kvchat.engine.calibrate.retrieval_trigger import TriggerCalibration, calibrate_trigger
from kvchat.engine.calibrate.watershed import DEFAULT_CHATS, Calibration, calibrate
from kvchat.engine.policies import BUDGET_POLICIES, KVPolicy, chat_policy_class, policy_class
from kvchat.engine.policies.sparse_prefill import DEFAULT_MIN_KEYS
from kvchat.errors import KvchatError

Progress = Callable[[int, int], None]  # (done, total)
log = logging.getLogger(__name__)

# Why a policy that lacks a calibrated parameter cannot be built without a model to calibrate.
NEEDS_A_MODEL = {
    "watershed": "the {name} KV policy needs a model to calibrate its watershed layer",
    "pairs": "the checked {name} KV policy needs a model to check its layer pairs on",
    "tau": "the {name} KV policy needs a model to calibrate its retrieval trigger on (or --option tau=...)",
}


def _stored_or_measured(load: Callable, measure: Callable, save: Callable):
    """A model's stored calibration (`load()`, None where there is none); on its first use, `measure()` now and
    `save` it for every later use."""
    cal = load()
    if cal is None:
        cal = measure()
        save(cal)
    return cal


def ensure_calibration(engine, fingerprint: str, progress: Progress | None = None,
                       chats: int = DEFAULT_CHATS) -> Calibration:
    """The model's stored calibration; on its first use, calibrate now (reporting progress per chat) and store it."""
    return _stored_or_measured(lambda: load_calibration(fingerprint, engine.config.n_layers),
                               lambda: calibrate(engine, fingerprint, chats=chats, progress=progress),
                               save_calibration)


def ensure_merge_calibration(engine, fingerprint: str, progress: Progress | None = None,
                             chats: int | None = None) -> MergeCalibration:
    """The model's stored check of its merge pairs; on its first use, checked now (progress per pair) and stored."""
    return _stored_or_measured(
        lambda: load_merge_calibration(fingerprint, engine.config.n_layers),
        lambda: calibrate_merges(engine, fingerprint, chats or default_check_chats(engine), progress=progress),
        save_merge_calibration)


def ensure_trigger_calibration(engine, fingerprint: str, progress: Progress | None = None) -> TriggerCalibration:
    """The model's stored retrieval-trigger thresholds (LouisKV); on its first use, measured now and stored."""
    return _stored_or_measured(lambda: load_trigger_calibration(fingerprint, engine.config.n_layers),
                               lambda: calibrate_trigger(engine, fingerprint, progress=progress),
                               save_trigger_calibration)


def ensure_layer_costs(engine, fingerprint: str, progress: Progress | None = None) -> LayerCostCalibration:
    """The model's stored layer costs for XKV; on its first use of xkv, measured now (progress per run) and stored."""
    return _stored_or_measured(lambda: load_layer_costs(fingerprint, engine.config.n_layers),
                               lambda: calibrate_layer_costs(engine, fingerprint, progress=progress),
                               save_layer_costs)


def _calibrated(option: str, engine, fingerprint: str, progress: Progress | None):
    """The value of the calibrated parameter `option` for the engine's model."""
    if option == "watershed":
        return ensure_calibration(engine, fingerprint, progress).watershed
    if option == "pairs":
        return ensure_merge_calibration(engine, fingerprint, progress).pairs
    if option == "tau":
        return tuple(ensure_trigger_calibration(engine, fingerprint, progress).tau)
    if option == "costs":
        return ensure_layer_costs(engine, fingerprint, progress).spec()
    raise ValueError(f"no calibration gives a policy's {option!r}")


def build_policy(name: str, engine=None, progress: Progress | None = None, **options) -> KVPolicy:
    """The policy `name` with `options` for `engine`'s model, its calibrated parameters (a round policy's watershed
    layer, a checked Krul's pairs) handed in unless `options` give them; `progress(done, total)` hears about any
    calibration the model gets first."""
    # The options are checked before any calibration: a bad one is refused at once, not after minutes of measuring.
    policy = policy_class(name).construct(**options)
    missing = policy.calibration_needed()
    if missing and engine is None:
        raise KvchatError(NEEDS_A_MODEL[missing[0]].format(name=name))
    # what a calibration improves but the policy runs without (XKV's layer costs) is handed in where there is a model
    wanted = (*missing, *policy.calibration_wanted()) if engine is not None else ()
    if wanted:
        from kvchat.storage.fingerprint import model_fingerprint

        fingerprint = model_fingerprint(Path(engine.path))
        values = {option: _calibrated(option, engine, fingerprint, progress) for option in missing}
        for option in policy.calibration_wanted():
            try:
                values[option] = _calibrated(option, engine, fingerprint, progress)
            except KvchatError as exc:  # what only improves the policy: it runs without it, and says why
                log.warning("%s: %s; the policy runs without it", name, exc)
                values[option] = policy.uncalibrated(option)
        policy = replace(policy, **values)
    if engine is not None:
        policy.check_model(engine.model)
    return policy


def chat_policy(name: str, engine=None, progress: Progress | None = None,
                kv_budget: float | None = None, host_resident: bool = False) -> KVPolicy | None:
    """The policy a chat runs under: None for the full cache, else a tiered policy (`round` or a strategy),
    `loopserve`, or `xkv` reading `kv_budget` of the chat's K/V (default: the policy's own, 0.2), its K/V in host
    memory with `host_resident` (what the GPU memory budget decides: app.session.service)."""
    if chat_policy_class(name) is None:
        return None
    if name in BUDGET_POLICIES:
        options = {} if kv_budget is None else {"budget": kv_budget}
        return build_policy(name, engine, progress, host_resident=host_resident, **options)
    if name == "loopserve":
        # A chat's prefill goes sparse only from where the kernel measured faster (a whole prefill never has yet:
        # docs/benchmarks.md, "LoopServe"); its reply always reads a progressively chosen budget.
        return build_policy(name, engine, progress, min_keys=DEFAULT_MIN_KEYS)
    return build_policy(name, engine, progress)
