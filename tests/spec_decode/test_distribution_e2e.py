"""Random sampling through the whole engine keeps its distribution under
speculation: the joint distribution of the first three tokens with n-gram
proposals is the one without (a chi-square test of homogeneity), with
temperature, top-k, logit_bias and a token restriction applied at every
verified position. (With the temperature left out at the verified positions
the statistic comes out several times the critical value.)"""
from __future__ import annotations

import math
from collections import Counter

from octavo import LLM, SamplingParams

TOKENS = [7, 8, 9, 10]
N = 2000


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09), by
    the Wilson-Hilferty approximation (within 1% for df >= 5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def sample(folder, **spec) -> Counter:
    llm = LLM(folder, dtype="float32", max_num_seqs=256, num_blocks=1024, block_size=4, seed=11, **spec)
    # The bias spreads the tokens' odds: a wrong temperature or filter at a
    # verified position then changes the distribution visibly.
    params = SamplingParams(temperature=0.6, top_k=3, allowed_token_ids=TOKENS, logit_bias={7: 1.5, 9: -1.0},
                            max_tokens=3, ignore_eos=True)
    # The prompt repeats the allowed tokens, so lookup always has a guess.
    outs = llm.generate([TOKENS * 4] * N, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    return Counter(tuple(o.outputs[0].token_ids) for o in outs), stats


def test_joint_distribution_of_three_tokens_is_unchanged(model_dir):
    folder = model_dir("llama")
    plain, _ = sample(folder)
    spec, stats = sample(folder, speculative_method="ngram", num_speculative_tokens=2, speculative_adaptive=False)
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    cells = set(plain) | set(spec)
    chi2 = 0.0
    for cell in cells:
        a, b = plain[cell], spec[cell]
        expected = (a + b) / 2  # equal sample sizes
        chi2 += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    # top_k 3 of the 4 allowed tokens: at most 27 cells.
    assert chi2 < chi2_critical(len(cells) - 1), (chi2, len(cells))
