"""Render octavo/assets/MODEL_CARD.md and the loss-curve plot from training/results.json."""
from __future__ import annotations

import csv
import json
import platform
import sys
from pathlib import Path
from typing import Any

from default_model_corpus import HELDOUT_PERCENT, SYSTEM_PROMPT


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def plot_loss(training: Path, names: list[str]) -> Path:
    # matplotlib is a dependency of this tool only, never of the runtime package.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name in names:
        with open(training / f"{name}_loss.csv") as f:
            rows = list(csv.DictReader(f))
        tokens = [int(r["tokens"]) / 1e6 for r in rows]
        ax.plot(tokens, [float(r["train_loss"]) for r in rows], label=f"{name} train")
        held = [(t, float(r["heldout_loss"])) for t, r in zip(tokens, rows) if r["heldout_loss"]]
        ax.plot([t for t, _ in held], [v for _, v in held], "o--", markersize=3, label=f"{name} held-out")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=6.0)
    ax.grid(alpha=0.3)
    ax.legend()
    path = training / "loss_curve.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fence(text: str) -> str:
    return "```\n" + text.replace("```", "` ` `") + "\n```"


def _model_section(name: str, m: dict[str, Any]) -> str:
    s = m["spec"]
    lines = [
        f"### {name}",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | LlamaForCausalLM, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads "
        f"({s['kv_heads']} KV heads), MLP {s['intermediate']}, RoPE theta 10000, tied embeddings, context 512 |",
        f"| parameters | {m['parameters']:,} ({m['parameters'] / 1e6:.2f} M) |",
        f"| weights | bf16 safetensors, {m['weights_bytes'] / 1e6:.1f} MB |",
        f"| training | {m['steps']:,} steps x {s['batch_size']} x 512 tokens = {m['tokens'] / 1e6:.2f} M tokens "
        f"in {m['train_seconds'] / 60:.1f} min; AdamW (0.9, 0.95), wd 0.1, peak lr {s['peak_lr']}, "
        f"50 warmup steps, cosine to 10% |",
        f"| final train loss | {m['final_train_loss']:.3f} (EMA of batch losses) |",
        f"| held-out perplexity | {m['heldout_ppl']:.2f} (whole held-out split, fp32) |",
        f"| held-out sample perplexity | {m['heldout_sample_ppl']:.2f} on `heldout_sample.txt`; "
        f"**test bound: {m['heldout_sample_ppl_bound']}** |",
        "",
        f"Golden greedy completion (fp32, transformers, {len(m['golden']['token_ids'])} new tokens) of "
        f"`{m['golden']['prompt']}`:",
        "",
        _fence(m["golden"]["prompt"] + m["golden"]["text"]),
        "",
        "Samples (prompt and completion, up to 80 new tokens; `sampled` is temperature 0.7, top-p 0.9,",
        "torch seed 0, the `generation_config.json` defaults):",
        "",
    ]
    for sample in m["samples"]:
        lines += [f"{sample['mode']}:", "", _fence(sample["prompt"] + sample["text"]), ""]
    return "\n".join(lines)


def write_model_card(out: Path, results: dict[str, Any]) -> Path:
    names = list(results["models"])
    plot_loss(out / "training", names)
    d = results["data"]
    target, draft = results["models"]["octavo-mini"], results["models"]["octavo-mini-draft"]
    py = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    text = f"""# Octavo Mini: the built-in default model

Two tiny Llama-architecture models trained from scratch by the Octavo project, shipped inside the
package so that `octavo serve` with no model argument works offline: `octavo-mini` (the default model)
and `octavo-mini-draft` (a much smaller model with the same tokenizer, for speculative decoding).
They write Python-flavoured text; they are a demo and a test fixture, not a useful assistant.

## Data and licence

The source files (`.py`) of the CPython {py} standard library as installed locally
(`sysconfig.get_paths()['stdlib']`), excluding `site-packages`, test suites and the generated codec
tables in `encodings/`. That code and its docstrings are licensed under the
[Python Software Foundation License](https://docs.python.org/3/license.html), which permits
redistribution and derived works. Each file is one document; a file is held out for evaluation when the
first 4 bytes of the SHA-256 of its stdlib-relative path, mod 100, are below {HELDOUT_PERCENT}. In addition,
each documented public function or class of a training file yields one short chat (system prompt
"{SYSTEM_PROMPT}", a question naming it, its docstring's first paragraph as the answer), so that the model has
seen the chat template.

- training: {d['train_docs']:,} documents (files and chats), {d['train_tokens']:,} tokens
- held-out: {d['heldout_docs']} files, {d['heldout_tokens']:,} tokens;
  `heldout_sample.txt` (the first lines of each held-out file, {d['heldout_sample_tokens']:,} tokens) ships
  with the package for the perplexity test

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files, {d['vocab_size']:,} entries, no unknown token.
Special tokens: `<|endoftext|>` (bos, eos and pad; every document starts after one, and the tokenizer's
post-processor prepends it to every encoded text), `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`
(end of a chat turn; `generation_config.json` stops on both `<|endoftext|>` and `<|end|>`). The chat
template in `tokenizer_config.json` renders each message as `<|role|>\\ncontent<|end|>\\n` and a
generation prompt as `<|assistant|>\\n`; roles other than system, user and assistant are refused.

## Models

{chr(10).join(_model_section(n, results['models'][n]) for n in names)}
## Limitations

- `octavo-mini` saw {target['tokens'] / 1e6:.1f} M tokens ({target['tokens'] / d['train_tokens']:.1f} passes over the
  training stream). It writes Python-looking code and docstring-like English with invented names and
  wrong logic; greedy decoding soon repeats itself, so prefer the sampling defaults.
- `octavo-mini-draft` saw {draft['tokens'] / 1e6:.2f} M tokens; it exists to exercise speculative decoding, and
  its acceptance rate against the target will be low.
- Context length 512 tokens; English and Python only.

`tests/test_mini_model.py` checks the held-out sample perplexity of both models against the bounds
above, the golden greedy completion, tokenizer agreement between Octavo and transformers, and that the
Octavo engine's greedy tokens equal transformers'.

## Quantized weights

`octavo-mini` served with on-the-fly weight quantization (`--quantization`), held-out sample perplexity
through the Octavo engine (`heldout_sample.txt` in windows of 511 tokens, prompt logprobs, bf16
activations; `tests/quant/test_quantized_perplexity.py` asserts int8 within 1% and int4 within 10% of bf16;
measured 2026-12-03, the int8 lm_head's row 2026-12-06, when the same run gave bf16 119.82 and int4 with the
lm_head kept 119.81):

| weights | held-out sample perplexity | vs bf16 |
|---|---|---|
| bf16 (as shipped) | 119.83 | 1.000 |
| fp32 activations and weights | 119.82 | 1.000 |
| int8 per channel, lm_head kept bf16 | 119.86 | 1.000 |
| int8, lm_head (the tied embedding) int8 too (the default) | 119.80 | 1.000 |
| int4 groups of 128, lm_head int8 per channel (the default) | 119.76 | 0.999 |
| int4 groups of 128, lm_head kept bf16 | 119.84 | 1.000 |
| int4 groups of 64 | 120.02 | 1.002 |
| int4 groups of 32 | 120.05 | 1.002 |
| int4 groups of 128, lm_head quantized too | 121.19 | 1.011 |

In int4 groups the output layer is the one that costs perplexity; in int8 per output channel it costs none
measurable, which is why `--lm-head-quantization` makes it int8 under int4 and int8 by default. The embedding table is
never quantized.

## Training

Hardware: torch with {d['threads']} thread(s) on one {_cpu_name()} machine of 2 cores shared with
other jobs (under that load one thread trained about 3x faster than two), fp32 (bf16 autocast measured
slower on this CPU), torch seed {d['seed']}. Batches are random 512-token windows of the packed,
shuffled token stream. The learning-rate schedule follows
`max(step / max_steps, elapsed / max_minutes)`, so this run's length and schedule were set by its time
budget. Rerunning the command rebuilds the corpus, tokenizer and `heldout_sample.txt` byte for byte
(same Python version) and repeats the first steps' losses exactly, but the final weights depend on the
machine's speed; for a step-exact run pass `--draft-steps N --target-steps N` with
`--draft-minutes 0 --target-minutes 0`.

Command: `{d['command']}`

![loss curve](training/loss_curve.png)

Train loss is an EMA of batch losses; the held-out points are the first 8 windows (4,096 tokens) of the
held-out stream, measured every 100 steps.

Per-step numbers: `training/*_loss.csv`; every number on this card: `training/results.json`.
"""
    path = out / "MODEL_CARD.md"
    path.write_text(text)
    return path


if __name__ == "__main__":
    assets = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("octavo/assets")
    write_model_card(assets, json.loads((assets / "training" / "results.json").read_text()))
