"""The structured-output seam: a backend registered from outside Octavo is the
one the engine compiles with, masks with and advances, with and without
speculative proposals to verify."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH
from octavo.core.structured_output import StructuredOutputBackend, StructuredOutputGrammar
from octavo.sample.structured_registry import (
    DEFAULT_BACKEND,
    register_structured_output_backend,
    use_structured_output_backend,
)
from octavo.sampling_params import StructuredOutputParams

LENGTH = 6  # tokens the test grammar takes before only EOS may follow
WORDS = [" one", " two", " three"]


class FixedTokensGrammar(StructuredOutputGrammar):
    """Any ``LENGTH`` tokens of a fixed set, then EOS."""

    def __init__(self, allowed: set[int], eos: list[int], vocab_size: int) -> None:
        self.allowed, self.eos, self.vocab_size = allowed, eos, vocab_size
        self.tokens: list[int] = []
        self.failed = False

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for token in token_ids:
            if self.is_terminated() or token not in self.allowed:
                self.failed = True
                return False
            self.tokens.append(token)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        room = 0 if self.is_terminated() else LENGTH - len(self.tokens)
        valid = 0
        for token in token_ids[:room]:
            if token not in self.allowed:
                break
            valid += 1
        return valid

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = np.zeros(bitmask.shape[1], dtype=np.uint32)
        for token in self.eos if self.is_terminated() else self.allowed:
            words[token // 32] |= np.uint32(1 << (token % 32))
        bitmask[row] = torch.from_numpy(words.view(np.int32))

    def is_terminated(self) -> bool:
        return self.failed or len(self.tokens) >= LENGTH

    def reset(self) -> None:
        self.tokens, self.failed = [], False


class FixedTokensBackend(StructuredOutputBackend):
    """Allows the tokens of ``WORDS`` whatever the request's constraint says."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.allowed = {t for w in WORDS for t in tokenizer.encode(w, add_special_tokens=False)}
        self.eos, self.vocab_size = eos_token_ids, max(vocab_size, tokenizer.vocab_size)
        self.compiled = 0

    def compile(self, spec: StructuredOutputParams) -> FixedTokensGrammar:
        self.compiled += 1
        return FixedTokensGrammar(self.allowed, self.eos, self.vocab_size)


@pytest.fixture
def fixed_tokens_backend():
    built: list[FixedTokensBackend] = []

    def factory(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> FixedTokensBackend:
        built.append(FixedTokensBackend(tokenizer, vocab_size, eos_token_ids))
        return built[-1]

    register_structured_output_backend("fixed-tokens", factory)
    use_structured_output_backend("fixed-tokens")
    yield built
    use_structured_output_backend(DEFAULT_BACKEND)


@pytest.mark.parametrize("speculative", [{}, dict(speculative_method="ngram", num_speculative_tokens=3,
                                                  speculative_adaptive=False)])
def test_a_registered_backend_constrains_the_output(fixed_tokens_backend, speculative):
    llm = LLM(str(MINI_MODEL_PATH), dtype="float32", num_blocks=64, **speculative)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2,
                            structured_outputs=StructuredOutputParams(regex="ignored by this backend"))
    outputs = llm.generate(["Count with me:", "def f(x):"], params, use_tqdm=False)
    (backend,) = fixed_tokens_backend
    assert backend.compiled == 4  # one grammar per sequence
    for out in outputs:
        for seq in out.outputs:
            assert seq.finish_reason == "stop"
            assert len(seq.token_ids) <= LENGTH + 1  # its tokens, then EOS
            assert set(seq.token_ids[:LENGTH]) <= backend.allowed, seq.text
