"""The shipped octavo-mini under on-the-fly quantization keeps its held-out
perplexity: int8 within 1% and int4 (default groups of 128) within 10% of
bf16, all three measured by the Octavo engine the same way (the numbers are
in octavo/assets/MODEL_CARD.md)."""
from __future__ import annotations

import math
from typing import Optional

import pytest

from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH, HELDOUT_SAMPLE_PATH

# The model's context is 512: a window of 511 prompt tokens leaves room for the one drawn.
WINDOW = 511


def engine_perplexity(quantization: Optional[str]) -> float:
    """exp(mean NLL) of heldout_sample.txt in non-overlapping windows, every
    token but each window's first predicted once, from prompt logprobs."""
    llm = LLM(MINI_MODEL_PATH, dtype="bfloat16", quantization=quantization, num_blocks=160)
    try:
        ids = llm.get_tokenizer().encode(HELDOUT_SAMPLE_PATH.read_text(encoding="utf-8"), add_special_tokens=False)
        windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - 1, WINDOW)]
        windows = [w for w in windows if len(w) > 1]
        outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    nll = [-entry.logprob for out in outs for entry in out.prompt_logprobs[1:]]
    assert len(nll) == sum(len(w) - 1 for w in windows)
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def bf16_perplexity() -> float:
    return engine_perplexity(None)


@pytest.mark.parametrize("quantization, factor", [("int8", 1.01), ("int4", 1.10)])
def test_quantized_heldout_perplexity_stays_near_bf16(quantization, factor, bf16_perplexity):
    ppl = engine_perplexity(quantization)
    assert ppl <= bf16_perplexity * factor, f"{quantization}: {ppl:.2f} vs bf16 {bf16_perplexity:.2f}"
