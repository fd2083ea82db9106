"""Watershed-layer calibration (engine/calibrate/watershed.py; its file: app/session/artifacts.py; `kvchat calibrate`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.calibrate import watershed as calibration
from kvchat.app.session.artifacts import calibration_path, load_calibration, save_calibration
from kvchat.app.session.policies import ensure_calibration
from kvchat.engine.calibrate.watershed import Calibration, kl_curve, layer_round_distributions, pick_watershed
from kvchat.engine.text.chat_format import Conversation
from kvchat.engine.data.dialogues import dialogues
from kvchat.engine.generate import prefill
from kvchat.errors import KvchatError
from kvchat.kernels.round_scores import round_mass_ref
from cli_run import kvchat


@pytest.fixture(scope="module")
def engine():
    from kvchat.engine.engine import Engine

    return Engine(DEFAULT_MODEL, device="cpu")


# ---- pick_watershed ----

def test_clear_minimum_is_the_watershed():
    assert pick_watershed([1.0, 0.9, 0.2, 0.25, 0.22, 0.21, 0.2, 0.0]) == 2


def test_first_significant_minimum_wins_over_a_shallow_earlier_one_and_a_deeper_later_one():
    # layer 1 dips by 0.15 of a 0.9 range (shallow); layer 3 drops 0.7 (significant); layer 5 is lower still
    assert pick_watershed([1.0, 0.85, 0.9, 0.3, 0.4, 0.1, 0.2, 0.0]) == 3


def test_the_last_layers_placeholder_is_ignored():
    # the last value (layer 7 has no later layer) would make layer 6 a minimum if it were read
    assert pick_watershed([1.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 5.0]) == 1
    # a fall only at layer L-2 is no minimum (nothing after it shows the curve stays low): the fallback's knee
    assert pick_watershed([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.1, 0.0]) == 5


def test_monotone_and_flat_curves_fall_back():
    assert pick_watershed([1.0, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.0]) == 3  # first layer past half the drop
    assert pick_watershed([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.0]) == 1  # rising: the lowest allowed layer
    assert pick_watershed([0.3] * 7 + [0.0]) == 4  # flat: the middle
    assert pick_watershed([0.0] * 8) == 4


def test_never_layer_0_or_the_last():
    gen = torch.Generator().manual_seed(0)
    for n_layers in range(3, 40):
        for _ in range(20):
            assert 1 <= pick_watershed(torch.rand(n_layers, generator=gen).tolist()) <= n_layers - 2
    assert pick_watershed([0.0, 1.0, 1.0, 1.0]) in (1, 2)  # layer 0 lowest is still never chosen
    with pytest.raises(KvchatError, match="at least 3 layers"):
        pick_watershed([1.0, 0.0])


# ---- kl_curve ----

def test_identical_layers_give_zero_divergence():
    dist = torch.tensor([[0.2, 0.3, 0.5]] * 5)
    assert torch.allclose(kl_curve([dist, dist]), torch.zeros(5, dtype=torch.float64), atol=1e-12)


def test_kl_curve_by_hand():
    first = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.9, 0.1]])  # layer 0 differs from the two layers after it
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    curve = kl_curve([first])
    assert curve.tolist() == pytest.approx([kl, 0.0, 0.0], abs=1e-5)
    # a second chat with more rounds, where only layer 1 -> 2 changes: the curve is the mean over chats
    second = torch.tensor([[0.25, 0.25, 0.5], [0.25, 0.25, 0.5], [0.5, 0.25, 0.25]])
    kl2 = 0.25 * math.log(0.25 / 0.5) + 0.5 * math.log(0.5 / 0.25)
    assert kl_curve([first, second]).tolist() == pytest.approx([(kl + kl2 / 2) / 2, kl2 / 2, 0.0], abs=1e-5)


def test_zero_probabilities_stay_finite():
    curve = kl_curve([torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])])
    assert torch.isfinite(curve).all() and curve[0] > 1.0


# ---- layer_round_distributions on the embedded model ----

def _short_chat():
    dlg = dialogues("heldout", 1, 3, 6, 6)[0]
    return Conversation(dlg.rounds[:5], dlg.system), dlg.rounds[5].user


def test_distributions_match_the_queries_of_a_plain_forward_pass(engine):
    conv, message = _short_chat()
    dist = layer_round_distributions(engine, conv, message)
    n_layers = engine.config.n_layers
    assert dist.shape == (n_layers, len(conv.rounds))
    assert torch.allclose(dist.sum(1), torch.ones(n_layers), atol=1e-5)
    # Independent: round starts from whole renderings of each prefix, queries captured from the model's own
    # attention in an ordinary forward pass of the new message after the prefilled chat.
    chat = engine.chat
    starts = torch.tensor([0] + [len(chat.conversation_tokens(Conversation(conv.rounds[:r], conv.system)))
                                 for r in range(1, len(conv.rounds))])
    model, cache = engine.model, engine.new_cache()
    prefill(model, cache, chat.conversation_tokens(conv))
    start = cache.length
    captured = []
    for layer in model.layers:
        def capture(q, *args, _orig=layer._sdpa):
            captured.append(q.clone())
            return _orig(q, *args)
        layer._sdpa = capture
    try:
        with torch.inference_mode():
            model(torch.tensor(chat.open_round_tokens(conv, message)), cache)
    finally:
        for layer in model.layers:
            del layer._sdpa
    assert len(captured) == n_layers
    for i, q in enumerate(captured):
        expected = round_mass_ref(q, cache.kv[i, 0, :, :start], starts)
        assert torch.allclose(dist[i], expected, atol=1e-5), f"layer {i}"
    assert not torch.allclose(dist[0], dist[-1], atol=1e-2)  # the layers really differ: not a constant answer


def test_other_models_calibrate_on_mt_bench_chats(models):
    from kvchat.engine.calibrate.watershed import calibrate, calibration_chats
    from kvchat.engine.engine import Engine

    qwen = Engine(models.get(arch="qwen2", style="chatml", n_layers=4), device="cpu")  # q/k/v biases too
    source, chats = calibration_chats(qwen, 2, seed=5)
    assert source == "mt_bench" and all(len(conv.rounds) >= 10 for conv, _ in chats)
    assert calibration_chats(qwen, 2, seed=5) == (source, chats)  # deterministic
    assert calibration_chats(qwen, 2, seed=6)[1] != chats
    cal = calibrate(qwen, "34" * 32, chats=1)
    assert cal.source == "mt_bench" and len(cal.curve) == 4 and cal.watershed in (1, 2)
    with pytest.raises(KvchatError, match="at least 3 layers"):
        calibrate(Engine(models.get(n_layers=2), device="cpu"), "56" * 32, chats=1)


# ---- the check of L_w ----

def test_the_check_climbs_to_the_first_layer_that_agrees_enough(monkeypatch):
    measured = {2: 0.95, 3: 0.995, 4: 1.0}
    monkeypatch.setattr(calibration, "reference_reply", lambda engine, conv, message: None)
    monkeypatch.setattr(calibration, "agreement", lambda engine, refs, layer, progress=None: measured[layer])
    engine = type("E", (), {"config": type("C", (), {"n_layers": 6, "window": lambda self, i: 0})()})()
    assert calibration.checked_watershed(engine, [("chat", "message")], 2) == (3, {2: 0.95, 3: 0.995})
    measured.update({3: 0.9, 4: 0.95})  # none reaches it: the best, the lowest of equals
    assert calibration.checked_watershed(engine, [("chat", "message")], 2) == (2, {2: 0.95, 3: 0.9, 4: 0.95})
    # Gemma 3's pattern: five sliding-window layers, then a global one; only global layers can choose rounds
    gemma = type("E", (), {"config": type("C", (), {"n_layers": 13, "window": lambda self, i: 512 * (i % 6 < 5)})()})()
    measured.update({5: 0.9, 11: 0.995})
    assert calibration.checked_watershed(gemma, [("chat", "message")], 2) == (11, {5: 0.9, 11: 0.995})
    assert calibration.checked_watershed(gemma, [("chat", "message")], 7) == (11, {11: 0.995})


def test_agreement_is_measured_on_the_full_caches_sure_tokens(engine):
    from kvchat.engine.calibrate.watershed import agreement, calibration_chats, reference_reply

    _, pairs = calibration_chats(engine, 2)
    refs = [reference_reply(engine, conv, message) for conv, message in pairs]
    assert all(ref.reply and any(ref.sure) for ref in refs)
    text = engine.tokenizer.decode(refs[0].reply)
    assert text.startswith("You") and pairs[0][0].rounds  # a real answer to a real question
    top = engine.config.n_layers - 2  # the highest watershed: the upper tier is one layer
    assert agreement(engine, refs, top) >= agreement(engine, refs, 1)
    assert 0.5 < agreement(engine, refs, top) <= 1.0
    # Sure tokens only: with no sure token there is nothing to disagree on.
    assert agreement(engine, [replace(refs[0], sure=[False] * len(refs[0].reply))], 1) == 1.0


# ---- stored calibrations ----

def _calibration(fingerprint="ab" * 32, n_layers=8, watershed=2) -> Calibration:
    return Calibration(fingerprint=fingerprint, model_name="test", n_layers=n_layers, watershed=watershed,
                       curve=[0.4, 0.3, 0.2, 0.25, 0.1, 0.09, 0.08, 0.0], chats=8, source="memory-dialogues", seed=0,
                       date="2026-11-21T00:00:00+00:00", rounds=[12] * 8)


def test_save_and_load_round_trip(kvchat_home):
    cal = _calibration()
    path = save_calibration(cal)
    assert path == kvchat_home / "calibrations" / f"{cal.fingerprint}.json"
    assert load_calibration(cal.fingerprint, 8) == cal
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert load_calibration("cd" * 32) is None


def test_a_file_of_an_older_calibration_version_is_measured_again(kvchat_home):
    save_calibration(replace(_calibration(), version=1))  # before L_w was checked: not trusted
    assert load_calibration("ab" * 32, 8) is None


def test_a_file_of_another_model_is_refused():
    save_calibration(_calibration("ab" * 32))
    calibration_path("ab" * 32).rename(calibration_path("cd" * 32))
    with pytest.raises(KvchatError, match="belongs to another model") as err:
        load_calibration("cd" * 32)
    assert "\n" not in str(err.value)
    save_calibration(_calibration("ef" * 32, n_layers=8))
    with pytest.raises(KvchatError, match="8 layers, not 12"):
        load_calibration("ef" * 32, n_layers=12)


@pytest.mark.parametrize("content", ["{not json", "[]", json.dumps({"version": calibration.CALIBRATION_VERSION, "fingerprint": "ab" * 32}),
                                     "WATERSHED_OUT_OF_RANGE"])
def test_a_corrupt_file_is_refused(content):
    if content == "WATERSHED_OUT_OF_RANGE":
        save_calibration(_calibration(watershed=7))  # the last layer is never a watershed
    else:
        calibration_path("ab" * 32).parent.mkdir(parents=True)
        calibration_path("ab" * 32).write_text(content)
    with pytest.raises(KvchatError, match="is corrupt") as err:
        load_calibration("ab" * 32)
    assert "\n" not in str(err.value)


def test_ensure_calibration_calibrates_once_then_reuses(engine, monkeypatch):
    seen = []
    cal = ensure_calibration(engine, "12" * 32, progress=lambda done, total: seen.append((done, total)), chats=1)
    assert seen[0] == (1, 2) and seen[-1][0] == seen[-1][1]  # the curve's chat, then one per layer checked
    assert len(seen) == 1 + len(cal.agreement)
    assert 1 <= cal.kl_watershed <= cal.watershed <= engine.config.n_layers - 2 and cal.source == "memory-dialogues"
    assert str(cal.watershed) in cal.agreement
    assert load_calibration("12" * 32, engine.config.n_layers) == cal
    save_calibration(replace(cal, watershed=5))  # what is stored is what is used, without measuring again
    from kvchat.app.session import policies  # where a model's first use calibrates it

    monkeypatch.setattr(policies, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    assert ensure_calibration(engine, "12" * 32).watershed == 5


def test_the_embedded_model_s_calibration_is_shipped_with_it(kvchat_home):
    """A round policy's first use on the embedded model in a new home takes the calibration shipped with it (the
    Pilot test of the settings checks that calibrating gives the same file); a home's own calibration comes first,
    and another model's fingerprint is not answered from it."""
    from kvchat.app.session.artifacts import SHIPPED_CALIBRATION
    from kvchat.storage.fingerprint import model_fingerprint

    fp = model_fingerprint(DEFAULT_MODEL)
    shipped = load_calibration(fp, 8)
    assert shipped is not None and shipped.fingerprint == fp and not calibration_path(fp).exists()
    assert shipped == Calibration.from_dict(json.loads(SHIPPED_CALIBRATION.read_text()))
    assert 1 <= shipped.watershed <= 6 and shipped.chats == calibration.DEFAULT_CHATS
    assert load_calibration("f" * 64, 8) is None
    save_calibration(replace(shipped, watershed=2))
    assert load_calibration(fp, 8).watershed == 2


# ---- the command ----

def test_calibrate_command_prints_the_curve_and_stores_it(tmp_path, kvchat_home):
    png = tmp_path / "curve.png"
    out = kvchat("calibrate", "--chats", "1", "--png", str(png)).stdout
    layer_lines = [line for line in out.splitlines() if line.startswith("layer ")]
    assert len(layer_lines) == 8
    watershed = int(re.search(r"^watershed layer: (\d+)$", out, re.M).group(1))
    assert 1 <= watershed <= 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored, trigger, _ = sorted((kvchat_home / "calibrations").glob("*.json"), key=lambda p: len(p.name))
    assert json.loads(stored.read_text())["watershed"] == watershed
    # LouisKV's retrieval thresholds, one per global layer (all 8 of the embedded model's), stored beside it
    thresholds = re.search(r"^retrieval trigger \(louiskv\), per global layer: (.*)  \(", out, re.M).group(1)
    assert [int(t.split(":")[0]) for t in thresholds.split()] == list(range(8))
    tau = json.loads(trigger.read_text())["tau"]
    assert trigger.name.endswith(".trigger.json") and len(tau) == 8
    assert all(abs(a - float(t.split(":")[1])) <= 0.005 + 1e-9 for a, t in zip(tau, thresholds.split()))
    # XKV's layer costs, a line per budget, each global layer's cost relative to the budget's largest, stored
    lines = re.findall(r"^  budget ([\d.]+): (.*)  \(KL at the even share", out, re.M)
    assert [float(b) for b, _ in lines] == [0.4, 0.2, 0.1]
    for _, row in lines:
        assert [int(part.split(":")[0]) for part in row.split()] == list(range(8))
        assert max(float(part.split(":")[1]) for part in row.split()) == 1.0
    costs = json.loads((kvchat_home / "calibrations" / f"{stored.stem}.layer-costs.json").read_text())
    assert costs["chats"] == 1 and len(costs["costs"]) == 3 and f"{stored.stem}.layer-costs.json" in out
