"""KV tiers at tensor-parallel size 2: each rank keeps its shard of every
block (one file per rank and block), the engine's output over a pool too
small for its prefixes equals the same engine's without any cache, and a
restart on the folder hits what both ranks wrote."""
from __future__ import annotations

from octavo import LLM, SamplingParams
from octavo.kv_offload.block_file import SUFFIX
from tests.engine.conftest import random_prompts
from tests.model_factory import make_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([70, 75, 66], seed=4)  # 4 full blocks each; the pool holds 8
ENGINE = dict(dtype="float32", tensor_parallel_size=2, threads_per_worker=1)


def _texts(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_two_ranks_offload_reload_and_restart_on_one_folder(tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    kv = tmp_path / "kv"
    plain = LLM(folder, enable_prefix_caching=False, **ENGINE)
    want = _texts(plain, PROMPTS)
    plain.shutdown()
    tiers = dict(num_blocks=8, kv_offload_host_bytes=2**20, kv_offload_dir=str(kv), **ENGINE)
    llm = LLM(folder, **tiers)
    assert _texts(llm, PROMPTS + PROMPTS[:1]) == want + want[:1]
    stats = llm.engine.get_stats()
    assert stats.kv_offload_hits["cpu"] == 64 and stats.num_free_blocks == stats.num_total_blocks
    llm.shutdown()
    files = [f.name for f in kv.glob(f"*{SUFFIX}")]
    by_block: dict[str, set[str]] = {}
    for name in files:
        block, rank_tag, _ = name.split(".")
        by_block.setdefault(block, set()).add(rank_tag)
    assert by_block and all(len(tags) == 2 for tags in by_block.values())  # both ranks' shards of each
    again = LLM(folder, **tiers)
    outs = [again.generate([p], PARAMS, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [64] * 3
    assert again.engine.get_stats().kv_offload_hits["disk"] == 3 * 64
    again.shutdown()
