"""XKV's layer costs: the policy's weighting (engine.policies.xkv `costs`), their calibration
(engine/calibrate/layer_costs.py), its file (app/session/artifacts.py) and its use on a model's first xkv
(build_policy; `kvchat calibrate` prints it: tests/test_calibration.py); and the teacher forcing that reads a chat's
history once for many policies."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvchat.app.session import policies as session_policies
from kvchat.app.session.artifacts import (
    SHIPPED_LAYER_COSTS,
    layer_costs_path,
    load_layer_costs,
    save_layer_costs,
)
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.calibrate.layer_costs import (
    BUDGETS,
    DIALOGUE_CHATS,
    FLOOR,
    LayerCostCalibration,
    OperatingPoint,
    calibrate_layer_costs,
    shrunk,
)
from kvchat.engine.engine import Engine
from kvchat.engine.policies import make_policy
from kvchat.engine.policies.full import FullKV
from kvchat.engine.policies.xkv import XKV, allocate_top_n, costs_at, parse_costs
from kvchat.engine.teacher_forcing import forced_logits, history_cache, text_chats
from kvchat.errors import KvchatError
from kvchat.storage.fingerprint import model_fingerprint


@pytest.fixture(scope="module")
def embedded():
    return Engine(DEFAULT_MODEL, device="cpu")


@pytest.fixture(scope="module")
def small(models):
    """A random two-layer model whose context holds a 1k-token MT-Bench chat (the source other models calibrate on)."""
    return Engine(models.get(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, context_length=2048),
                  device="cpu")


# ---- the policy's weighting ----

def test_costs_are_read_per_budget_and_interpolated_geometrically_between():
    table = parse_costs("0.4=4/2/1;0.1=1/1/4")
    assert table == {0.4: [4.0, 2.0, 1.0], 0.1: [1.0, 1.0, 4.0]}
    assert costs_at(table, 0.4) == [4, 2, 1] and costs_at(table, 0.1) == [1, 1, 4]
    assert costs_at(table, 0.9) == [4, 2, 1] and costs_at(table, 0.05) == [1, 1, 4]  # the nearest outside
    mid = costs_at(table, 0.2)  # halfway in log budget: the geometric mean of the two
    assert mid == pytest.approx([2.0, math.sqrt(2), 2.0])


@pytest.mark.parametrize("spec", ["", "0.4", "0.4=1/x", "0.4=1/-1", "0.4=1/0", "1.5=1/1", "0.4=1/1;0.4=2/2",
                                  "0.4=1/1;0.2=1/1/1", "0.4=nan/1"])
def test_bad_costs_are_one_line_errors(spec):
    with pytest.raises(KvchatError) as err:
        XKV(costs=spec)
    assert "\n" not in str(err.value) and "costs" in str(err.value)


def test_costs_weigh_each_layers_scores_before_the_global_top_n():
    """Two layers of the same normalized scores: equal weights (the paper's, `costs=equal` or unset) split the
    slots evenly; costs of 3:1 give the first layer more, exactly the top-N over the weighted scores."""
    g = torch.Generator().manual_seed(1)
    row = torch.rand(64, generator=g) ** 4
    scores = torch.stack([row, row]) / row.sum()
    assert XKV(costs="equal").allocate(scores, 40) == XKV().allocate(scores, 40) == [20, 20]
    weighted = XKV(budget=0.4, costs="0.4=3/1")
    counts = weighted.allocate(scores, 40)
    assert counts[0] > counts[1] and sum(counts) == 40
    assert counts == allocate_top_n(scores * torch.tensor([[3.0], [1.0]]), 40)
    # with a budget in tokens, the costs are read at the share of the candidates given: 40 of 128 here
    assert XKV(tokens=40, costs="0.4=3/1;0.1=1/3").allocate(scores, 40) == allocate_top_n(
        scores * torch.tensor(costs_at({0.4: [3, 1], 0.1: [1, 3]}, 40 / 128))[:, None], 40)
    in_a_choice = XKV(tokens=40, costs="0.4=3/1;0.1=1/3")
    in_a_choice.choice_share = 0.4  # what choice_from_scores sets: the kept share, window included
    assert in_a_choice.allocate(scores, 40) == allocate_top_n(scores * torch.tensor([[3.0], [1.0]]), 40)


def test_costs_for_another_number_of_layers_are_refused(embedded):
    with pytest.raises(KvchatError, match="costs are for 3 global layers; this model has 8"):
        make_policy("xkv", embedded, costs="0.4=1/2/3")


# ---- teacher forcing from a history read once ----

def test_a_history_read_once_gives_every_policy_the_same_logits_as_reading_it_again(embedded):
    """A layer-budget policy changes no history slot: run after run from one read history gives bitwise the logits
    of a fresh read, and the read is left holding the history alone."""
    (chat,) = text_chats(embedded, 700, 1, max_positions=12)
    read = history_cache(embedded, chat)
    for policy in (lambda: FullKV(), lambda: make_policy("xkv", embedded, budget=0.2, keep_ahead=False),
                   lambda: OperatingPoint(budget=0.1, index=2, keep_ahead=False)):
        again = forced_logits(embedded, policy(), chat, read)
        assert read.length == chat.history_tokens
        assert torch.equal(again, forced_logits(embedded, policy(), chat))
    with pytest.raises(ValueError):
        forced_logits(embedded, FullKV(), chat, embedded.model.new_cache(16))  # not the chat's history
    with pytest.raises(ValueError):  # a policy that may change the history (Krul merges layers) reads its own
        forced_logits(embedded, make_policy("krul", embedded, checked=False), chat, read)


# ---- the calibration ----

def test_the_operating_point_gives_one_layer_half_its_even_share_more():
    scores = torch.full((3, 100), 0.01)
    point = OperatingPoint(budget=0.2, index=1)
    assert point.allocate(scores, 60) == [20, 30, 20]
    assert point.retained == [pytest.approx(0.3)] and point.retained_even == [pytest.approx(0.2)]
    assert OperatingPoint(budget=0.2).allocate(scores, 60) == [20, 20, 20]


def test_a_cost_within_its_noise_of_the_mean_is_the_mean_and_one_far_beyond_it_is_nearly_kept():
    assert shrunk([3.0, 1.0, 2.0], [1.0, 1.0, 0.0]) == [2.0, 2.0, 2.0]  # within two standard errors; at the mean
    far = shrunk([10.0, 1.0, 1.0], [0.1, 0.1, 0.1])
    assert far[0] == pytest.approx(4 + 6 * (1 - (0.2 / 6) ** 2))
    assert far[1] == far[2] == pytest.approx(4 - 3 * (1 - (0.2 / 3) ** 2))
    assert shrunk([3.0, 1.0], [0.25, 0.25]) == [pytest.approx(2.75), pytest.approx(1.25)]  # 1 - (2 * 0.25 / 1)^2
    uncertain = shrunk([5.0, 1.0, 0.5], [0.3, 2.0, 0.1])  # the middle one's error is larger than the costs
    assert uncertain[1] == pytest.approx(6.5 / 3) and uncertain[0] > 4.8 and uncertain[2] < 0.53


def test_other_models_are_calibrated_on_mt_bench_chats_and_the_costs_hold_together(small):
    steps = []
    cal = calibrate_layer_costs(small, "ab" * 32, chats=1, progress=lambda done, total: steps.append((done, total)))
    g = len(small.config.global_layers)
    assert cal.source == "mt_bench" and cal.chats == 1 and cal.layers == small.config.global_layers
    assert steps[-1] == (1 + len(BUDGETS) * (g + 1),) * 2 and len(steps) == steps[-1][0]
    assert cal.budgets == list(BUDGETS) and all(len(row) == g and min(row) > 0 for row in cal.costs)
    for measured, errors, floored in zip(cal.measured, cal.errors, cal.costs):  # drawn to the mean, then floored
        kept = shrunk(measured, errors)
        top = max(kept)
        assert all(c == pytest.approx(max(k, FLOOR * top) if top > 0 else 1.0, rel=1e-4)
                   for k, c in zip(kept, floored))
        assert all(e > 0 for e in errors)
    assert parse_costs(cal.spec()) == {b: row for b, row in zip(cal.budgets, cal.costs)}
    assert LayerCostCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_a_cost_is_the_kl_the_added_slots_remove_per_share_of_attention_they_add(small):
    """The calibration's figure for one layer and budget, recomputed by hand along another path (each run reading
    the history afresh): (KL with every layer at the even share - KL with this layer given half again) / (its kept
    share of attention then - at the even share)."""
    cal = calibrate_layer_costs(small, "ef" * 32, chats=1)
    (chat,) = text_chats(small, min(2000, small.config.context_length // 2), 1, 128, seed=100)
    ref = forced_logits(small, FullKV(), chat).log_softmax(-1)

    def kl(policy):
        got = forced_logits(small, policy, chat).log_softmax(-1)
        return float((ref.exp() * (ref - got)).sum(-1).clamp_min(0).mean())

    b, j = 1, 1  # budget 0.2, the second global layer
    point = OperatingPoint(budget=BUDGETS[b], index=j, keep_ahead=False)
    removed = kl(OperatingPoint(budget=BUDGETS[b], keep_ahead=False)) - kl(point)
    gained = point.retained[0] - point.retained_even[0]
    assert gained > 0 and cal.measured[b][j] == pytest.approx(removed / gained, rel=1e-4, abs=1e-7)
    assert cal.kl_even[b] > 0  # a random model's budget of 0.2 does move its next-token distributions


def test_the_embedded_model_is_calibrated_on_its_own_dialogues_with_its_own_replies(embedded):
    cal = calibrate_layer_costs(embedded, "cd" * 32, chats=2)
    assert cal.source == "memory-dialogues" and cal.chats == 2 and 2 <= cal.positions <= 64
    assert cal.layers == list(range(8)) and all(len(row) == 8 for row in cal.costs)


# ---- the file and the first use ----

def test_the_costs_are_stored_per_model_and_a_bad_file_is_a_one_line_error(kvchat_home, small):
    fp = model_fingerprint(small.path)
    assert load_layer_costs(fp, small.config.n_layers) is None
    cal = calibrate_layer_costs(small, fp, chats=1)
    save_layer_costs(cal)
    assert load_layer_costs(fp, small.config.n_layers) == cal
    with pytest.raises(KvchatError, match="belongs to another model"):
        load_layer_costs(fp, small.config.n_layers + 1)
    layer_costs_path(fp).write_text('{"version": 1, "costs": "x"}')
    with pytest.raises(KvchatError, match="layer-cost calibration .* is corrupt") as err:
        load_layer_costs(fp, small.config.n_layers)
    assert "\n" not in str(err.value)
    layer_costs_path(fp).write_text(json.dumps({**cal.to_dict(), "version": 0}))  # an older version: measured again
    assert load_layer_costs(fp, small.config.n_layers) is None


def test_a_models_first_xkv_measures_its_costs_once_then_every_build_reads_them(kvchat_home, small, monkeypatch):
    calls = []
    real = session_policies.calibrate_layer_costs

    def counted(engine, fingerprint, chats=None, progress=None):
        calls.append(fingerprint)
        return real(engine, fingerprint, chats=1, progress=progress)

    monkeypatch.setattr(session_policies, "calibrate_layer_costs", counted)
    first = session_policies.build_policy("xkv", small, budget=0.2)
    again = session_policies.build_policy("xkv", small, budget=0.1)
    stored = load_layer_costs(model_fingerprint(small.path), small.config.n_layers)
    assert len(calls) == 1 and first.costs == again.costs == stored.spec()
    # a user's own costs, or the paper's equal weights, are kept and measure nothing
    assert session_policies.build_policy("xkv", small, costs="equal").costs == "equal"
    assert session_policies.build_policy("uniform", small).__class__.__name__ == "UniformBudget" and len(calls) == 1
    # without a model the policy runs on equal weights (nothing to measure on)
    assert session_policies.build_policy("xkv").costs is None


def test_costs_that_cannot_be_measured_leave_the_paper_s_weights_and_say_why(kvchat_home, small, monkeypatch,
                                                                              caplog):
    def no_reply(engine, fingerprint, chats=None, progress=None):
        raise KvchatError("the model gave no reply to any calibration chat: its layer costs cannot be measured")

    monkeypatch.setattr(session_policies, "calibrate_layer_costs", no_reply)
    assert session_policies.build_policy("xkv", small, budget=0.2).costs == "equal"
    assert "xkv: the model gave no reply" in caplog.text and "runs without it" in caplog.text
    assert load_layer_costs(model_fingerprint(small.path), small.config.n_layers) is None  # nothing stored


def test_the_embedded_models_costs_are_shipped_with_it(kvchat_home):
    fp = model_fingerprint(DEFAULT_MODEL)
    shipped = load_layer_costs(fp, 8)
    assert shipped is not None and not layer_costs_path(fp).exists()
    assert shipped == LayerCostCalibration.from_dict(json.loads(SHIPPED_LAYER_COSTS.read_text()))
    assert shipped.source == "memory-dialogues" and shipped.chats == DIALOGUE_CHATS and shipped.layers == list(range(8))
    assert load_layer_costs("f" * 64, 8) is None


def test_a_model_of_sliding_window_layers_alone_has_no_costs_to_measure(kvchat_home, models):
    """Every layer keeps its window (nothing is budgeted), so its first xkv measures nothing and stores nothing."""
    sliding = Engine(models.get(arch="gemma3", style="gemma", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1,
                                ffn_dim=128, sliding_window=8), device="cpu")
    assert sliding.config.global_layers == []
    assert session_policies.build_policy("xkv", sliding, budget=0.2).costs == "equal"
    assert not (kvchat_home / "calibrations").exists() or not list((kvchat_home / "calibrations").iterdir())
    # a chat under xkv on it reads the full cache, and says so once
    from kvchat.app.session.service import ChatService

    service, said = ChatService(kvchat_home, device="cpu"), []
    service.notice = said.append
    assert service.policy(sliding, "xkv") is None and service.policy(sliding, "xkv") is None
    assert len(said) == 1 and "nothing to budget; its chats read the full cache" in said[0]
