"""The trainer's model and exporter: what it trains is exactly what the engine (and llama.cpp) run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvchat.engine.data.dialogues import dialogues
from kvchat.engine.engine import Engine
from kvchat.app.bench.parity import reference_logits, relative_error
from kvchat.engine.text.tokenizer import Tokenizer
from kvchat.engine.text.vocab import ByteBPEVocab
from kvchat.engine.train.trainer import (PROMPT, TrainConfig, TrainModel, average_models, build_vocab, encode_dialogue,
                                 export_gguf, load_checkpoint, load_gguf_weights, save_checkpoint, split_losses,
                                 vocab_from_gguf, vocab_from_state)
from kvchat.errors import KvchatError

SMALL = TrainConfig(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=256, n_merges=200)


_vocabs: dict[str, ByteBPEVocab] = {}


def trained_like(cfg: TrainConfig):
    # build_vocab is deterministic in the config: learned once per config in this module, each caller given a copy
    if repr(cfg) not in _vocabs:
        _vocabs[repr(cfg)] = build_vocab(cfg)
    vocab = copy.deepcopy(_vocabs[repr(cfg)])
    model = TrainModel(cfg.model_config(len(vocab.tokens)))
    with torch.no_grad():  # weights of a trained model's size, not the tiny init, so every layer matters
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    return model, vocab


def test_exported_model_runs_identically_in_engine_and_llama_cpp(tmp_path):
    model, vocab = trained_like(SMALL)
    path = export_gguf(model, vocab, tmp_path / "m.gguf", Q.F32)
    engine = Engine(path, device="cpu")
    tokens, _ = encode_dialogue(engine.tokenizer, dialogues("train", 1, 0, 3, 3)[0])
    ids = torch.tensor(tokens[:80], dtype=torch.long)
    with torch.no_grad():
        ours_train = model(ids[None])[0]
    ours_engine = engine.model(ids, engine.new_cache(), all_logits=True)
    assert relative_error(ours_engine.numpy(), ours_train.numpy()) < 1e-5
    assert relative_error(ours_engine.numpy(), reference_logits(path, ids.tolist())) < 1e-3


def test_loss_mask_covers_assistant_replies_only(tmp_path):
    model, vocab = trained_like(SMALL)
    tok = Tokenizer(export_gguf(model, vocab, tmp_path / "m.gguf", Q.F32))
    dlg = dialogues("train", 1, 2, 12, 12)[0]
    ids, mask = encode_dialogue(tok, dlg)
    assert len(ids) == len(mask)
    supervised = tok.decode([int(t) for t, m in zip(ids, mask) if m and m != PROMPT], special=True)
    for r in dlg.rounds:
        assert r.assistant in supervised and r.user not in supervised
    assert supervised.count("<|im_end|>") == len(dlg.rounds)
    prompts = tok.decode([int(t) for t, m in zip(ids, mask) if m == PROMPT], special=True)
    assert all(r.user in prompts and r.assistant not in prompts for r in dlg.rounds)
    _, weighted = encode_dialogue(tok, dlg, oos_weight=2)  # out-of-scope replies count twice in the loss
    assert dlg.out_of_scope and set(weighted.tolist()) == {0, 1, 2, PROMPT}
    assert ((weighted == PROMPT) == (mask == PROMPT)).all() and ((weighted > 0) == (mask > 0)).all()
    twice = tok.decode([int(t) for t, w in zip(ids, weighted) if w == 2], special=True)
    assert all(dlg.rounds[o.round_index].assistant in twice for o in dlg.out_of_scope)


def test_the_prompt_loss_is_apart_from_the_replies_loss():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([0.0, PROMPT, PROMPT, 1.0, 2.0, 0.0])  # template, two prompt tokens, a reply counted 1 and 2
    replies, prompts = split_losses(losses, mask)
    assert replies.item() == pytest.approx((4 + 2 * 5) / 3)  # as the replies-only loss always was
    assert prompts.item() == pytest.approx((2 + 3) / 2)
    _, none = split_losses(losses, torch.tensor([0.0, 0, 0, 1, 1, 0]))
    assert none.item() == 0.0


def test_checkpoint_round_trip_has_no_pickle(tmp_path):
    model, vocab = trained_like(SMALL)
    save_checkpoint(model, 7, SMALL, vocab, tmp_path / "ckpt", [{"step": 7, "loss": 1.0}])
    shards = list((tmp_path / "ckpt").glob("weights-*.npz"))
    assert shards
    fresh = TrainModel(SMALL.model_config(len(vocab.tokens)))
    state = load_checkpoint(tmp_path / "ckpt", fresh)  # np.load(allow_pickle=False) inside
    assert state["step"] == 7 and vocab_from_state(state).tokens == vocab.tokens
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_run_can_start_from_an_exported_model(tmp_path):
    model, vocab = trained_like(SMALL)
    path = export_gguf(model, vocab, tmp_path / "m.gguf", Q.F32)
    fresh = TrainModel(SMALL.model_config(len(vocab.tokens)))
    load_gguf_weights(path, fresh, vocab)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n


def test_starting_from_another_shape_or_vocabulary_is_refused(tmp_path):
    model, vocab = trained_like(SMALL)
    path = export_gguf(model, vocab, tmp_path / "m.gguf", Q.F32)
    wider = dataclasses.replace(SMALL, ffn_dim=384)
    with pytest.raises(KvchatError, match="ffn_dim 256 \\(this run: 384\\)"):
        load_gguf_weights(path, TrainModel(wider.model_config(len(vocab.tokens))), vocab)
    other = build_vocab(dataclasses.replace(SMALL, seed=1))
    other.tokens[-1] = other.tokens[-1] + "x"  # same length, another token
    with pytest.raises(KvchatError, match="another vocabulary"):
        load_gguf_weights(path, TrainModel(SMALL.model_config(len(vocab.tokens))), other)


def test_a_run_from_an_exported_model_keeps_its_vocabulary(tmp_path, models):
    model, vocab = trained_like(SMALL)
    path = export_gguf(model, vocab, tmp_path / "m.gguf", Q.F32)
    again = vocab_from_gguf(path)
    assert (again.tokens, again.token_types, again.merges, again.special_ids) == \
        (vocab.tokens, vocab.token_types, vocab.merges, vocab.special_ids)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(KvchatError, match="bad.gguf"):
        vocab_from_gguf(tmp_path / "bad.gguf")
    with pytest.raises(KvchatError, match="not a kvchat demo model's vocabulary"):
        vocab_from_gguf(models.get(arch="gemma3"))  # another model's: its weights would mean something else


def test_averaging_models_writes_the_mean_of_their_weights(tmp_path):
    a, vocab = trained_like(SMALL)
    b, _ = trained_like(SMALL)
    pa, pb = export_gguf(a, vocab, tmp_path / "a.gguf", Q.F32), export_gguf(b, vocab, tmp_path / "b.gguf", Q.F32)
    path = average_models([pa, pb], tmp_path / "soup")
    soup = TrainModel(SMALL.model_config(len(vocab.tokens)))
    load_gguf_weights(path, soup, vocab)
    name, p = next((n, p) for n, p in soup.gguf_parameters().items() if p.dim() == 2)
    mean = (a.gguf_parameters()[name] + b.gguf_parameters()[name]) / 2
    torch.testing.assert_close(p, mean, atol=2e-3, rtol=2e-3)  # the soup is written in F16
    wider, _ = trained_like(dataclasses.replace(SMALL, ffn_dim=384))
    pw = export_gguf(wider, vocab, tmp_path / "w.gguf", Q.F32)
    with pytest.raises(KvchatError, match="another shape"):
        average_models([pa, pw], tmp_path / "bad")
