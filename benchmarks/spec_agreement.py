"""How often greedy output with speculative decoding is plain greedy output, token for token.

    python -m benchmarks.spec_agreement                       # the default model, bf16, n-gram k=3, batch 8
    python -m benchmarks.spec_agreement --batch 1 --speculative-model octavo/assets/octavo-mini-draft \\
        --model octavo/assets/octavo-mini

Rejection sampling makes speculation exact in arithmetic; in a finite dtype a verified position is exact only
if its logits round as plain decoding's do, or a near-tie flips and the rest of the sequence differs. Prompts:
16 windows of 60 words of octavo/assets/heldout_english.txt; 64 new tokens each, ignore_eos; prefix caching
and chunked prefill at the engine's defaults. Reported: the fraction of positions where both runs chose the
same token, whole sequences identical, and each sequence's first divergence.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.report import load_avg, write_json

HELDOUT = Path(__file__).resolve().parents[1] / "octavo" / "assets" / "heldout_english.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the default model (its GGUF)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs of both runs")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--speculative-model", help="a draft model instead of n-gram proposals")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from octavo import LLM, SamplingParams
    from octavo.assets.default_model import fetch

    model = args.model or str(fetch())
    words = HELDOUT.read_text().split()
    prompts = [" ".join(words[i * 60:(i + 1) * 60]) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    spec: dict[str, Any] = {"num_speculative_tokens": args.num_speculative_tokens, "speculative_adaptive": False}
    if args.speculative_model:
        spec["speculative_model"] = args.speculative_model
    else:
        spec["speculative_method"] = "ngram"

    def run(**extra: Any) -> list[list[int]]:
        llm = LLM(model, dtype=args.dtype, max_num_seqs=args.batch, **extra)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    plain, speculative = run(), run(**spec)
    same = sum(a == b for p, s in zip(plain, speculative) for a, b in zip(p, s))
    first = [next((i for i, (a, b) in enumerate(zip(p, s)) if a != b), len(p)) for p, s in zip(plain, speculative)]
    result = {"model": model, "args": vars(args), "token_agreement": same / sum(map(len, plain)),
              "identical_sequences": sum(p == s for p, s in zip(plain, speculative)), "first_divergence": first,
              "load": load_avg()}
    print(f"token agreement {result['token_agreement']:.3f}; identical sequences {result['identical_sequences']}/16; "
          f"first divergences {first}; load {result['load']}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
