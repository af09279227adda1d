"""The ranking of a draft model's tokens behind its cut LM head (``speculative_draft_vocab``): counted over
texts, written beside the weights, read back as the most used ids, and refused, naming the option or the
file's field, when it is missing or malformed or asks for more tokens than the vocabulary holds."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from octavo.config import SpeculativeConfig
from octavo.spec_decode.draft_vocab import RANKS_FILE, count_tokens, head_tokens, write_ranks


def test_counted_ranks_give_the_most_used_tokens(tmp_path):
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randrange(5, 40))) for _ in range(30)]
    encode = lambda text: [ord(c) - ord("a") for c in text]  # noqa: E731  (one token per letter)
    counts = count_tokens(encode, texts, 10)
    seen = Counter(encode("".join(texts)))
    assert counts == [seen[t] for t in range(10)]
    assert head_tokens(str(tmp_path), None, 10) is None  # no ranking: the whole head
    write_ranks(tmp_path, counts, "random letters")
    most = sorted(range(10), key=lambda t: (-seen[t], t))
    assert head_tokens(str(tmp_path), 5, 10) == sorted(most[:5])
    assert head_tokens(str(tmp_path), None, 10) is None  # no head size named: the whole head
    assert head_tokens(str(tmp_path), 0, 10) is None
    write_ranks(tmp_path, counts, "random letters", head_size=3)
    assert head_tokens(str(tmp_path), None, 10) == sorted(most[:3])  # the size the file names
    assert head_tokens(str(tmp_path), 6, 10) == sorted(most[:6])
    assert head_tokens(str(tmp_path), 0, 10) is None


def test_refusals_name_the_option_or_the_field(tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_vocab needs .*token_ranks.json"):
        head_tokens(str(tmp_path), 4, 10)
    write_ranks(tmp_path, list(range(10)), "counts")
    with pytest.raises(ValueError, match="speculative_draft_vocab 11 is more than .* 10 tokens"):
        head_tokens(str(tmp_path), 11, 10)
    for bad in ({"token_ids": [1, 2]}, {"token_ids": [1, 1, 2]}, {"token_ids": [1, 2, 99]}, [1, 2, 3]):
        (tmp_path / RANKS_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="token_ids"):
            head_tokens(str(tmp_path), 3, 10)
    for size in (0, 11, "many"):
        (tmp_path / RANKS_FILE).write_text(json.dumps({"head_size": size, "token_ids": list(range(10))}))
        with pytest.raises(ValueError, match="head_size"):
            head_tokens(str(tmp_path), None, 10)
    with pytest.raises(ValueError, match="speculative_draft_vocab must be >= 0"):
        SpeculativeConfig(speculative_model=str(tmp_path), speculative_draft_vocab=-1)
