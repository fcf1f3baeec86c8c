"""The demo model: a small Llama trained on this machine's CPU on a public-domain novel, so that a new mesh
answers in words a person recognises.

The text is Botchan (Natsume Soseki; the 1919 English translation by Yasotaro Morri, in the public domain),
shipped as kernels/data/botchan.txt: Project Gutenberg's eBook #8868, as sentencepiece's source distribution
carries it for its tests, without Gutenberg's header and licence. Chapters I to X (and the translator's note)
train it; chapter XI is held out, and the perplexity on it is the model's figure of merit. Its shape is that of
`stratamesh model tiny`'s random-weight Llama (6 layers of 256, a 1024-token byte-level BPE), so a mesh is as
fast serving either; the weights are stored in float16 (8 MB). `stratamesh model train-demo` retrains it; the
shipped copy is DEMO_DIR.

Its draft (DRAFT_DIR; `stratamesh model train-demo --draft` retrains it) is the same kind of model with fewer layers
and the demo's own tokenizer, trained on the same text to predict what the demo model predicts (distillation: the
KL divergence from the demo's next-token distribution): speculative decoding's draft_model proposer runs it to
guess the demo's next tokens (agent.engine.draft_model)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import parse_config, read_config
from stratamesh.kernels.models.decoder import load_stage, one_sequence
from stratamesh.kernels.models.onnx_stage import load_runtime_stage
from stratamesh.kernels.models.trainable import TrainableDecoder
from stratamesh.kernels.tiny_model import IM_END, IM_START, _config, train_tokenizer, write_checkpoint

DATA = Path(__file__).parent / "data"
BOOK = DATA / "botchan.txt"
DEMO_DIR = DATA / "demo-llama"      # the shipped model (what `stratamesh up` serves by default)
DEMO_SHAPE = {"num_layers": 6, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2,
              "vocab_size": 1024}
DRAFT_DIR = DATA / "demo-llama-draft"       # the demo model's draft (speculative decoding's draft_model)
DRAFT_SHAPE = dict(DEMO_SHAPE, num_layers=2)
STORED_DTYPE = torch.float16
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]"))\s+(?=["A-Z])')   # the spaces after a sentence
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


@dataclass(frozen=True, slots=True)
class Book:
    """The novel as running text (its hard line breaks joined), split into what trains and what is held out."""

    train: str
    held_out: str


def read_book(path: Path = BOOK) -> Book:
    """The book's chapters, each one paragraph of running text; the last chapter is held out."""
    chapters = re.split(r"\n(?=CHAPTER )", path.read_text(encoding="utf-8"))
    paragraphs = [" ".join(chapter.split()) for chapter in chapters]
    return Book(train="\n\n".join(paragraphs[:-1]) + "\n", held_out=paragraphs[-1] + "\n")


def conversations(text: str) -> str:
    """text as ChatML conversations (the tokenizer's chat template): each sentence a user's turn and the one to three
    that follow it the assistant's reply; so the model also answers a chat in the book's words, and stops."""
    sentences = [s for paragraph in text.split("\n") for s in _SENTENCE_END.split(paragraph.strip()) if s]
    turns, i = [], 0
    while i + 1 < len(sentences):
        reply_len = 1 + i % 3
        reply = " ".join(sentences[i + 1:i + 1 + reply_len])
        turns.append(f"{IM_START}user\n{sentences[i]}{IM_END}\n{IM_START}assistant\n{reply}{IM_END}\n")
        i += 1 + reply_len
    return "".join(turns)


def words_of(text: str) -> list[str]:
    """The words of text, lower-cased (letters, with inner apostrophes: "don't")."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """How the demo model is trained: AdamW on random windows of the training text, warm-up then cosine decay."""

    steps: int = 400             # held-out perplexity is lowest about here: the book is small, more steps overfit
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    dropout: float = 0.1
    chat_fraction: float = 0.25   # rows of a batch taken from the book as conversations
    seed: int = 0

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * step / self.steps))
        return self.lr * warm * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


DRAFT_SETTINGS = TrainSettings(steps=1000)     # distillation does not overfit the book as the demo's own loss would


@dataclass(frozen=True, slots=True)
class TrainReport:
    """What a training run produced: where, how long, and how well it predicts the held-out chapter."""

    out_dir: Path
    steps: int
    seconds: float
    train_loss: float
    held_out_perplexity: float
    num_params: int
    weights_bytes: int


def train_demo(out_dir: str | Path, settings: TrainSettings = TrainSettings(),
               log: Callable[[str], None] = lambda line: None) -> TrainReport:
    """Train the demo model on the book's training chapters and write it to out_dir as a Hugging Face folder."""
    tokenizer = train_tokenizer(DEMO_SHAPE["vocab_size"], [read_book().train])
    return _train_model(out_dir, DEMO_SHAPE, tokenizer, None, settings, log)


def train_draft(out_dir: str | Path, target_dir: str | Path = DEMO_DIR, settings: TrainSettings = DRAFT_SETTINGS,
                log: Callable[[str], None] = lambda line: None) -> TrainReport:
    """Train a draft of the model in target_dir (a demo model: the book's, with its tokenizer) on the same text, to
    predict the target's next-token distributions, and write it to out_dir (DRAFT_SHAPE: the demo's layers, fewer)."""
    tokenizer = Tokenizer.from_file(str(Path(target_dir, "tokenizer.json")))
    report = _train_model(out_dir, DRAFT_SHAPE, tokenizer, _teacher(target_dir), settings, log)
    log(f"greedy agreement with the target on the held-out chapter "
        f"{greedy_agreement(report.out_dir, target_dir, read_book().held_out):.3f}")
    return report


def _teacher(model_dir: str | Path) -> TrainableDecoder:
    """The model in model_dir as a frozen TrainableDecoder in float32 (what a draft learns to predict)."""
    from safetensors.torch import load_file

    teacher = TrainableDecoder(read_config(model_dir))
    weights = load_file(str(Path(model_dir, "model.safetensors")))
    teacher.load_state_dict({name: t.float() for name, t in weights.items()})
    return teacher.eval().requires_grad_(False)


def _train_model(out_dir: str | Path, shape: dict[str, int], tokenizer: Tokenizer, teacher: TrainableDecoder | None,
                 settings: TrainSettings, log: Callable[[str], None]) -> TrainReport:
    """Trains a Llama of shape on the book's training chapters (its text and conversations; against the teacher's
    next-token distributions where one is given, the text's next tokens otherwise) and writes it to out_dir."""
    torch.manual_seed(settings.seed)
    book = read_book()
    config = _config("llama", max_pos=2048, tie=False, rope_scaling=None, rope_spelling="classic",
                     sliding_window=None, num_layers=shape["num_layers"], hidden=shape["hidden_size"],
                     intermediate=shape["intermediate_size"], num_heads=shape["num_heads"],
                     num_kv_heads=shape["num_kv_heads"], vocab_size=shape["vocab_size"])
    started = time.perf_counter()
    # Gradients on, whatever the thread's mode (an agent's data plane turns inference mode on for its thread);
    # every tensor autograd sees is made in here.
    with torch.inference_mode(False), torch.enable_grad():
        train_ids = torch.tensor(tokenizer.encode(book.train).ids)
        chat_ids = torch.tensor(tokenizer.encode(conversations(book.train)).ids)
        model = TrainableDecoder(parse_config(config), seed=settings.seed, dropout=settings.dropout)
        num_params = sum(p.numel() for p in model.parameters())
        log(f"{len(train_ids)} training tokens, {len(tokenizer.encode(book.held_out).ids)} held out; "
            f"{num_params / 1e6:.2f} M parameters")
        loss = _train(model, (train_ids, chat_ids), settings, log, teacher)
    seconds = time.perf_counter() - started
    weights = {name: t.to(STORED_DTYPE) for name, t in model.checkpoint_tensors().items()}
    out = write_checkpoint(out_dir, dict(config, dtype=str(STORED_DTYPE).removeprefix("torch.")), weights, tokenizer)
    perplexity = served_perplexity(out, book.held_out, settings.seq_len)
    log(f"held-out perplexity {perplexity:.2f} after {settings.steps} steps in {seconds:.0f} s")
    return TrainReport(out, settings.steps, seconds, loss, perplexity, num_params,
                       (out / "model.safetensors").stat().st_size)


def _train(model: TrainableDecoder, streams: tuple[torch.Tensor, torch.Tensor], s: TrainSettings,
           log: Callable[[str], None], teacher: TrainableDecoder | None) -> float:
    """Runs s.steps optimizer steps over windows of the book's running text and of its conversations (a
    chat_fraction of the rows); returns the last step's loss."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    norms = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": s.weight_decay},
                                   {"params": norms, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(s.seed)
    loss = float("nan")
    for step in range(s.steps):
        loss = _step(model, optimizer, streams, s, step, g, teacher)
        if step % 100 == 0 or step == s.steps - 1:
            log(f"step {step:5d}  loss {loss:.3f}  lr {s.lr_at(step):.2e}")
    return loss


def _step(model: TrainableDecoder, optimizer: torch.optim.Optimizer, streams: tuple[torch.Tensor, torch.Tensor],
          s: TrainSettings, step: int, g: torch.Generator, teacher: TrainableDecoder | None) -> float:
    """One optimizer step on a batch of windows; returns its loss: the cross-entropy of the windows' next tokens, or
    (a teacher given) the KL divergence of the model's next-token distributions from the teacher's."""
    for group in optimizer.param_groups:
        group["lr"] = s.lr_at(step)
    window = torch.stack([_window(streams[int(torch.rand(1, generator=g)) < s.chat_fraction], s.seq_len, g)
                          for _ in range(s.batch)])                                      # [B, T + 1]
    logits = model(window[:, :-1])                                                     # [B, T, vocab]
    if teacher is None:
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    else:
        with torch.no_grad():
            target = F.log_softmax(teacher(window[:, :-1]).flatten(0, 1), dim=-1)
        loss = F.kl_div(F.log_softmax(logits.flatten(0, 1), dim=-1), target, reduction="batchmean", log_target=True)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.item())


def _window(ids: torch.Tensor, seq_len: int, g: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, len(ids) - seq_len - 1, (1,), generator=g))
    return ids[start:start + seq_len + 1]


@torch.no_grad()
def held_out_perplexity(model: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, seq_len: int) -> float:
    """exp(mean next-token loss) of model (ids [B, T] -> logits [B, T, vocab]) over ids cut into consecutive
    windows of seq_len + 1 tokens (each window predicts its last seq_len tokens from what precedes them in it)."""
    num_windows = (len(ids) - 1) // seq_len
    total, count = 0.0, 0
    for w in range(num_windows):
        window = ids[w * seq_len:(w + 1) * seq_len + 1][None]
        logits = model(window[:, :-1]).float()
        total += float(F.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
        count += seq_len
    return math.exp(total / count)


def served_perplexity(model_dir: str | Path, text: str, seq_len: int = 128, quantize: str = "",
                      onnx_cache: str | Path | None = None, max_tokens: int = 0) -> float:
    """held_out_perplexity() of text under the model in model_dir as one stage serves it: its stored weights, read
    by the stage loader (and quantized: StageSpec.quantize), computed by kernels.models.decoder in float32 on this
    CPU, or by ONNX Runtime from an export kept in onnx_cache (kernels.models.onnx_stage) where one is given.
    max_tokens: only the text's first so many tokens (0: all of it)."""
    config = read_config(model_dir)
    spec = StageSpec(model_id=Path(model_dir).name, model_path=str(model_dir), start_layer=0,
                     end_layer=config.num_layers, num_layers=config.num_layers, quantize=quantize,
                     runtime="onnxruntime" if onnx_cache else "torch")
    stage = load_runtime_stage(spec, onnx_cache, config) if onnx_cache else load_stage(spec, config)
    ids = torch.tensor(Tokenizer.from_file(str(Path(model_dir, "tokenizer.json"))).encode(text).ids)
    if max_tokens:
        ids = ids[:max_tokens + 1]

    def logits_of(window: torch.Tensor) -> torch.Tensor:     # [1, T] -> [1, T, vocab]
        hidden = one_sequence(stage, window.shape[1])(window[0], 0)
        return stage.logits(hidden)[None]

    return held_out_perplexity(logits_of, ids, seq_len)


def greedy_agreement(draft_dir: str | Path, target_dir: str | Path, text: str, seq_len: int = 128,
                     max_tokens: int = 4096) -> float:
    """The share of text's positions (its first max_tokens tokens, in windows of seq_len) where the draft's most
    likely next token is the target's: how often a greedy draft token would be kept."""
    tokenizer = Tokenizer.from_file(str(Path(target_dir, "tokenizer.json")))
    ids = torch.tensor(tokenizer.encode(text).ids[:max_tokens])
    draft, target = _teacher(draft_dir), _teacher(target_dir)
    agree = count = 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, seq_len):
            window = ids[start:start + seq_len][None]
            agree += int((draft(window).argmax(-1) == target(window).argmax(-1)).sum())
            count += window.shape[1]
    return agree / count
