"""Quest sparse attention in the engine (block_size 16, tiny llama, prompts of 10-20 pages): reading every page
gives the dense engine's tokens and logprobs bit for bit (float32 and int8 caches, eager and with kernel tapes);
with a few pages the decodes read contexts cut to those pages, the bounds every layer chooses from are the
minimum and maximum of the keys its pages hold (through prefix-cache hits, whose outputs equal a cold run's, and
preemption), every block is back in the pool afterwards; decode steps replayed from kernel tapes generate what
eager ones do; bad options are refused naming the field."""
from __future__ import annotations

import random

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.attention.kv_quant import gather_blocks
from octavo.attention.quest import NativePageChoice
from tests.engine.conftest import assert_no_leak, random_prompts

BLOCK = 16
SPARSE = {"sparse_attention": "quest", "sparse_top_pages": 3, "sparse_recent_pages": 2}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def _run(llm: LLM, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, _greedy(n), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize(("kv", "eager"), [("auto", True), ("auto", False), ("int8", False)])
def test_reading_every_page_is_dense_bit_for_bit(folder, kv, eager):
    prompts = random_prompts([150, 97, 40], seed=7)  # up to 12 pages with the 32 tokens generated
    dense = LLM(folder, dtype="float32", block_size=BLOCK, kv_cache_dtype=kv, enforce_eager=eager)
    sparse = LLM(folder, dtype="float32", block_size=BLOCK, kv_cache_dtype=kv, sparse_attention="quest",
                 sparse_top_pages=11, sparse_recent_pages=1, enforce_eager=eager)
    assert _run(sparse, prompts, 32) == _run(dense, prompts, 32)
    if not eager:  # batches of 3, 2 (the 40-token prompt's row done) and 1 replayed
        assert sparse.engine.executor.worker.runner._graphs.recorded_sizes
    assert_no_leak(sparse)


def test_recorded_quest_steps_generate_what_eager_ones_do(folder):
    """Five long prompts stopping at different lengths: decode batches of 5 (padded to 8), 4, 3, 2 and 1, each
    recorded on its second step and replayed after, choosing 5 of 8-15 pages in every layer."""
    prompts = random_prompts([200, 150, 233, 130, 170], seed=3)
    params = [_greedy(n) for n in (3, 6, 9, 12, 20)]
    results = {}
    for eager in (False, True):
        llm = LLM(folder, dtype="float32", block_size=BLOCK, num_blocks=96, enforce_eager=eager, **SPARSE)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        if not eager:
            assert llm.engine.executor.worker.runner._graphs.recorded_sizes == [1, 2, 4, 8]
        assert_no_leak(llm)
    for (taped, taped_lp), (eager, eager_lp) in zip(results[False], results[True]):
        assert taped == eager
        # Padded batches may round their products differently from the unpadded eager ones.
        torch.testing.assert_close(taped_lp, eager_lp, rtol=0, atol=1e-4)


@pytest.fixture
def choices(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every layer's page choice in an eager engine, checked as it is made: the bounds of each page a decode
    row may read are the minimum and maximum of the keys stored there (the last page's written slots
    only), and no page left out has a higher bound than one chosen by it. Records each choice's
    (dense, cut) context lengths of its rows."""
    seen = []
    narrow = NativePageChoice.narrow

    def checked(self: NativePageChoice, q: torch.Tensor, cache, dense):
        out = narrow(self, q, cache, dense)
        keep = self.top_pages + self.recent_pages
        for row in range(dense.num_decodes):
            length = int(dense.decode_context_lens[row])
            pages = -(-length // BLOCK)
            ids = dense.decode_block_table[row, :pages]
            read = out.decode_block_table[row, : -(-int(out.decode_context_lens[row]) // BLOCK)].tolist()
            picked = {ids.tolist().index(b) for b in read}
            keys = gather_blocks(cache, 0, ids, torch.float32)[:length]
            starts = range(0, length, BLOCK)
            low = torch.stack([keys[s : s + BLOCK].amin(dim=0) for s in starts])
            high = torch.stack([keys[s : s + BLOCK].amax(dim=0) for s in starts])
            assert torch.equal(cache.key_bounds[:, ids, 0].transpose(0, 1).float(), low)
            assert torch.equal(cache.key_bounds[:, ids, 1].transpose(0, 1).float(), high)
            group = q.shape[1] // low.shape[1]
            lo, hi = low.repeat_interleave(group, dim=1), high.repeat_interleave(group, dim=1)
            qf = q[row].float()
            bound = torch.maximum(qf * lo, qf * hi).sum(dim=-1).amax(dim=-1)  # [pages]
            assert len(picked) == min(pages, keep)
            free = set(range(1, pages - self.recent_pages))  # neither the first nor a recent page
            assert set(range(pages)) - free <= picked
            left = free - picked
            if left:
                assert bound[sorted(picked & free)].min() >= bound[sorted(left)].max() - 1e-5
        rows = dense.num_decodes
        seen.append((dense.decode_context_lens[:rows].tolist(), out.decode_context_lens[:rows].tolist()))
        return out

    monkeypatch.setattr(NativePageChoice, "narrow", checked)
    return seen


def test_a_long_generation_reads_few_pages_and_frees_every_block(folder, choices):
    prompts = random_prompts([300, 260], seed=4)  # 19 and 17 pages, 23 and 20 by the end
    llm = LLM(folder, dtype="float32", block_size=BLOCK, enforce_eager=True, **SPARSE)
    outs = _run(llm, prompts, 60)
    assert [len(tokens) for tokens, _ in outs] == [60, 60]
    keep = SPARSE["sparse_top_pages"] + SPARSE["sparse_recent_pages"]
    assert len(choices) >= 2 * 59  # both layers, every decode step
    for dense, cut in choices:
        for full, read in zip(dense, cut):
            pages = -(-full // BLOCK)
            assert read == full - max(pages - keep, 0) * BLOCK and read <= keep * BLOCK
    assert_no_leak(llm)


def test_prefix_hits_and_preemption_keep_the_bounds(folder, choices):
    """Four prompts sharing 256 tokens (16 full blocks): the later three hit the first's blocks, bounds and
    all, and generate the tokens a run without the prefix cache does. A pool too small for all four
    preempts and recomputes, the bounds following (the fixture checks them at every choice); its tokens may
    differ from an uninterrupted run's: a recompute prefills the generated tokens densely, where decoding
    them first read chosen pages only."""
    rng = random.Random(8)
    prefix = [rng.randrange(5, 512) for _ in range(256)]
    prompts = [prefix + [rng.randrange(5, 512) for _ in range(n)] for n in (20, 35, 9, 50)]
    cold = LLM(folder, dtype="float32", block_size=BLOCK, enable_prefix_caching=False, enforce_eager=True, **SPARSE)
    want = [tokens for tokens, _ in _run(cold, prompts, 40)]
    cached = LLM(folder, dtype="float32", block_size=BLOCK, enforce_eager=True, **SPARSE)
    first = _run(cached, prompts[:1], 40)
    rest = cached.generate(prompts[1:], _greedy(40), use_tqdm=False)
    assert [first[0][0]] + [o.outputs[0].token_ids for o in rest] == want
    assert all(o.num_cached_tokens >= 256 for o in rest)
    tight = LLM(folder, dtype="float32", block_size=BLOCK, num_blocks=40, enable_prefix_caching=False,
                enforce_eager=True, **SPARSE)
    assert [len(tokens) for tokens, _ in _run(tight, prompts, 40)] == [40] * 4
    assert tight.engine.get_stats().num_preemptions > 0
    for llm in (cold, cached, tight):
        assert_no_leak(llm)


def test_bad_options_name_the_field(folder, model_dir):
    with pytest.raises(ValueError, match="sparse_attention must be one of quest or unset; got 'dense'"):
        LLM(folder, sparse_attention="dense")
    for name in ("sparse_top_pages", "sparse_recent_pages"):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1, got 0"):
            LLM(folder, sparse_attention="quest", **{name: 0})
    with pytest.raises(ValueError, match="attention_backend native .* got 'torch'"):
        LLM(folder, sparse_attention="quest", attention_backend="torch")
    with pytest.raises(ValueError, match="sparse_attention 'quest' decodes one token per step"):
        LLM(folder, sparse_attention="quest", speculative_method="ngram")
    with pytest.raises(ValueError, match="every layer of this model attends within a sliding window"):
        LLM(model_dir("mistral"), sparse_attention="quest")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLM(model_dir("deepseek_v2"), sparse_attention="quest")


def test_the_command_line_refuses_bad_sparse_options(capsys, folder):
    from octavo.entrypoints.cli import build_parser, main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(folder), "--sparse-attention", "dense"])
    assert "--sparse-attention: invalid choice: 'dense'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["generate", str(folder), "--prompt", "x", "--sparse-attention", "quest", "--sparse-top-pages", "0"])
    assert "octavo: error: sparse_top_pages must be an integer >= 1, got 0" in capsys.readouterr().err
