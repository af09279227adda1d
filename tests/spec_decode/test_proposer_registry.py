"""The proposer seam: a proposer registered from outside Octavo under its own
speculative_method is built by the model runner and verified by the engine
like the built-in ones."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH
from octavo.config import SpeculativeConfig
from octavo.spec_decode.proposer import Proposal, ProposalInput, Proposer, ProposerContext
from octavo.spec_decode.registry import register_proposer

PROMPTS = ["The cat sat on the mat. The cat sat on the", "def add(a, b):\n    return"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class RepeatLastProposer(Proposer):
    """Guesses that the last token repeats: cheap, often wrong, never harmful."""

    def __init__(self) -> None:
        self.proposed = 0

    def propose(self, rows: list[ProposalInput]) -> list[Proposal]:
        out = []
        for row in rows:
            guess = [row.new_token_ids[-1]] * row.max_proposals if row.new_token_ids else []
            self.proposed += len(guess)
            out.append(Proposal(guess))
        return out


@pytest.fixture
def repeat_last():
    built: list[RepeatLastProposer] = []

    def factory(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
        built.append(RepeatLastProposer())
        return built[-1]

    register_proposer("repeat-last", factory)  # a name of this test's own: left registered
    return built


def _generate(**speculative: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(MINI_MODEL_PATH), dtype="float32", num_blocks=64, **speculative)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_a_registered_proposer_runs_through_the_engine(repeat_last):
    plain, _ = _generate()
    speculated, llm = _generate(speculative_method="repeat-last", num_speculative_tokens=3,
                                speculative_adaptive=False)
    (proposer,) = repeat_last
    assert proposer.proposed > 0
    assert llm.engine.get_stats().spec_num_drafts > 0  # the scheduler had them verified
    assert speculated == plain  # greedy verification keeps the target's own tokens


def test_an_unregistered_method_is_refused():
    with pytest.raises(ValueError, match="no proposer"):
        LLM(str(MINI_MODEL_PATH), dtype="float32", num_blocks=64, speculative_method="no-such-method")
