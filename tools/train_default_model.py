"""Train Octavo's built-in default model (and its speculative-decoding draft) from scratch.

Reproduce the shipped weights (CPU, 1 thread; see octavo/assets/MODEL_CARD.md for the exact
numbers of the shipped run):

    python tools/train_default_model.py --out octavo/assets --draft-minutes 8 --target-minutes 60

Data: the Python standard library's own sources (PSF licence), see default_model_corpus.py.
The learning-rate schedule runs over ``max(step / max_steps, elapsed / max_minutes)`` so a
time-limited run still decays fully and ends cleanly; pass ``--*-minutes 0`` with fixed
``--*-steps`` for a run that is reproducible step for step.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_card import write_model_card  # noqa: E402
from default_model_corpus import Corpus, build_corpus, token_stream  # noqa: E402
from default_model_eval import evaluate, write_heldout_sample  # noqa: E402
from default_model_tokenizer import (  # noqa: E402
    END_OF_TURN,
    EOS,
    MODEL_MAX_LENGTH,
    save_tokenizer,
    train_tokenizer,
)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # folder under the output directory
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    batch_size: int
    peak_lr: float


# Sized for a shared 2-core CPU: with a few million tokens in reach in an hour, a
# small model and small batches (more updates per token) learn the most per second.
TARGET = ModelSpec("octavo-mini", 256, 6, 4, 2, 768, batch_size=4, peak_lr=2e-3)
DRAFT = ModelSpec("octavo-mini-draft", 128, 2, 4, 2, 384, batch_size=4, peak_lr=3e-3)
WARMUP_STEPS = 50
MIN_LR_RATIO = 0.1
EVAL_EVERY = 100
EVAL_WINDOWS = 8


@dataclass
class LogRow:
    model: str
    step: int
    tokens: int
    elapsed_s: float
    lr: float
    train_loss: float
    heldout_loss: float | None


def build_model(spec: ModelSpec, tok: Tokenizer) -> LlamaForCausalLM:
    eos_id = tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


def lr_at(spec: ModelSpec, step: int, progress: float) -> float:
    if step < WARMUP_STEPS:
        return spec.peak_lr * (step + 1) / WARMUP_STEPS
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return spec.peak_lr * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine)


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    model.eval()
    loss = model(input_ids=windows, labels=windows).loss.item()
    model.train()
    return loss


def train(spec: ModelSpec, tok: Tokenizer, data: torch.Tensor, heldout: torch.Tensor,
          max_steps: int, max_minutes: float, seed: int) -> tuple[LlamaForCausalLM, list[LogRow]]:
    """Train until ``max_steps`` or ``max_minutes`` (0: no time limit), whichever comes first."""
    torch.manual_seed(seed)
    model = build_model(spec, tok)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.peak_lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(seed)
    T = MODEL_MAX_LENGTH
    eval_windows = heldout[: EVAL_WINDOWS * T].view(EVAL_WINDOWS, T)
    rows: list[LogRow] = []
    start = time.time()
    step, lr, smoothed = 0, 0.0, float("nan")

    def log(with_heldout: bool) -> None:
        held = round(heldout_loss(model, eval_windows), 4) if with_heldout else None
        row = LogRow(spec.name, step, step * spec.batch_size * T, round(time.time() - start, 1),
                     lr, round(smoothed, 4), held)
        rows.append(row)
        print(f"[{spec.name}] step {step} loss {smoothed:.3f} held {held} lr {lr:.2e} "
              f"tok/s {row.tokens / max(row.elapsed_s, 1e-6):.0f} t {row.elapsed_s:.0f}s", flush=True)

    model.train()
    while True:
        progress = step / max_steps
        if max_minutes:
            progress = max(progress, (time.time() - start) / (max_minutes * 60))
        if progress >= 1.0:
            break
        lr = lr_at(spec, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, data.numel() - T, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[o : o + T] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        smoothed = loss.item() if step == 1 else 0.9 * smoothed + 0.1 * loss.item()
        if step % 10 == 0 or step == 1:
            log(with_heldout=step % EVAL_EVERY == 0)
    if rows and rows[-1].step == step:
        rows.pop()  # logged again below, with its held-out loss
    log(with_heldout=True)
    return model, rows


def save_model(model: LlamaForCausalLM, tok: Tokenizer, folder: Path) -> None:
    eos_id = tok.token_to_id(EOS)
    model.to(torch.bfloat16).save_pretrained(folder)
    GenerationConfig(
        bos_token_id=eos_id,
        # A chat turn ends at <|end|>; plain text ends at EOS.
        eos_token_id=[eos_id, tok.token_to_id(END_OF_TURN)],
        pad_token_id=eos_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
    ).save_pretrained(folder)
    save_tokenizer(tok, folder)


def write_log(rows: list[LogRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("octavo/assets"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    # One thread: on a CPU shared with other jobs, two threads stall on each other
    # (measured 560 vs 195 tokens/s for the target under load).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-steps", type=int, default=3000)
    ap.add_argument("--draft-minutes", type=float, default=8.0, help="0: no time limit")
    ap.add_argument("--target-steps", type=int, default=3000)
    ap.add_argument("--target-minutes", type=float, default=60.0, help="0: no time limit")
    args = ap.parse_args()
    if args.draft_steps < 1 or args.target_steps < 1:
        raise ValueError("--draft-steps and --target-steps must be >= 1")
    if args.draft_minutes < 0 or args.target_minutes < 0:
        raise ValueError("--draft-minutes and --target-minutes must be >= 0")
    torch.set_num_threads(args.threads)
    t0 = time.time()

    corpus: Corpus = build_corpus()
    code_texts = [d.text for d in corpus.train if not d.name.startswith("chat:")]
    tok = train_tokenizer(code_texts, args.vocab_size)
    data = token_stream(tok, corpus.train, args.seed)
    heldout = token_stream(tok, corpus.heldout, args.seed)
    print(f"corpus: {len(corpus.train)} train docs, {data.numel()} tokens; "
          f"{len(corpus.heldout)} held-out docs, {heldout.numel()} tokens; {time.time() - t0:.0f}s", flush=True)
    write_heldout_sample(corpus.heldout, args.out / "heldout_sample.txt")

    runs = {}
    for spec, steps, minutes in ((DRAFT, args.draft_steps, args.draft_minutes),
                                 (TARGET, args.target_steps, args.target_minutes)):
        model, rows = train(spec, tok, data, heldout, steps, minutes, args.seed)
        save_model(model, tok, args.out / spec.name)
        write_log(rows, args.out / "training" / f"{spec.name}_loss.csv")
        runs[spec.name] = {"spec": asdict(spec), "steps": rows[-1].step, "tokens": rows[-1].tokens,
                           "train_seconds": rows[-1].elapsed_s, "final_train_loss": rows[-1].train_loss}
        del model
    results = evaluate(args.out, [DRAFT.name, TARGET.name], heldout, runs,
                       {"train_tokens": data.numel(), "heldout_tokens": heldout.numel(),
                        "train_docs": len(corpus.train), "heldout_docs": len(corpus.heldout),
                        "vocab_size": tok.get_vocab_size(), "threads": args.threads, "seed": args.seed,
                        "command": " ".join(sys.argv)})
    write_model_card(args.out, results)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
