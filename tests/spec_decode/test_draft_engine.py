"""The draft-model proposer inside the engine: greedy output token-identical
to decoding without speculation, for every architecture and every batching
path (block sizes, chunked prefill, preemption, prefix caching, n=2); seeded
sampling reproduces; no KV block or per-request state is left behind."""
from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.assets import MINI_DRAFT_MODEL_PATH, MINI_MODEL_PATH
from octavo.spec_decode.draft_vocab import write_ranks
from tests.engine.conftest import ARCHS, assert_no_leak, random_prompts, shared_prefix_prompts
from tests.model_factory import make_tiny_model
from tests.spec_decode.draft_models import noisy_copy, small_draft

NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = random_prompts([1, 7, 16, 33, 70])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only adds overhead on shared cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """target arch -> (target folder, a draft that agrees often, a draft that rarely does)."""
    root = tmp_path_factory.mktemp("drafts")

    def make(arch: str):
        target = make_tiny_model(root, arch)
        return target, noisy_copy(target, root), small_draft(root)

    return make


def greedy_tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [list(c.token_ids) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def plain(folder, prompts, params=GREEDY, **kw) -> list[list[int]]:
    return greedy_tokens(LLM(folder, dtype="float32", **kw), prompts, params)


def speculative(folder, draft, prompts, params=GREEDY, k=3, **kw) -> tuple[list[list[int]], LLM]:
    # Always proposing: the adaptive choice is tested in test_draft_adaptive.py.
    llm = LLM(folder, dtype="float32", speculative_model=str(draft), num_speculative_tokens=k,
              speculative_adaptive=False, **kw)
    tokens = greedy_tokens(llm, prompts, params)
    assert_no_leak(llm)
    return tokens, llm


def acceptance(llm: LLM):
    return llm.engine.scheduler.spec_stats


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_for_every_architecture(drafts, arch):
    target, noisy, small = drafts(arch)
    expected = plain(target, PROMPTS)
    for draft in (noisy, small):
        tokens, llm = speculative(target, draft, PROMPTS)
        assert tokens == expected, f"draft {draft.name}"
    # The noisy copy is accepted often, partly: both paths of the verification run.
    stats = acceptance(llm if draft is noisy else speculative(target, noisy, PROMPTS)[1])
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(drafts, block_size):
    target, noisy, _ = drafts("qwen2")
    tokens, _ = speculative(target, noisy, PROMPTS, block_size=block_size)
    assert tokens == plain(target, PROMPTS, block_size=block_size)


# bfloat16 at batch 8 prefills whole prompts: under a shared token budget, speculation changes how prompts are
# chunked (a step's proposals take part of it), and a bf16 prefill rounds each chunking differently, as plain
# decoding does when other requests share its steps. "cut": the draft's LM head keeps only the tokens plain decoding
# wrote for half the prompts (speculative_draft_vocab), so some of its whole head's choices are never proposed.
@pytest.mark.parametrize(("dtype", "max_num_seqs", "budget", "head"),
                         [("float32", 1, 16, "whole"), ("float32", 8, 16, "whole"), ("bfloat16", 1, 16, "whole"),
                          ("bfloat16", 8, None, "whole"), ("float32", 8, 16, "cut"), ("bfloat16", 1, 16, "cut")])
def test_prefix_caching_and_chunked_prefill_through_recorded_steps(drafts, tmp_path, dtype, max_num_seqs, budget,
                                                                    head):
    """One request at a time and eight at once, prompts that hit the prefix cache and prefill in chunks of
    ``budget`` tokens: the target verifies and the draft proposes through recorded steps (kernel tapes), and
    greedy output is plain greedy decoding's, in bfloat16 too (verification rows are decode rows), with the
    draft's whole LM head or one cut to some tokens."""
    target, noisy, _ = drafts("llama")
    prompts = shared_prefix_prompts() + PROMPTS
    engine = dict(dtype=dtype, max_num_seqs=max_num_seqs, **({"max_num_batched_tokens": budget} if budget else {}))
    want = greedy_tokens(LLM(target, **engine), prompts)
    cut = {}
    if head == "cut":
        noisy = shutil.copytree(noisy, tmp_path / "draft")
        counts = Counter(t for tokens in want[::2] for t in tokens)
        write_ranks(noisy, [counts[t] for t in range(512)], "half the plain outputs")
        cut = {"speculative_draft_vocab": len(counts)}
    llm = LLM(target, speculative_model=str(noisy), num_speculative_tokens=3, speculative_adaptive=False, **cut,
              **engine)
    # The first request fills the prefix cache; the rest hit it.
    tokens = greedy_tokens(llm, prompts[:1]) + greedy_tokens(llm, prompts[1:])
    assert tokens == want
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_no_leak(llm)
    runner = llm.engine.executor.worker.runner
    assert runner._graphs.recorded_sizes and runner.proposer.model.graphs.recorded_sizes
    stats = acceptance(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_forced_preemption(drafts):
    target, noisy, _ = drafts("llama")
    prompts = random_prompts([20, 35, 50, 28, 41, 60])
    tokens, llm = speculative(target, noisy, prompts, num_blocks=14)
    assert llm.engine.get_stats().num_preemptions > 0
    assert tokens == plain(target, prompts)


def test_n_equals_2(drafts):
    target, noisy, _ = drafts("llama")
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=2)
    tokens, _ = speculative(target, noisy, PROMPTS[2:4], params)
    assert tokens == plain(target, PROMPTS[2:4], params)


def test_seeded_sampling_reproduces(drafts):
    target, noisy, _ = drafts("llama")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=NEW, ignore_eos=True)
    first, _ = speculative(target, noisy, PROMPTS[:3], params)
    again, _ = speculative(target, noisy, PROMPTS[:3], params)
    assert first == again
    # The same seeded request alone, without its batch mates, draws the same tokens.
    alone, _ = speculative(target, noisy, PROMPTS[1:2], params)
    assert alone[0] == first[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head", [None, 0], ids=["shipped-head", "whole-head"])
def test_octavo_mini_with_its_draft_on_the_golden_prompt(dtype, head):
    """The shipped pair: greedy output equals octavo-mini's alone, in its own
    bfloat16 too (verification rows are decode rows, so each verified
    position's logits are plain decoding's), with the draft's LM head cut to
    the 1024 tokens its ranking names (the default) or whole."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    base = LLM(str(MINI_MODEL_PATH), dtype=dtype)
    prompt = "def fibonacci(n):"
    expected = base.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(str(MINI_MODEL_PATH), dtype=dtype, speculative_model="octavo-mini-draft",
               speculative_adaptive=False, speculative_draft_vocab=head)
    out = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert acceptance(spec).num_accepted_tokens > 0
    assert_no_leak(spec)
    assert str(MINI_DRAFT_MODEL_PATH).endswith("octavo-mini-draft")
    runner = spec.engine.executor.worker.runner
    assert runner.proposer.model.model.lm_head.num_embeddings == (1024 if head is None else 8192)


@pytest.mark.parametrize("split", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
def test_ranks_with_a_draft_on_the_driver(drafts, split):
    """The draft runs whole on the driver rank only; the other ranks verify
    the proposals the step carries."""
    target, noisy, _ = drafts("llama")
    engine = dict(dtype="float32", block_size=4, num_blocks=128)
    want = greedy_tokens(LLM(target, **engine), PROMPTS[:3])
    llm = LLM(target, threads_per_worker=1, speculative_model=str(noisy), num_speculative_tokens=3,
              speculative_adaptive=False, **split, **engine)
    try:
        assert greedy_tokens(llm, PROMPTS[:3]) == want
        stats = llm.engine.get_stats()
        assert stats.spec_num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
