"""The KV tiers below the pool for models with sliding-window layers: Mistral (every layer slides: one
window group) and Gemma 2 (sliding and global layers: window groups and a full one), windows of 32 and
prompts of 200+. Every group's blocks go down as the pool evicts them, and a returning prefix loads back
what each group reads: a full group every block of it, a window group only the last window's. Outputs
equal transformers' greedy tokens, the hits come from the tiers, an engine restarted on the folder hits
the files of the one before, and nothing is left behind in the pool or on disk beyond what the index names."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.core.prefix_hash import extend_block_hashes
from tests.engine.conftest import (assert_folder_matches_the_tiers, assert_no_leak, hf_greedy, one_by_one,
                                   random_prompts)
from tests.model_factory import make_tiny_model

BLOCK, WINDOW = 8, 32
MODELS = ("gemma2", "mistral")
GROUPS = {"gemma2": 3, "mistral": 1}  # Gemma 2's layers 0 and 2 slide, layer 1 does not: a group each
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([210, 226, 203, 219], seed=7)  # 26, 28, 25 and 27 full blocks before the last token
# A block of either model is 4 KiB (float32, 2 KV heads; Mistral: 2 layers of head 16 in its one group,
# Gemma 2: a layer of head 32 in each of its three groups). 64 tokens a step: a window group releases
# blocks as a prompt's chunks go by, so the pool need not hold a whole prompt per group.
OPTIONS = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), name, sliding_window=WINDOW)
        return made[name]

    return get


def _hit_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def _needed(windows: tuple, prompt: list[int]) -> set[tuple[int, int]]:
    """(group, block) of what a prompt's whole hit reads: every block in a full group, in a window group
    those holding the positions the first query after the hit sees (from ``hit - WINDOW + 1`` on)."""
    hit = _hit_tokens(prompt)
    return {(g, i) for g, window in enumerate(windows) for i in range(hit // BLOCK)
            if window is None or i >= (hit - window + 1) // BLOCK}


@pytest.mark.parametrize("name", MODELS)
def test_evicted_prefixes_come_back_from_host_and_disk_with_transformers_output(model, name, tmp_path):
    folder = model(name)
    groups = GROUPS[name]
    # A pool of 30 blocks per group (a prompt is admitted if the pool could hold all of it): of the 4
    # prompts' 26-29 per group, the last one's and a few more stay.
    llm = LLM(folder, num_blocks=30 * groups, kv_offload_host_bytes=12 * groups * 4096,
              kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=2_000_000, **OPTIONS)
    first = one_by_one(llm, PROMPTS, PARAMS)
    again = one_by_one(llm, PROMPTS[::-1], PARAMS)[::-1]
    want = hf_greedy(folder, PROMPTS, PARAMS.max_tokens)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0]
    assert [o.num_cached_tokens for o in again] == [_hit_tokens(p) for p in PROMPTS]
    stats = llm.engine.get_stats()
    assert stats.kv_offload_hits["cpu"] > 0 and stats.kv_offload_hits["disk"] > 0
    assert_no_leak(llm)
    assert_folder_matches_the_tiers(llm, tmp_path)


@pytest.mark.parametrize("name", MODELS)
def test_a_window_group_loads_only_the_blocks_of_its_last_window(model, name):
    """The first prompt comes back once the three others have pushed all of it out of the pool into
    host memory: the blocks that leave host memory for the pool are exactly those its hit reads."""
    folder = model(name)
    llm = LLM(folder, num_blocks=30 * GROUPS[name], kv_offload_host_bytes=4 * 2**20, **OPTIONS)
    one_by_one(llm, PROMPTS, PARAMS)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.offload.block_bytes == 4096  # Gemma 2's groups share one cache tensor: a block is stored once
    hashes: list[bytes] = []
    extend_block_hashes(hashes, PROMPTS[0], BLOCK, _hit_tokens(PROMPTS[0]) // BLOCK)
    assert not any(kv.pool.lookup(h, g) is not None for h in hashes for g in range(kv.num_groups))
    before = set(kv.offload.host_slots())
    (back,) = one_by_one(llm, PROMPTS[:1], PARAMS)
    loaded = {(g, hashes.index(h)) for h, g in before - set(kv.offload.host_slots())}
    assert len(kv.windows) == GROUPS[name] and loaded == _needed(kv.windows, PROMPTS[0])
    # Per window group the 4 blocks of positions 176-207 (the first query after the hit, at 208, sees
    # 177 on); the full group, Gemma 2's, all 26.
    assert len(loaded) == {"gemma2": 4 + 4 + 26, "mistral": 4}[name]
    assert llm.engine.get_stats().kv_offload_hits == {"cpu": len(loaded) * BLOCK, "disk": 0}
    assert back.num_cached_tokens == _hit_tokens(PROMPTS[0])
    assert back.outputs[0].token_ids == hf_greedy(folder, PROMPTS, PARAMS.max_tokens)[0]
    assert_no_leak(llm)


@pytest.mark.parametrize("name", MODELS)
def test_an_engine_restarted_on_the_folder_hits_every_group_s_blocks_of_the_one_before(model, name, tmp_path):
    """The first engine keeps everything in its pool; stopping writes every group's blocks to disk. The
    second, cold, loads from there what each group's hit reads, and answers as the first did."""
    folder = model(name)
    options = dict(OPTIONS, num_blocks=128 * GROUPS[name], kv_offload_dir=str(tmp_path),
                   kv_offload_disk_bytes=2_000_000)
    before = LLM(folder, **options)
    want = [o.outputs[0].token_ids for o in one_by_one(before, PROMPTS, PARAMS)]
    before.shutdown()
    after = LLM(folder, **options)
    outs = one_by_one(after, PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == want == hf_greedy(folder, PROMPTS, PARAMS.max_tokens)
    assert [o.num_cached_tokens for o in outs] == [_hit_tokens(p) for p in PROMPTS]
    windows = after.engine.scheduler.kv_cache_manager.windows
    loaded = sum(len(_needed(windows, p)) for p in PROMPTS)
    assert after.engine.get_stats().kv_offload_hits == {"cpu": 0, "disk": loaded * BLOCK}
    assert_no_leak(after)
    assert_folder_matches_the_tiers(after, tmp_path)
