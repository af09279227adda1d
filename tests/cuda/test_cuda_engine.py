"""The engine on CUDA gives transformers' greedy tokens: Triton paged decode, SDPA prefill, decode steps eager
and replayed from CUDA graphs, float and quantized KV caches; and the graphs' padded rows leak nothing."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.engine.conftest import ARCHS, NEW_TOKENS, PROMPT_LENGTHS, hf_greedy, random_prompts, shared_prefix_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run(folder, prompts, **engine_kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", **engine_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(model_dir, arch, enforce_eager):
    folder = model_dir(arch)
    prompts = random_prompts(PROMPT_LENGTHS)
    tokens, llm = run(folder, prompts, enforce_eager=enforce_eager)
    runner = llm.engine.executor.worker.runner
    assert (runner._graphs is None) == enforce_eager  # graphs were captured (not silently dropped) when asked
    assert tokens == hf_greedy(folder, prompts)


def test_auto_picks_the_triton_backend_on_cuda(model_dir):
    _, llm = run(model_dir("llama"), random_prompts([5]))
    runner = llm.engine.executor.worker.runner
    assert runner.backends.attention.name == "triton"


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes_and_chunked_prefill(model_dir, block_size):
    folder = model_dir("qwen2")
    prompts = random_prompts(PROMPT_LENGTHS[:6])
    tokens, _ = run(folder, prompts, block_size=block_size, max_num_batched_tokens=32)
    assert tokens == hf_greedy(folder, prompts)


def test_prefix_cache_hits_on_cuda(model_dir):
    folder = model_dir("llama")
    prompts = shared_prefix_prompts()
    llm = LLM(folder, device="cuda", dtype="float32", enable_prefix_caching=True)
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(folder, prompts)
    assert llm.engine.get_stats().prefix_cache_hits > 0


def test_bfloat16_and_int8_kv_cache_stay_close(model_dir):
    """bf16 weights and an int8 cache change roundings, not the model: most greedy tokens agree."""
    folder = model_dir("llama")
    prompts = random_prompts(PROMPT_LENGTHS[:5])
    want = hf_greedy(folder, prompts)
    for kwargs in ({"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"}):
        llm = LLM(folder, device="cuda", **{"dtype": "float32", **kwargs})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
        assert agree > 0.8, (kwargs, agree)
        del llm
        torch.cuda.empty_cache()


def test_w8a8_torch_path_on_cuda_gives_the_cpu_kernels_bits():
    """On CUDA W8A8 runs its torch path (octavo/quant/w8a8.py): integer-exact products and elementwise divisions,
    so the same bits as the native CPU kernel."""
    from octavo.quant.w8a8 import W8A8Weight

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (96, 1100), generator=gen, dtype=torch.int8)
    scale = torch.rand(96, generator=gen) * 0.02
    x = torch.randn(17, 1100, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    cpu, cuda = W8A8Weight(q, scale), W8A8Weight(q.cuda(), scale.cuda())
    assert cpu.kernel is not None and cuda.kernel is None
    assert torch.equal(cuda(x.cuda(), bias.cuda()).cpu(), cpu(x, bias))
