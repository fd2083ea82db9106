"""Every per-model file kvchat keeps under $KVCHAT_HOME, in one place: where it lives, how it is read back and how
it is written (atomically: a reader never sees half a file).

- the watershed calibration (engine.calibrate.watershed.Calibration): calibrations/<fingerprint>.json (the embedded
  model's is shipped beside it, assets/kvchat-memory-demo.calibration.json, as is its merge check);
- the model's check of its merge pairs (engine.calibrate.merge_check.MergeCalibration):
  calibrations/<fingerprint>.merges.json;
- LouisKV's retrieval trigger (engine.calibrate.retrieval_trigger.TriggerCalibration):
  calibrations/<fingerprint>.trigger.json;
- XKV's layer costs (engine.calibrate.layer_costs.LayerCostCalibration): calibrations/<fingerprint>.layer-costs.json
  (the embedded model's shipped beside it);
- this machine's hardware profile of a model on a device (engine.restore.plan.HardwareProfile):
  profiles/<fingerprint[:16]>-<device kind>-<hash of the device's name>.json.

What is measured lives in engine/calibrate/ and app/session/profile.py; when it is measured (a model's first use) is
app/session/policies.py and profile.py. A file of an older version is measured again rather than trusted; a corrupt
calibration, or one of another model, is a one-line error naming the file (a profile is measured again instead,
with the reason, since measuring it takes seconds, not minutes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.calibrate.layer_costs import LAYER_COSTS_VERSION, LayerCostCalibration
from kvchat.engine.calibrate.merge_check import MERGE_CALIBRATION_VERSION, MergeCalibration
from kvchat.engine.calibrate.retrieval_trigger import TRIGGER_VERSION, TriggerCalibration
from kvchat.engine.calibrate.watershed import CALIBRATION_VERSION, Calibration
from kvchat.engine.restore.plan import HardwareProfile
from kvchat.errors import KvchatError
from kvchat.paths import data_dir, write_json_atomically

# ---------------------------------------------------------------- the watershed calibration


def calibration_path(fingerprint: str) -> Path:
    return data_dir() / "calibrations" / f"{fingerprint}.json"


def save_calibration(cal: Calibration) -> Path:
    """Write atomically (temporary file, fsync, rename) so a reader never sees half a file."""
    return write_json_atomically(calibration_path(cal.fingerprint), cal.to_dict(), "calibration")


# The embedded model's watershed calibration, measured once when it was shipped (`kvchat calibrate`: 8 chats, ~10 s
# on a 2-core CPU that a first round policy would otherwise spend): used for that model alone, by fingerprint, when
# the home has none of its own (tests/test_calibration.py checks it is the shipped model's and what calibrating
# gives).
SHIPPED_CALIBRATION = DEFAULT_MODEL.with_suffix(".calibration.json")


def _shipped(path: Path, fingerprint: str) -> Path | None:
    """`path` if it is a shipped calibration of the model with this fingerprint."""
    if not path.exists():
        return None
    try:
        shipped = json.loads(path.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    return path if shipped == fingerprint else None


def load_calibration(fingerprint: str, n_layers: int | None = None) -> Calibration | None:
    """The stored calibration of this model (the home's, else the shipped one of the embedded model), or None when
    there is none (or it is of an older calibration version, which is recalibrated rather than trusted). A corrupt
    file, or one for another model, is an error."""
    path = calibration_path(fingerprint)
    if not path.exists():
        path = _shipped(SHIPPED_CALIBRATION, fingerprint) or path
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KvchatError(f"cannot read the calibration {path}: {exc}") from None
    try:
        raw = json.loads(text)
        if raw.get("version") != CALIBRATION_VERSION:
            return None
        cal = Calibration.from_dict(raw)
    except (ValueError, TypeError, AttributeError) as exc:
        raise KvchatError(f"the calibration {path} is corrupt ({exc}); delete it or run `kvchat calibrate`") from None
    if cal.fingerprint != fingerprint:
        raise KvchatError(f"the calibration {path} belongs to another model ({cal.fingerprint[:12]}); "
                          f"delete it or run `kvchat calibrate`")
    if n_layers is not None and cal.n_layers != n_layers:
        raise KvchatError(f"the calibration {path} is for a model of {cal.n_layers} layers, not {n_layers}; "
                          f"delete it or run `kvchat calibrate`")
    return cal


# ---------------------------------------------------------------- the merge check


def merge_calibration_path(fingerprint: str) -> Path:
    return data_dir() / "calibrations" / f"{fingerprint}.merges.json"


# The embedded model's merge check, run once when it was shipped (256 chats: minutes on a 2-core CPU, which a first
# `kvchat merge` would otherwise spend): used for that model alone, by fingerprint (tests/test_merge_command.py
# checks it is the shipped model's).
SHIPPED_MERGE_CALIBRATION = DEFAULT_MODEL.with_suffix(".merges.json")


def shipped_merge_calibration_path(fingerprint: str) -> Path | None:
    """The shipped check of the model with this fingerprint, if there is one."""
    return _shipped(SHIPPED_MERGE_CALIBRATION, fingerprint)


def save_merge_calibration(cal: MergeCalibration) -> Path:
    return write_json_atomically(merge_calibration_path(cal.fingerprint), cal.to_dict(), "merge calibration")


def load_merge_calibration(fingerprint: str, n_layers: int) -> MergeCalibration | None:
    """The stored check of this model's pairs; None when there is none or it is of an older version. A corrupt
    file or one of another model is an error naming the file."""
    path = merge_calibration_path(fingerprint)
    if not path.exists() and shipped_merge_calibration_path(fingerprint) is not None:
        path = shipped_merge_calibration_path(fingerprint)
    return _load_model_file(path, "merge calibration", MERGE_CALIBRATION_VERSION, MergeCalibration.from_dict,
                            fingerprint, n_layers)


def _load_model_file(path: Path, what: str, version: int, from_dict, fingerprint: str, n_layers: int):
    """A per-model JSON file read back (`from_dict`); None when there is none or it is of another `version`. A
    corrupt file, or one of another model, is a one-line error naming it."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise KvchatError(f"the {what} {path} is corrupt ({exc}); delete it or run `kvchat calibrate`") from None
    try:
        if raw.get("version") != version:
            return None
        cal = from_dict(raw)
    except (ValueError, TypeError, AttributeError) as exc:
        raise KvchatError(f"the {what} {path} is corrupt ({exc}); delete it or run `kvchat calibrate`") from None
    if cal.fingerprint != fingerprint or cal.n_layers != n_layers:
        raise KvchatError(f"the {what} {path} belongs to another model; delete it or run `kvchat calibrate`")
    return cal


# ---------------------------------------------------------------- LouisKV's retrieval trigger


def trigger_calibration_path(fingerprint: str) -> Path:
    return data_dir() / "calibrations" / f"{fingerprint}.trigger.json"


def save_trigger_calibration(cal: TriggerCalibration) -> Path:
    return write_json_atomically(trigger_calibration_path(cal.fingerprint), cal.to_dict(), "trigger calibration")


def load_trigger_calibration(fingerprint: str, n_layers: int) -> TriggerCalibration | None:
    """The stored thresholds of this model's retrieval trigger; None when there are none (or of an older version)."""
    return _load_model_file(trigger_calibration_path(fingerprint), "trigger calibration", TRIGGER_VERSION,
                            TriggerCalibration.from_dict, fingerprint, n_layers)


# ---------------------------------------------------------------- XKV's layer costs


def layer_costs_path(fingerprint: str) -> Path:
    return data_dir() / "calibrations" / f"{fingerprint}.layer-costs.json"


# The embedded model's layer costs, measured once when they were shipped (144 dialogues, 396 s on a 2-core CPU):
# used for that model alone, by fingerprint (tests/test_layer_costs.py checks it is the shipped model's), so that its
# first xkv chat, and every eval of it, weighs the layers as the measured figures did.
SHIPPED_LAYER_COSTS = DEFAULT_MODEL.with_suffix(".layer-costs.json")


def save_layer_costs(cal: LayerCostCalibration) -> Path:
    return write_json_atomically(layer_costs_path(cal.fingerprint), cal.to_dict(), "layer-cost calibration")


def load_layer_costs(fingerprint: str, n_layers: int) -> LayerCostCalibration | None:
    """The stored layer costs of this model (the home's, else the shipped ones of the embedded model); None when
    there are none (or of an older version)."""
    path = layer_costs_path(fingerprint)
    if not path.exists():
        path = _shipped(SHIPPED_LAYER_COSTS, fingerprint) or path
    return _load_model_file(path, "layer-cost calibration", LAYER_COSTS_VERSION, LayerCostCalibration.from_dict,
                            fingerprint, n_layers)


# ---------------------------------------------------------------- the hardware profile


def profile_path(fingerprint: str, device: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device.split(" ")[0])
    return data_dir() / "profiles" / f"{fingerprint[:16]}-{slug}-{hashlib.sha256(device.encode()).hexdigest()[:8]}.json"


def load_profile(fingerprint: str, device: str, n_layers: int | None = None
                 ) -> tuple[HardwareProfile | None, str | None]:
    """The stored profile, or None and why it must be measured again (None when there simply is none)."""
    path = profile_path(fingerprint, device)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"the profile {path} cannot be read ({exc.strerror or exc})"
    try:
        profile = HardwareProfile.from_dict(json.loads(text))
    except (ValueError, TypeError) as exc:
        return None, f"the profile {path.name} is corrupt or from another version ({str(exc)[:80]})"
    if profile.fingerprint != fingerprint or n_layers not in (None, profile.n_layers):
        return None, f"the profile {path.name} belongs to another model"
    if profile.device != device:
        return None, f"the profile {path.name} was measured on another device ({profile.device})"
    return profile, None


def save_profile(profile: HardwareProfile) -> Path:
    """Atomically (temp file, fsync, rename): a reader never sees half a profile."""
    return write_json_atomically(profile_path(profile.fingerprint, profile.device), profile.to_dict(),
                                 "hardware profile")


def probe_folder(name: str) -> Path:
    """A scratch folder beside the profiles, where measuring one writes and reads back real K/V files (the same
    disk the chats' files are on)."""
    return data_dir() / "profiles" / name
