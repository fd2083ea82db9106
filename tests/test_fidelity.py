"""The real-text fidelity harness (`kvchat eval --text`): its own check (full against itself), its arithmetic on
distributions known by hand, policies reported whatever they score, and its bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_run import kvchat

from kvchat.app.bench.fidelity import PolicyFidelity, compare, text_fidelity
from kvchat.engine.teacher_forcing import forced_logits, text_chats
from kvchat.engine.policies import make_policy
from kvchat.engine.train.synthetic import REFERENCE_MODELS


def test_kl_agreement_and_perplexity_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    got = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.1, 0.8]]))
    fid = PolicyFidelity("x")
    compare(fid, ref, got, reply=[1, 2])
    d = fid.as_dict()
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert d["mean_kl"] == pytest.approx(kl0 / 2, abs=1e-6)
    assert d["top1"] == 0.5  # position 0's top token moved
    assert d["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.8)) / 2), rel=1e-4)
    assert d["ppl_full"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.8)) / 2), rel=1e-4)
    assert list(d["by_position"]) == ["0-15"]


@pytest.fixture(scope="module")
def embedded():
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.engine import Engine

    return Engine(DEFAULT_MODEL, device="cpu")


def test_full_against_itself_is_exact_and_round_policies_are_reported(embedded, kvchat_home):
    makers = {"full": lambda: make_policy("full", embedded),
              "round-topk": lambda: make_policy("round-topk", embedded, watershed=2, k=1)}
    result = text_fidelity(embedded, makers, lengths=(700, 100_000), chats=1, max_positions=24)
    assert "100000" in json.dumps(result.as_dict()["skipped"])  # past the model's context: said, not run
    full, round_topk = result.lengths[700]
    n = full.overall.positions
    assert round_topk.overall.positions == n and 8 < n <= 24  # the last reply, cut at 24 tokens
    assert full.overall.kl == 0.0 and full.overall.agree == n
    assert round_topk.overall.kl > 0  # k=1 of many rounds: the upper layers lost something, and it shows
    # The harness's figures against a count of our own over both policies' logits at the same reply positions
    # (`agree <= n` alone holds for any count the harness could make).
    (chat,) = text_chats(embedded, 700, 1, max_positions=24)
    ref = forced_logits(embedded, makers["full"](), chat).float().log_softmax(-1)
    got = forced_logits(embedded, makers["round-topk"](), chat).float().log_softmax(-1)
    assert len(chat.reply) == n
    assert round_topk.overall.agree == int((ref.argmax(-1) == got.argmax(-1)).sum())
    assert round_topk.overall.kl == pytest.approx(float((ref.exp() * (ref - got)).sum()), rel=1e-3)


def test_merged_layers_are_measured_and_named(embedded):
    from kvchat.engine.kv.cross_layer import LayerPair

    makers = {"krul": lambda: make_policy("krul", embedded, pairs=[LayerPair(5, 7), LayerPair(2, 3)], r_l=0.5,
                                          gamma=0.0)}
    result = text_fidelity(embedded, makers, lengths=(700,), chats=1, max_positions=16)
    full, krul = result.lengths[700]
    assert krul.merged == [["2+3", "5+7"]] or krul.merged == [["5+7", "2+3"]]
    assert krul.overall.kl > 0 and krul.overall.positions == full.overall.positions
    assert krul.as_dict()["merged_pairs"] == krul.merged


def test_chats_are_cut_at_the_last_reply(embedded):
    from kvchat.engine.data.workloads import mt_bench_workload

    (chat,) = text_chats(embedded, 700, 1, max_positions=10)
    conv = mt_bench_workload(embedded.chat, "text-700-0", seed=0, target=700).conversation
    assert len(chat.reply) == 10 and chat.history == embedded.chat.round_spans(conv)[:-1]
    # the reply's tokens are the start of the last round's answer, teacher-forced after its prompt
    assert conv.rounds[-1].assistant.startswith(embedded.tokenizer.decode(chat.reply).strip()[:20])


def test_a_policy_refusing_the_model_is_reported_not_fatal(models):
    """A policy that refuses the model (Round Attention told to choose at a sliding-window layer): the harness
    says so and measures the rest."""
    from kvchat.engine.engine import Engine

    engine = Engine(models.get(**REFERENCE_MODELS["gemma3-f32-swa"]), device="cpu")
    makers = {"full": lambda: make_policy("full", engine),
              "round": lambda: make_policy("round", engine, watershed=2)}
    result = text_fidelity(engine, makers, lengths=(1500,), chats=1, max_positions=8)
    full, round_ = result.as_dict()["lengths"]["1500"]["policies"]
    assert full["mean_kl"] == 0 and full["top1"] == 1.0
    assert "sliding-window" in round_["error"]


@pytest.mark.parametrize("lengths", ["abc", "100"])
def test_bad_lengths_are_one_line_errors(lengths, kvchat_home):
    proc = kvchat("eval", "--text", "--lengths", lengths, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and "--lengths" in proc.stderr


def test_layer_budgets_report_each_global_layers_kept_slots_per_chat(embedded):
    """xkv's rows carry, per chat, the input slots each global layer kept: the allocation itself, not only its mean.
    xkv's counts differ between layers where uniform's are alike, and both share the same total (one budget)."""
    makers = {p: (lambda p=p: make_policy(p, embedded, budget=0.4)) for p in ("xkv", "uniform")}
    result = text_fidelity(embedded, makers, lengths=(700,), chats=1, max_positions=24)
    _, xkv, uniform = result.lengths[700]
    [counts], [even] = xkv.kept_by_layer, uniform.kept_by_layer
    assert len(counts) == len(even) == len(embedded.config.global_layers)
    assert len(set(even)) == 1 and len(set(counts)) > 1 and sum(counts) == sum(even)
    assert xkv.as_dict()["kept_by_layer"] == [counts]
