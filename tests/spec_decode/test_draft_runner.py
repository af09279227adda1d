"""The draft runner alone, driven by hand: its greedy proposals are the draft
model's own greedy continuation (as the plain engine computes it) after any
history of accepted and rejected proposals, whatever the block size and
however little of the context the target's blocks cover."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import CacheConfig, ModelConfig, SpeculativeConfig
from octavo.core.step_state import CachedRequestState, ScheduledRow
from octavo.model.config import load_arch_config
from octavo.spec_decode.draft_model import DraftModelProposer
from octavo.spec_decode.draft_vocab import write_ranks
from octavo.spec_decode.proposer import ProposalInput, ProposerContext
from octavo.worker.draft_host import DraftHost
from tests.model_factory import make_tiny_model
from tests.spec_decode.draft_models import small_draft

K = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-runner")
    return make_tiny_model(root, "llama"), small_draft(root)


@pytest.fixture(scope="module")
def reference(models):
    """The draft model's greedy continuation of a context, by the plain engine."""
    llm = LLM(str(models[1]), dtype="float32", num_blocks=256)

    def continuation(tokens: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate([tokens], params, use_tqdm=False)[0].outputs[0].token_ids)

    return continuation


def build_draft(spec: SpeculativeConfig, config: ModelConfig, cache: CacheConfig,
                num_blocks: int = 1024) -> DraftModelProposer:
    """The proposer as the model runner builds it: the worker's host loads the
    model and allocates its cache once the pool is sized."""
    host = DraftHost(config, cache, 512)
    context = ProposerContext(config, cache, torch.device(config.device), 512, load_arch_config(config.model), host,
                              max_num_batched_tokens=2048)
    proposer = DraftModelProposer(spec, context)
    host.allocate(num_blocks, 8 * (K + 1), 512)
    return proposer


def make_draft(models, block_size: int) -> DraftModelProposer:
    target, draft = models
    config = ModelConfig(model=str(target), dtype="float32")
    spec = SpeculativeConfig(speculative_model=str(draft), num_speculative_tokens=K)
    return build_draft(spec, config, CacheConfig(block_size=block_size))


def propose(runner: DraftModelProposer, rows: list[ProposalInput]) -> dict[str, list[int]]:
    return {row.request_id: p.token_ids for row, p in zip(rows, runner.propose(rows)) if p.token_ids}


class _Target:
    """A stand-in for the target's side of one request: its tokens as the
    worker holds them and the blocks the scheduler gave it: those of the
    positions the step computed, plus ``lookahead`` slots for the draft."""

    def __init__(self, rid: str, prompt: list[int], block_size: int, first_block: int, params: SamplingParams,
                 lookahead: int = K):
        self.state = CachedRequestState(rid, list(prompt), [], params, None, block_tables=[[]])
        self.block_size, self.next_block, self.lookahead = block_size, first_block, lookahead
        self.computed = 0

    def _blocks_for(self, positions: int) -> None:
        need = -(-(positions + self.lookahead) // self.block_size)
        while len(self.state.block_ids) < need:
            self.state.block_ids.append(self.next_block)
            self.next_block += 1

    def chunk(self, n: int) -> ProposalInput:
        """A prompt chunk of n tokens, no sample."""
        start, self.computed = self.computed, self.computed + n
        self._blocks_for(self.computed)
        return ProposalInput(self.state, start, n, [], 0)

    def sampled(self, new: list[int], computed_now: int, max_proposals: int = K) -> ProposalInput:
        """The step computed positions up to ``computed_now`` and emitted ``new``."""
        start, self.computed = self.computed, computed_now
        self._blocks_for(computed_now)
        return ProposalInput(self.state, start, computed_now - start, new, max_proposals)

    def accept(self, new: list[int]) -> None:
        self.state.extend(new)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_proposals_are_the_drafts_continuation(models, reference, block_size):
    runner = make_draft(models, block_size)
    rng = random.Random(block_size)
    prompt = [rng.randrange(5, 512) for _ in range(37)]
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    req = _Target("a", prompt, block_size, 0, greedy)
    # Prefill in chunks of 16: the draft computes them along; no proposals yet.
    assert not propose(runner, [req.chunk(16)])
    assert not propose(runner, [req.chunk(16)])
    step = req.sampled([rng.randrange(5, 512)], len(prompt))
    history = prompt + step.new_token_ids
    proposals = propose(runner, [step])["a"]
    assert proposals == reference(history, K)
    req.accept(step.new_token_ids)
    # Accept none, some, all (with a bonus token), then one again: each time
    # the target computed its last token and the proposals (up to the first
    # rejected one); the draft must catch up on exactly what was accepted.
    for accepted in (0, 2, K, 1, K, K, 3):
        bonus = rng.choice([t for t in range(5, 512) if t not in proposals])
        new = proposals[:accepted] + [bonus]
        step = req.sampled(new, len(history) + accepted)
        history = history + new
        proposals = propose(runner, [step])["a"]
        assert proposals == reference(history, K), f"after accepting {accepted}"
        req.accept(new)


def test_batch_of_requests_at_different_stages(models, reference):
    """Prefill chunks, first proposals and later proposals in one forward."""
    runner = make_draft(models, 16)
    rng = random.Random(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    reqs = [_Target(str(i), [rng.randrange(5, 512) for _ in range(n)], 16, 50 * i, greedy)
            for i, n in enumerate((5, 40, 17))]
    propose(runner, [reqs[1].chunk(16)])
    inputs = [reqs[0].sampled([9], 5), reqs[1].chunk(16), reqs[2].sampled([11], 17)]
    out = propose(runner, inputs)
    assert set(out) == {"0", "2"}
    for r, inp in ((reqs[0], inputs[0]), (reqs[2], inputs[2])):
        assert out[r.state.request_id] == reference(r.state.all_token_ids + inp.new_token_ids, K)
        r.accept(inp.new_token_ids)


def test_proposals_stop_at_max_proposals_and_the_blocks(models, reference):
    runner = make_draft(models, 4)
    req = _Target("m", [7] * 10, 4, 0, SamplingParams(temperature=0.0))
    assert propose(runner, [req.sampled([8], 10, max_proposals=1)])["m"] == reference([7] * 10 + [8], 1)
    # No lookahead slots: the blocks end at position 11 (3 blocks of 4), so the
    # draft may feed the new token (position 10) and one guess (11): 2 proposals.
    short = _Target("s", [7] * 10, 4, 40, SamplingParams(temperature=0.0), lookahead=0)
    assert propose(runner, [short.sampled([8], 10)])["s"] == reference([7] * 10 + [8], 2)


def test_random_proposals_come_with_their_distributions(models):
    runner = make_draft(models, 16)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=5, max_tokens=100)

    def run() -> tuple[list[int], torch.Tensor]:
        runner.remove_requests({"r"})
        req = _Target("r", list(range(20, 45)), 16, 0, params)
        (out,) = runner.propose([req.sampled([50], 25)])
        return out.token_ids, out.probs

    tokens, q = run()
    assert q.shape == (K, 512)
    torch.testing.assert_close(q.sum(dim=-1), torch.ones(K))
    assert all(q[i, t] > 0 for i, t in enumerate(tokens))
    assert (q > 0).sum(dim=-1).max() <= 50  # top-k applied
    tokens_again, q_again = run()
    assert tokens_again == tokens  # the request's own seed
    torch.testing.assert_close(q_again, q)


def test_incompatible_draft_is_refused(tmp_path):
    target = make_tiny_model(tmp_path, "llama")
    other = make_tiny_model(tmp_path, "llama", vocab_size=384)
    with pytest.raises(ValueError, match="speculative_model"):
        build_draft(SpeculativeConfig(speculative_model=str(other)), ModelConfig(model=str(target)), CacheConfig())


def _draft_logits(hosted) -> list[torch.Tensor]:
    """Every row's logits of two requests' prompts (prefill rows: eager), then of decode-shaped steps: a
    catch-up's 1-2 rows per request and single-token proposal steps (recorded, each size on its second use)."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0)
    states = [CachedRequestState(f"r{i}", [rng.randrange(5, 512) for _ in range(n)], [], params, None,
                                 block_tables=[list(range(16 * i, 16 * i + 16))]) for i, n in enumerate((21, 9))]
    steps = [[(s, 0, s.num_tokens) for s in states]]
    for rows in ((2, 1), (1, 1), (2, 2), (1, 2), (1, 1), (2, 1)):
        step = []
        for s, n in zip(states, rows):
            start = s.num_tokens
            s.extend([rng.randrange(5, 512) for _ in range(n)])
            step.append((s, start, n))
        steps.append(step)
    with torch.inference_mode():  # as the proposer runs them
        return [hosted.run_rows(rows, rows)
                for rows in ([ScheduledRow(s, start, n, s.block_tables, True) for s, start, n in step]
                             for step in steps)]


def _hosted_draft(target, draft, dtype: str = "float32", enforce_eager: bool = False, head=None):
    host = DraftHost(ModelConfig(model=str(target), dtype=dtype, enforce_eager=enforce_eager),
                     CacheConfig(block_size=4), 512)
    hosted = host.load_draft_model(str(draft), head)
    host.allocate(64, 8, 512)
    return hosted


def test_recorded_draft_steps_give_the_eager_steps_logits(models):
    """The draft's decode-shaped forwards replay kernel tapes, each size recorded on its second use; every one
    gives the logits the same forward gives eagerly (``enforce_eager``), and a prompt chunk stays eager."""
    recorded, eager = (_hosted_draft(*models, enforce_eager=e) for e in (False, True))
    assert eager.graphs is None
    for mine, theirs in zip(_draft_logits(recorded), _draft_logits(eager)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert recorded.graphs.recorded_sizes == [2, 4]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cut_head_scores_its_tokens_as_the_whole_head(models, dtype):
    """A draft LM head cut to some tokens (``speculative_draft_vocab``) gives, through prefill and recorded
    decode steps alike, the logits the whole head gives those tokens."""
    tokens = sorted(random.Random(1).sample(range(512), 96))
    whole, cut = (_hosted_draft(*models, dtype=dtype, head=head) for head in (None, tokens))
    for all_tokens, mine in zip(_draft_logits(whole), _draft_logits(cut)):
        assert mine.shape == (all_tokens.shape[0], len(tokens))
        torch.testing.assert_close(mine, all_tokens[:, tokens])
    assert cut.graphs.recorded_sizes == [2, 4]


def test_cut_head_proposals_come_from_its_tokens(models, reference, tmp_path):
    """Greedy proposals with a cut head are the whole draft's while its choice is among the kept tokens; random
    ones draw from the kept tokens, q zero elsewhere."""
    target, draft = models
    folder = tmp_path / "draft"
    shutil.copytree(draft, folder)
    rng = random.Random(4)
    counts = [rng.randrange(1000) for _ in range(512)]
    write_ranks(folder, counts, "random counts")
    size = 256
    kept = set(sorted(range(512), key=lambda t: (-counts[t], t))[:size])
    config = ModelConfig(model=str(target), dtype="float32")
    spec = SpeculativeConfig(speculative_model=str(folder), num_speculative_tokens=K, speculative_draft_vocab=size)
    runner = build_draft(spec, config, CacheConfig(block_size=16))
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    cut_short = 0
    for i in range(8):
        prompt = [rng.randrange(5, 512) for _ in range(20 + i)]
        new = [rng.randrange(5, 512)]
        req = _Target(f"g{i}", prompt, 16, 8 * i, greedy)
        (out,) = runner.propose([req.sampled(new, len(prompt))])
        assert set(out.token_ids) <= kept
        # The whole draft's continuation, as far as its tokens are kept; then the cut head's own choice.
        for mine, whole in zip(out.token_ids, reference(prompt + new, K)):
            if whole not in kept:
                cut_short += 1
                break
            assert mine == whole
    assert cut_short  # some choice of the whole head lay outside the kept tokens
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100)
    req = _Target("r", list(range(20, 45)), 16, 100, params)
    (out,) = runner.propose([req.sampled([50], 25)])
    assert set(out.token_ids) <= kept
    assert out.probs.shape == (K, 512)
    torch.testing.assert_close(out.probs.sum(dim=-1), torch.ones(K))
    outside = torch.tensor(sorted(set(range(512)) - kept))
    assert not out.probs[:, outside].any()
