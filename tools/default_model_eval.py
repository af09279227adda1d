"""Evaluate the shipped default models as they are on disk (bf16 files, run in fp32)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from default_model_corpus import SYSTEM_PROMPT, Document
from default_model_tokenizer import END_OF_TURN, EOS, MODEL_MAX_LENGTH, render_chat

SAMPLE_CHARS_PER_DOC = 1400
GOLDEN_PROMPT = "def fibonacci(n):"
GOLDEN_NEW_TOKENS = 32
SAMPLE_NEW_TOKENS = 80
CODE_PROMPTS = [GOLDEN_PROMPT, "class Stack:\n    \"\"\"", "import os\n\n\ndef list_files(path):\n"]
# The shipped generation_config.json defaults, so the card shows what a server user sees.
SAMPLING = {"temperature": 0.7, "top_p": 0.9}
SAMPLE_SEED = 0
CHAT_QUESTION = "What does the function dumps in the json module do?"
PPL_BOUND_FACTOR = 1.1
# What the training run records per model, kept when re-evaluating.
RUN_KEYS = ("spec", "steps", "tokens", "train_seconds", "final_train_loss")


def write_heldout_sample(heldout: list[Document], path: Path) -> None:
    """About 20 KB: the opening lines of every held-out file, each after an EOS as in training."""
    parts = []
    for doc in sorted(heldout, key=lambda d: d.name):
        head = doc.text[:SAMPLE_CHARS_PER_DOC]
        parts.append(EOS + head[: head.rfind("\n") + 1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts), encoding="utf-8")


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int = MODEL_MAX_LENGTH) -> float:
    """Non-overlapping windows; every token but each window's first is predicted once."""
    nll, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window].unsqueeze(0)
        if chunk.numel() < 2:
            break
        logits = model(input_ids=chunk).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.numel() - 1
    return math.exp(nll / count)


def _generate(model, tok: Tokenizer, prompt: str, new_tokens: int, stop: list[int],
              sample: bool) -> dict[str, Any]:
    prompt_ids = tok.encode(prompt).ids
    if sample:
        torch.manual_seed(SAMPLE_SEED)
    out = model.generate(
        torch.tensor([prompt_ids]), do_sample=sample, max_new_tokens=new_tokens,
        eos_token_id=stop, pad_token_id=stop[0], **(SAMPLING if sample else {}),
    )
    completion = out[0, len(prompt_ids):].tolist()
    return {"prompt": prompt, "mode": "sampled" if sample else "greedy",
            "token_ids": completion, "text": tok.decode(completion, skip_special_tokens=True)}


def _chat_prompt() -> str:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": CHAT_QUESTION}]
    return render_chat(messages, add_generation_prompt=True)


def _evaluate_one(folder: Path, heldout: torch.Tensor, sample: torch.Tensor) -> dict[str, Any]:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stop = [tok.token_to_id(EOS), tok.token_to_id(END_OF_TURN)]
    sample_ppl = perplexity(model, sample)
    prompts = [*CODE_PROMPTS, _chat_prompt()]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": (folder / "model.safetensors").stat().st_size,
        "heldout_ppl": perplexity(model, heldout),
        "heldout_sample_ppl": sample_ppl,
        "heldout_sample_ppl_bound": round(sample_ppl * PPL_BOUND_FACTOR, 2),
        "golden": _generate(model, tok, GOLDEN_PROMPT, GOLDEN_NEW_TOKENS, stop, sample=False),
        "samples": [_generate(model, tok, p, SAMPLE_NEW_TOKENS, stop, sample=s)
                    for s in (False, True) for p in prompts],
    }


def evaluate(out: Path, names: list[str], heldout: torch.Tensor, runs: dict[str, Any],
             data: dict[str, Any]) -> dict[str, Any]:
    """Writes out/training/results.json, the single source the model card is rendered from."""
    tok = Tokenizer.from_file(str(out / names[0] / "tokenizer.json"))
    sample_text = (out / "heldout_sample.txt").read_text(encoding="utf-8")
    sample = torch.tensor(tok.encode(sample_text, add_special_tokens=False).ids)
    results = {"data": {**data, "heldout_sample_tokens": sample.numel()}, "models": {}}
    for name in names:
        results["models"][name] = {**runs.get(name, {}), **_evaluate_one(out / name, heldout, sample)}
    path = out / "training" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def main() -> None:
    """Re-evaluate shipped models without retraining: python tools/default_model_eval.py [ASSETS]"""
    from default_model_card import write_model_card
    from default_model_corpus import build_corpus, token_stream

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("octavo/assets")
    previous = json.loads((out / "training" / "results.json").read_text())
    data = previous["data"]
    tok = Tokenizer.from_file(str(out / next(iter(previous["models"])) / "tokenizer.json"))
    heldout = token_stream(tok, build_corpus().heldout, data["seed"])
    runs = {name: {k: m[k] for k in RUN_KEYS} for name, m in previous["models"].items()}
    write_model_card(out, evaluate(out, list(runs), heldout, runs, data))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
