"""Training the embedded memory-assistant model: a small Llama (GQA, RoPE) on generated memory dialogues, exported
to GGUF with the project's own writer. `python -m kvchat.engine.train.trainer --help` (a CUDA GPU is expected).

Checkpoints are numpy .npz (loaded with allow_pickle=False) + JSON: the fp32 weights, the step and the config, so
training can continue across several runs (the optimizer restarts with a short warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn

from kvchat.engine.data.dialogues import _ANIMALS, _CITIES, _COLORS, _FIRST, _FOODS, MIXES, Dialogue, dialogues
from kvchat.engine.gguf.config import ModelConfig
from kvchat.engine.gguf.loader import read_tensor
from kvchat.engine.gguf.reader import GGUFFile
from kvchat.engine.gguf.writer import write_model_gguf
from kvchat.engine.reply_guard import DEMO_REPLY_CAP, REPLY_CAP_KEY
from kvchat.engine.text.vocab import CONTROL, ByteBPEVocab
from kvchat.errors import KvchatError

# ChatML, as Qwen writes it; the system prompt is optional.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class TrainConfig:
    n_layers: int = 8
    d_model: int = 256
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    context_length: int = 4096
    n_merges: int = 1200
    steps: int = 5600
    batch: int = 32
    max_tokens: int = 3072
    lr: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.05
    n_dialogues: int = 80000
    # Chats of 4-52 rounds put 6% of the tokens past position 2,000, where eval's chats (44-52 rounds, ~2,500 tokens)
    # ask most of their far-back questions; the last stages of the model shipped 2026-11-24 (latest) took 32-60.
    min_rounds: int = 4
    max_rounds: int = 52
    seed: int = 0
    # The defaults are the recipe of the model shipped 2026-11-23 (one run from random weights); the one shipped
    # 2026-11-24 (latest) took seven stages, each from the last one's weights, and the mean of the last two
    # (docs/embedded-model.md). Training noise level (dialogues.make_dialogue): 1 the defaults; 3 adds frame noise
    # (more recall on new phrasings); 4 question tails; 5 makes half of the words put in everyday ones; 6 puts them
    # in more tails too.
    noise: int = 1
    compile: int = 0  # 1: torch.compile the model on a GPU (~1.8x the steps/s after ~2 minutes compiling)
    oos_weight: int = 1  # the loss weight of replies to out-of-scope prompts (a polite refusal) against recall's 1
    never_told: int = 25  # how often a question asks about something never told (dialogues.make_dialogue)
    wide: int = 0  # 1: every template group's `more` phrasings too (dialogues.Templates), about twice the frames
    # Weight of a second next-token loss on the prompts (the user's messages and the template around them), beside
    # the replies' loss (each averaged over its own tokens): predicting how people write gives the frame words
    # distributional embeddings ("called", "named", "known as" in the same places), which the replies' loss alone
    # shapes only as far as an answer needs them. 0: replies only; the model shipped 2026-11-24 (latest) took 1.0 in
    # its last four stages (0.3 and 3.0 recalled less on held-out phrasings; docs/embedded-model.md).
    user_lm: float = 0.0
    # Issue 45: "copy" mixes facts whose values must be copied whatever they look like into the training chats
    # (dialogues.make_dialogue `mix`): random strings and codes, dates, times, years, phone numbers and amounts in
    # their written forms, several attributes of one named thing asked one at a time, facts told in passing, and
    # British/American spellings, dropped apostrophes and slips in facts and questions; `mix_share` of the facts
    # told are the mix's. "" (no mix): the chats every earlier run trained on, byte for byte.
    mix: str = ""
    mix_share: float = 0.5
    # The share of training chats' small-talk sentences written by a grammar (engine/data/small_talk.py) rather
    # than drawn from the ten fixed ones: a model trained on ten skips those ten alone, and on held-out small talk
    # answers questions with its words (docs/embedded-model.md, "The fourth run"). 0: the chats of every earlier
    # run, byte for byte.
    talk: float = 0.0
    # The share of training chats' requests written by a grammar (engine/data/small_talk.py `everyday_request`)
    # rather than drawn from the trained templates: a model trained on the copy mix took held-out requests with a
    # number or an unknown word for facts (docs/embedded-model.md, "The sixth run"). 0: the chats of before.
    requests: float = 0.0
    # The share of the copy mix's facts that are about anything (engine/data/open_facts.py): a subject from a wide
    # vocabulary or made up, found later by its words; G copied values in the generator's own subjects and few in
    # sentences no template wrote (docs/embedded-model.md, "The seventh run"). 0: the chats of before.
    subjects: float = 0.0
    # The share of the copy mix's random strings drawn as lower-case words or several words (dialogues._WORD_STYLES):
    # the kinds G copied least on the development set (docs/embedded-model.md, "What G misses"). 0: the chats of
    # before.
    words: float = 0.0

    def model_config(self, vocab_size: int) -> ModelConfig:
        hd = self.d_model // self.n_heads
        return ModelConfig(arch="llama", n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, head_dim=hd, ffn_dim=self.ffn_dim, vocab_size=vocab_size,
                           context_length=self.context_length, rms_eps=1e-5, rope_base=10000.0, rope_dim=hd,
                           rope_neox=False, rope_freq_scale=1.0, qkv_bias=False, tied_output=True, llama3_rope=False)


def round_text(user: str, assistant: str | None, system: str | None) -> str:
    """The text CHAT_TEMPLATE adds for one round (tests check it against the jinja rendering)."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    text = f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return text if assistant is None else text + f"{assistant}<|im_end|>\n"


def build_vocab(cfg: TrainConfig) -> ByteBPEVocab:
    """BPE merges learned on the dialogues' fixed phrasing with every name and value removed, so names split into
    the same kind of pieces in the training and the held-out split."""
    values = set(_FIRST) | set(_CITIES) | set(_COLORS) | set(_FOODS) | set(_ANIMALS)
    texts = []
    for dlg in dialogues("train", 600, cfg.seed, cfg.min_rounds, cfg.max_rounds):
        for i, r in enumerate(dlg.rounds):
            text = round_text(r.user, r.assistant, dlg.system if i == 0 else None)
            texts.append(" ".join(w for w in text.split(" ") if w.strip(".,?!'") not in values))
    return ByteBPEVocab.train(texts, cfg.n_merges, SPECIALS, bos=None, eos="<|im_end|>", eot="<|im_end|>",
                              add_bos=False, pre="qwen2")


# ---- tokenizing dialogues with llama.cpp's tokenizer, in worker processes ----

_worker_tok = None


def _init_worker(gguf_path: str) -> None:
    global _worker_tok
    from kvchat.engine.text.tokenizer import Tokenizer

    _worker_tok = Tokenizer(gguf_path)


PROMPT = 255  # encode_dialogue's mark for a prompt token (reply weights are small integers)


def encode_dialogue(tok, dlg: Dialogue, oos_weight: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss weights (1 on assistant replies and their end-of-turn token; `oos_weight` on the replies
    to out-of-scope prompts; PROMPT on the prompts' tokens, which only TrainConfig.user_lm trains on)."""
    ids, mask = [], []
    out_of_scope = {o.round_index for o in dlg.out_of_scope}
    for i, r in enumerate(dlg.rounds):
        prompt = tok.encode(round_text(r.user, None, dlg.system if i == 0 else None))
        reply = tok.encode(f"{r.assistant}<|im_end|>\n")
        ids += prompt + reply
        w = oos_weight if i in out_of_scope else 1
        mask += [PROMPT] * len(prompt) + [w] * (len(reply) - 1) + [0]  # the trailing newline is template
    return np.asarray(ids, np.int32), np.asarray(mask, np.uint8)


def _encode_chunk(args) -> list[tuple[np.ndarray, np.ndarray]]:
    split, count, seed, lo, hi, noise, oos_weight, never_told, wide, mix, mix_share, talk, requests, subjects, \
        words = args
    return [encode_dialogue(_worker_tok, d, oos_weight)
            for d in dialogues(split, count, seed, lo, hi, noise=noise, never_told=never_told, wide=bool(wide),
                               mix=mix or None, mix_share=mix_share, talk=talk, requests=requests,
                               subjects=subjects, words=words)]


def corpus_chunks(cfg: TrainConfig) -> list[tuple]:
    """The training chats as `_encode_chunk` arguments: 500 chats a chunk, each chunk its own seed."""
    return [("train", 500, cfg.seed * 100_000 + i, cfg.min_rounds, cfg.max_rounds, cfg.noise, cfg.oos_weight,
             cfg.never_told, cfg.wide, cfg.mix, cfg.mix_share, cfg.talk, cfg.requests, cfg.subjects, cfg.words)
            for i in range(math.ceil(cfg.n_dialogues / 500))]


def encode_corpus(gguf_path: Path, cfg: TrainConfig, workers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    chunks = corpus_chunks(cfg)
    with mp.get_context("spawn").Pool(workers, _init_worker, (str(gguf_path),)) as pool:
        out = []
        for part in pool.imap_unordered(_encode_chunk, chunks):
            out += part
    return out


# ---- the trainable model: the same math and tensor layout as engine.model ----

class TrainModel(nn.Module):
    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.mc = mc
        d, hd = mc.d_model, mc.head_dim
        self.embed = nn.Embedding(mc.vocab_size, d)
        self.layers = nn.ModuleList()
        for _ in range(mc.n_layers):
            layer = nn.Module()
            layer.attn_norm, layer.ffn_norm = nn.RMSNorm(d, eps=mc.rms_eps), nn.RMSNorm(d, eps=mc.rms_eps)
            layer.wq = nn.Linear(d, mc.n_heads * hd, bias=False)
            layer.wk = nn.Linear(d, mc.n_kv_heads * hd, bias=False)
            layer.wv = nn.Linear(d, mc.n_kv_heads * hd, bias=False)
            layer.wo = nn.Linear(mc.n_heads * hd, d, bias=False)
            layer.w_gate = nn.Linear(d, mc.ffn_dim, bias=False)
            layer.w_up = nn.Linear(d, mc.ffn_dim, bias=False)
            layer.w_down = nn.Linear(mc.ffn_dim, d, bias=False)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(d, eps=mc.rms_eps)
        inv = mc.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(mc.context_length, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, D]: adjacent pairs, as llama.cpp rotates `llama` files."""
        t = x.shape[1]
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]
        a, b = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).type_as(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mc, (bsz, t) = self.mc, ids.shape
        h = self.embed(ids)
        for L in self.layers:
            x = L.attn_norm(h)
            q = self._rope(L.wq(x).view(bsz, t, mc.n_heads, mc.head_dim)).transpose(1, 2)
            k = self._rope(L.wk(x).view(bsz, t, mc.n_kv_heads, mc.head_dim)).transpose(1, 2)
            v = L.wv(x).view(bsz, t, mc.n_kv_heads, mc.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + L.wo(o.transpose(1, 2).reshape(bsz, t, -1))
            x = L.ffn_norm(h)
            h = h + L.w_down(F.silu(L.w_gate(x)) * L.w_up(x))
        return F.linear(self.norm(h), self.embed.weight)  # tied output

    def gguf_parameters(self) -> dict[str, nn.Parameter]:
        """Each parameter under its GGUF tensor name."""
        out = {"token_embd.weight": self.embed.weight, "output_norm.weight": self.norm.weight}
        for i, L in enumerate(self.layers):
            p = f"blk.{i}."
            out.update({p + "attn_norm.weight": L.attn_norm.weight, p + "attn_q.weight": L.wq.weight,
                        p + "attn_k.weight": L.wk.weight, p + "attn_v.weight": L.wv.weight,
                        p + "attn_output.weight": L.wo.weight, p + "ffn_norm.weight": L.ffn_norm.weight,
                        p + "ffn_gate.weight": L.w_gate.weight, p + "ffn_up.weight": L.w_up.weight,
                        p + "ffn_down.weight": L.w_down.weight})
        return out

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        return {name: p.detach().float().cpu().numpy() for name, p in self.gguf_parameters().items()}


# ---- checkpoints (npz + json) ----

def save_checkpoint(model: TrainModel, step: int, cfg: TrainConfig, vocab: ByteBPEVocab, folder: Path,
                    history: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("weights-*.npz"):
        old.unlink()
    # Shards of at most ~12 MB, so a checkpoint travels between machines whose file transfers are capped.
    shard, size, index = {}, 0, 0
    for name, tensor in model.state_dict().items():
        shard[name] = tensor.detach().float().cpu().numpy()
        size += shard[name].nbytes
        if size > 12 * 2**20:
            np.savez(folder / f"weights-{index}.npz", **shard)
            shard, size, index = {}, 0, index + 1
    if shard:
        np.savez(folder / f"weights-{index}.npz", **shard)
    (folder / "state.json").write_text(json.dumps({
        "step": step, "config": asdict(cfg), "history": history,
        "vocab": {"tokens": vocab.tokens, "token_types": vocab.token_types, "merges": vocab.merges,
                  "special_ids": vocab.special_ids},
    }))


def load_checkpoint(folder: Path, model: TrainModel) -> dict:
    weights = {}
    for shard in sorted(folder.glob("weights-*.npz")):
        with np.load(shard, allow_pickle=False) as z:
            weights.update({k: torch.from_numpy(z[k]) for k in z.files})
    model.load_state_dict(weights)
    return json.loads((folder / "state.json").read_text())


_SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size")


def load_gguf_weights(path: Path, model: TrainModel, vocab: ByteBPEVocab) -> None:
    """Start from an exported model (the shipped one, say) instead of random weights; its shape and vocabulary must
    be this run's, or the weights would mean something else."""
    gf = GGUFFile(path)
    theirs = ModelConfig.from_gguf(gf)
    wrong = [f"{f} {getattr(theirs, f)} (this run: {getattr(model.mc, f)})" for f in _SHAPE_FIELDS
             if getattr(theirs, f) != getattr(model.mc, f)]
    if wrong:
        raise KvchatError(f"{path}: another shape: {', '.join(wrong)}")
    if gf.array("tokenizer.ggml.tokens") != vocab.tokens:
        raise KvchatError(f"{path}: another vocabulary than this run's (the merges follow --seed and n_merges)")
    with torch.no_grad():
        for name, p in model.gguf_parameters().items():
            p.copy_(read_tensor(gf.tensors[name], torch.device("cpu"), torch.float32))


def average_models(paths: list[Path], out: Path) -> Path:
    """A "model soup": the mean of the weights of models fine-tuned from one another (same shape and vocabulary),
    which often generalises better than any one of them (Wortsman et al. 2022)."""
    vocab = vocab_from_gguf(paths[0])
    mc = ModelConfig.from_gguf(GGUFFile(paths[0]))
    models = []
    for path in paths:
        models.append(TrainModel(mc))
        load_gguf_weights(path, models[-1], vocab)
    with torch.no_grad():
        params = [m.gguf_parameters() for m in models]
        for name, p in params[0].items():
            p.copy_(torch.stack([ps[name] for ps in params]).mean(0))
    out.mkdir(parents=True, exist_ok=True)
    return export_gguf(models[0], vocab, out / "kvchat-memory-demo.gguf", Q.F16)


def vocab_from_state(state: dict) -> ByteBPEVocab:
    v = state["vocab"]
    return _vocab(v["tokens"], v["token_types"], v["merges"], v["special_ids"])


def vocab_from_gguf(path: Path) -> ByteBPEVocab:
    """The vocabulary an exported model was trained with: a run from its weights (`--init`) keeps it, whatever
    chats this run's merges would have been learned on."""
    gf = GGUFFile(path)  # a missing or garbled file: GGUFError, one line
    tokens, types = gf.array("tokenizer.ggml.tokens"), gf.array("tokenizer.ggml.token_type")
    merges = gf.array("tokenizer.ggml.merges")
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL}
    if not merges or set(specials) != set(SPECIALS):
        raise KvchatError(f"{path}: not a kvchat demo model's vocabulary (BPE merges and the special tokens "
                          f"{', '.join(SPECIALS)})")
    return _vocab(list(tokens), list(types), list(merges), specials)


def _vocab(tokens, types, merges, special_ids) -> ByteBPEVocab:
    return ByteBPEVocab(tokens, types, merges, special_ids, bos=None, eos="<|im_end|>", eot="<|im_end|>",
                        add_bos=False, pre="qwen2")


def export_gguf(model: TrainModel, vocab: ByteBPEVocab, path: Path, qtype: Q = Q.F16) -> Path:
    write_model_gguf(path, model.mc, model.gguf_tensors(), vocab, CHAT_TEMPLATE, name="kvchat-memory-demo",
                     extra={REPLY_CAP_KEY: DEMO_REPLY_CAP}, qtype=qtype)
    return path


# ---- the loop ----

def _batches(corpus, batch: int, max_tokens: int, rng: random.Random):
    order = list(range(len(corpus)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            items = [corpus[j] for j in order[i : i + batch]]
            t = min(max_tokens, max(len(x[0]) for x in items))
            ids = np.zeros((batch, t + 1), np.int64)
            mask = np.zeros((batch, t + 1), np.float32)
            for r, (x, m) in enumerate(items):
                n = min(len(x), t + 1)
                ids[r, :n], mask[r, :n] = x[:n], m[:n]
            yield torch.from_numpy(ids), torch.from_numpy(mask)


def split_losses(loss_all: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replies' loss (weighted by the mask's reply weights) and the prompts' (PROMPT tokens), each averaged over
    its own tokens, so that adding the second leaves the first's scale alone."""
    is_prompt = mask == PROMPT
    reply, prompt = mask.masked_fill(is_prompt, 0), is_prompt.float()
    return ((loss_all * reply).sum() / reply.sum().clamp_min(1),
            (loss_all * prompt).sum() / prompt.sum().clamp_min(1))


def train(cfg: TrainConfig, out: Path, resume: Path | None, steps: int, workers: int, log=print,
          device: str = "cuda", minutes: float | None = None, init: Path | None = None) -> Path:
    """`resume` continues a checkpoint's run (its config and step); `init` starts a new run (this config, step 0)
    from an exported GGUF's weights."""
    torch.manual_seed(cfg.seed)
    device = torch.device(device)
    if resume is not None:
        state = json.loads((resume / "state.json").read_text())
        cfg = TrainConfig(**state["config"])
        vocab = vocab_from_state(state)
    else:
        state = {"step": 0, "history": []}
        vocab = vocab_from_gguf(init) if init is not None else build_vocab(cfg)
    mc = cfg.model_config(len(vocab.tokens))
    model = TrainModel(mc)
    if resume is not None:
        load_checkpoint(resume, model)
    elif init is not None:
        load_gguf_weights(init, model, vocab)
    out.mkdir(parents=True, exist_ok=True)
    tok_path = export_gguf(model, vocab, out / "tokenizer-model.gguf", Q.F32)  # llama.cpp reads the vocabulary here
    t0 = time.time()
    corpus = encode_corpus(tok_path, cfg, workers)
    n_tok = sum(len(x[0]) for x in corpus)
    log(f"{len(corpus)} dialogues, {n_tok / 1e6:.1f}M tokens, {time.time() - t0:.0f} s to generate and tokenize")
    model = model.to(device)
    compiled = cfg.compile and device.type == "cuda"
    forward = torch.compile(model, dynamic=True) if compiled else model  # batches differ in length
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay,
                             "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    start, total = state["step"], cfg.steps
    history = state["history"]
    batches = _batches(corpus, cfg.batch, cfg.max_tokens, random.Random(cfg.seed + start))
    t0, tokens_seen = time.time(), 0
    end = min(start + steps, total)
    for step in range(start, end):
        if minutes is not None and time.time() - t0 > 60 * minutes:
            end = step
            log(f"time limit: stopping at step {step}")
            break
        warm = min(1.0, (step - start + 1) / cfg.warmup)
        lr = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, mask = (x.to(device, non_blocking=True) for x in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = forward(ids[:, :-1])
        loss_all = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        loss, prompt_loss = split_losses(loss_all, mask[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + cfg.user_lm * prompt_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += ids.numel()
        if (step + 1) % 100 == 0 or step == start:
            rate = tokens_seen / (time.time() - t0)
            history.append({"step": step + 1, "loss": round(loss.item(), 4), "lr": lr,
                            "prompt_loss": round(prompt_loss.item(), 4)})
            log(f"step {step + 1}/{total}  loss {loss.item():.4f}  prompts {prompt_loss.item():.3f}  lr {lr:.2e}  "
                f"{rate / 1e3:.0f}k tok/s")
    save_checkpoint(model, end, cfg, vocab, out / "checkpoint", history)
    return export_gguf(model, vocab, out / "kvchat-memory-demo.gguf", Q.F16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and the exported GGUF")
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--resume", type=Path, default=None, help="checkpoint folder to continue from")
    start.add_argument("--init", type=Path, default=None,
                       help="start a new run from this exported model's weights and vocabulary (same shape)")
    start.add_argument("--average", type=Path, nargs="+", default=None, metavar="FILE",
                       help="train nothing: write the mean of these exported models' weights (same shape and "
                            "vocabulary) to OUT/kvchat-memory-demo.gguf")
    ap.add_argument("--steps", type=int, default=None, help="steps to run now (default: all remaining)")
    ap.add_argument("--total-steps", type=int, default=None, help="length of the whole schedule (new runs only)")
    ap.add_argument("--workers", type=int, default=max(1, mp.cpu_count() - 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--minutes", type=float, default=None, help="stop (and save) after this many minutes of steps")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a TrainConfig field for a new run (e.g. --set batch=8)")
    ap.add_argument("--mix", choices=MIXES, default=None,
                    help="for a new run: mix these facts into the training chats (copy: values to copy whatever they "
                         "look like, issue 45; TrainConfig.mix)")
    ap.add_argument("--mix-share", type=float, default=None, metavar="SHARE",
                    help="for a new run: the share of facts told that are the mix's (default 0.5)")
    args = ap.parse_args()
    cfg = TrainConfig(seed=args.seed)
    for item in args.set:
        field, value = item.split("=", 1)
        setattr(cfg, field, type(getattr(cfg, field))(value))
    if args.mix is not None:
        cfg.mix = args.mix
    if args.mix_share is not None:
        if not 0 <= args.mix_share <= 1:
            ap.error("--mix-share must be within 0-1")
        cfg.mix_share = args.mix_share
    if args.total_steps:
        cfg.steps = args.total_steps
    try:
        if args.average:
            path = average_models(args.average, args.out)
        else:
            path = train(cfg, args.out, args.resume, args.steps or cfg.steps, args.workers, device=args.device,
                         minutes=args.minutes, init=args.init)
    except KvchatError as e:  # a wrong --init/--average file: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    print(f"exported {path}")


if __name__ == "__main__":
    main()
