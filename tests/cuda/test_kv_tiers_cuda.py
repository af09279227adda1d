"""KV tiers over a CUDA pool: blocks go to pinned host memory and to disk and
come back with transformers' greedy tokens."""
from __future__ import annotations

from octavo import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_prefixes_evicted_from_a_cuda_pool_come_back_from_host_and_disk(model_dir, tmp_path):
    folder = model_dir("llama")
    prompts = random_prompts([70, 75, 66, 80], seed=3)
    llm = LLM(folder, device="cuda", dtype="float32", num_blocks=8, kv_offload_host_bytes=6 * 8192,
              kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=140_000)
    assert llm.engine.executor.worker.runner.kv_tiers._host.is_pinned()
    first = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    again = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[::-1]][::-1]
    want = hf_greedy(folder, prompts, GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    hits = llm.engine.get_stats().kv_offload_hits
    assert hits["cpu"] > 0 and hits["disk"] > 0
