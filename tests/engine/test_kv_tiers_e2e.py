"""The engine with KV tiers below its pool (--kv-offload-host-bytes,
--kv-offload-dir): prefixes the pool evicted come back from host memory and
disk with the output of a run without any cache; an engine restarted on the
same folder hits the files of the one before; the folder stays within its
bound and holds exactly the blocks the index names; no block is left behind."""
from __future__ import annotations

from pathlib import Path

from octavo import LLM, SamplingParams
from octavo.kv_offload.block_file import SUFFIX
from tests.engine.conftest import assert_folder_matches_the_tiers, assert_no_leak, one_by_one, random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 4 prompts of 4 full blocks each (16 tokens a block): 16 blocks of prefix, a pool of 8.
PROMPTS = random_prompts([70, 75, 66, 80], seed=3)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{SUFFIX}"))


def _assert_folder_matches_the_index(llm: LLM, folder: Path, bound: int) -> None:
    assert_folder_matches_the_tiers(llm, folder)
    assert sum(f.stat().st_size for f in _files(folder)) <= bound


def test_evicted_prefixes_come_back_from_the_tiers_with_the_same_output(folder, tmp_path):
    want = [o.outputs[0].token_ids for o in
            LLM(folder, dtype="float32", enable_prefix_caching=False).generate(PROMPTS, PARAMS, use_tqdm=False)]
    # A block of this model is 8 KiB: host memory for 6, disk for 16 (and their headers).
    host, bound = 6 * 8192, 140_000
    llm = LLM(folder, dtype="float32", num_blocks=8, kv_offload_host_bytes=host,
              kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=bound)
    first = one_by_one(llm, PROMPTS, PARAMS)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0]
    # Back, the most recent first: in the pool, then host memory, then disk.
    again = one_by_one(llm, PROMPTS[::-1], PARAMS)[::-1]
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    stats = llm.engine.get_stats()
    assert [o.num_cached_tokens for o in again] == [64] * 4
    assert stats.kv_offload_hits["cpu"] > 0 and stats.kv_offload_hits["disk"] > 0
    assert stats.kv_offload_hits["cpu"] + stats.kv_offload_hits["disk"] <= stats.prefix_cache_hits
    assert 0 < stats.kv_offload_bytes["cpu"] <= host and 0 < stats.kv_offload_bytes["disk"] <= bound
    assert_no_leak(llm)
    _assert_folder_matches_the_index(llm, tmp_path, bound)


def test_an_engine_restarted_on_the_folder_hits_the_blocks_of_the_one_before(folder, tmp_path):
    """The first engine keeps everything in its pool; stopping writes it to
    disk. The second, cold, finds every full block of every prompt there."""
    bound = 200_000
    options = dict(dtype="float32", num_blocks=32, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=bound)
    before = LLM(folder, **options)
    want = [o.outputs[0].token_ids for o in one_by_one(before, PROMPTS, PARAMS)]
    assert not _files(tmp_path)  # nothing was evicted
    before.shutdown()
    # Every full block computed: a prompt's and its answer's tokens but the last sampled one.
    assert len(_files(tmp_path)) == sum((len(p) + PARAMS.max_tokens - 1) // 16 for p in PROMPTS)
    after = LLM(folder, **options)
    outs = one_by_one(after, PROMPTS, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [64] * 4
    assert [o.outputs[0].token_ids for o in outs] == want
    assert after.engine.get_stats().kv_offload_hits == {"cpu": 0, "disk": 4 * 64}
    assert_no_leak(after)
    _assert_folder_matches_the_index(after, tmp_path, bound)


def test_preempted_requests_resume_from_host_memory_with_the_recomputed_output(folder):
    """A pool too small for the batch preempts requests; their computed full
    blocks leave the pool for host memory and come back when they resume,
    instead of being recomputed. Outputs equal a roomy engine's."""
    prompts = random_prompts([20, 35, 50, 28, 41, 60])
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(folder, dtype="float32").generate(prompts, params, use_tqdm=False)]
    tight = LLM(folder, dtype="float32", num_blocks=14, kv_offload_host_bytes=64 * 8192)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = tight.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_offload_hits["cpu"] > 0
    assert_no_leak(tight)
