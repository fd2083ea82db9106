"""`kvchat eval` and the KV policy table it runs over."""

from __future__ import annotations

import json

import pytest
from cli_run import kvchat

from kvchat.engine.engine import Engine
from kvchat.app.bench.evaluate import evaluate, heldout_chats
from kvchat.engine.policies import POLICIES, make_policy
from kvchat.errors import KvchatError


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_runs_the_same_chats(models, name):
    engine = Engine(models.get(style="chatml", arch="qwen2"), device="cpu")
    chats = heldout_chats(2, 0, 6, 8)
    # calibrations have their own tests
    options = {"watershed": 0} if "round" in name else {"checked": False} if name == "krul" else {}
    result = evaluate(engine, make_policy(name, engine, **options), chats, max_new_tokens=4)
    assert result.overall.questions == sum(len(c.questions) for c in chats) > 0
    for table in (result.by_kind, result.by_position, result.by_distance, result.by_stated, result.by_asked):
        assert sum(t.questions for t in table.values()) == result.overall.questions
    assert result.out_of_scope.questions == sum(len(c.out_of_scope) for c in chats)
    assert result.tokens > 0 and result.min_chat_rounds >= 6
    # a random model answers out-of-scope prompts impolitely: each such failure names the prompt that got it
    prompts = {c.rounds[o.round_index].user[-120:] for c in chats for o in c.out_of_scope}
    missed = [f for f in result.failures if "out_of_scope" in f]
    assert missed and all(f["prompt"] in prompts for f in missed)


def test_full_policy_sees_everything(models):
    assert make_policy("full").visible_slots(None, [0, 5], [1, 2]) is None
    with pytest.raises(KvchatError, match="takes no option"):
        make_policy("full", watershed=3)


def test_unknown_policy_is_a_one_line_error():
    with pytest.raises(KvchatError, match="accepted: full"):
        make_policy("round-robin")
    proc = kvchat("eval", "--kv-policy", "round-robin", "--chats", "1", check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "full" in proc.stderr


def test_eval_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    proc = kvchat("eval", "--model", str(bad), "--chats", "1", check=False)
    assert proc.returncode != 0 and proc.stderr.startswith("kvchat: error:") and "not a GGUF file" in proc.stderr


@pytest.mark.parametrize("phrasing", [None, "dev"])
def test_eval_json_has_top_level_accuracy(models, phrasing):
    extra = ["--phrasing", phrasing] if phrasing else []
    proc = kvchat("eval", "--model", str(models.get(style="chatml", arch="qwen2")), "--chats", "1", "--min-rounds", "4",
                  "--min-tokens", "0", "--max-rounds", "5", "--device", "cpu", "--json", *extra, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert 0.0 <= out["accuracy"] <= 1.0 and out["policy"] == "full" and set(out["by_kind"]) <= {"single", "corrected", "multi"}
    assert out["phrasing"] == (phrasing or "heldout")
    assert {"by_stated", "by_asked", "out_of_scope", "stop_reasons"} <= set(out)


def test_eval_passes_policy_options_and_refuses_bad_ones_in_one_line(models):
    model = str(models.get(style="chatml", arch="qwen2"))
    base = ["eval", "--model", model, "--chats", "1", "--min-rounds", "4", "--max-rounds", "5", "--min-tokens", "0",
            "--device", "cpu", "--kv-policy", "loopserve", "--json"]
    proc = kvchat(*base, "--option", "pool=1", "--option", "sparse=false", check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"] == "loopserve" and out["options"] == {"pool": 1, "sparse": False}
    for bad, says in ((["--option", "pool"], "KEY=VALUE"), (["--option", "nope=1"], "takes no option nope"),
                      (["--option", "pool=abc"], "do not fit")):
        proc = kvchat(*base, *bad, check=False)
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr


def test_the_demo_model_is_scored_on_held_out_phrasings_and_out_of_scope_prompts():
    """A random model answers nothing politely; the shipped one does, and its replies stay under the cap."""
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.data.dialogues import POLITE_REPLIES
    from kvchat.app.bench.evaluate import sample_replies

    engine = Engine(DEFAULT_MODEL, device="cpu")
    chats = heldout_chats(3, 4, 16, 20, phrasing="heldout")
    assert {c.phrasing for c in chats} == {"heldout"}
    result = evaluate(engine, make_policy("full"), chats)
    assert result.out_of_scope.questions >= 5 and result.out_of_scope.accuracy >= 0.6
    assert result.accuracy >= 0.4 and result.longest_reply <= 40
    assert sum(result.stop_reasons.values()) == result.overall.questions + result.out_of_scope.questions
    samples = sample_replies(engine, chats, 12, temperature=0.8)
    assert samples.replies == 12 and samples.reply_cap == 40 and samples.longest <= 80
    assert samples.looped <= samples.replies and POLITE_REPLIES
