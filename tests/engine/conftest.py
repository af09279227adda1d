"""Fixtures for end-to-end engine tests: tiny checkpoints and transformers' greedy reference."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from octavo.kv_offload.block_file import SUFFIX
from tests.model_factory import PAD_ID, load_hf_model, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [1, 7, 16, 33, 64, 128, 211, 300]
NEW_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The tiny models' ops are too small to split; on busy shared cores a
    # second intra-op thread makes each step several times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-models")
    return lambda arch="llama", **kw: make_tiny_model(root, arch, **kw)


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


def assert_no_leak(llm) -> None:
    """Every KV block is back in the pool, nothing is left running, and no
    per-request state is left behind anywhere: in the engine, the scheduler,
    what it remembers sending, or the rank's batch (a map that only grows is a
    leak of its own, whatever the KV pool says)."""
    engine = llm.engine
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not engine.has_unfinished_requests()
    sched = engine.scheduler
    leftovers = {
        "engine._requests": engine._requests, "engine._child_to_parent": engine._child_to_parent,
        "engine._grammar_ids": engine._grammar_ids, "scheduler._requests": sched._requests,
        "scheduler._order": sched._order, "scheduler._fork_waiters": sched._fork_waiters,
        "scheduler._sent": sched._sent._held, "scheduler._sent (on workers)": sched._sent._on_workers,
    }
    runner = getattr(getattr(engine.executor, "worker", None), "runner", None)
    if runner is not None:  # the in-process executor: the rank is here to look at
        leftovers |= {"runner.batch": runner.batch.requests, "runner._generators": runner._generators}
    assert not {name: list(v)[:5] for name, v in leftovers.items() if v}, "per-request state left behind"


def random_prompts(lengths: list[int], vocab: int = 512, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 5 upwards: no special tokens inside prompts.
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(seed: int = 2) -> list[list[int]]:
    """Prompts that share a 40-token system prefix, like chat traffic does."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 512) for _ in range(40)]
    return [prefix + [rng.randrange(5, 512) for _ in range(n)] for n in (3, 17, 30, 9)]


_REFERENCE: dict = {}


def hf_greedy(folder, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: one left-padded batch
    through ``generate``, as a user of transformers would run it."""
    key = (str(folder), tuple(map(tuple, prompts)), new_tokens)
    if key not in _REFERENCE:
        model = load_hf_model(folder)
        # Like ignore_eos: end tokens may be generated but do not stop the
        # sequence (min_new_tokens would instead forbid them).
        model.generation_config.eos_token_id = None
        width = max(map(len, prompts))
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=PAD_ID
            )
        _REFERENCE[key] = gen[:, width:].tolist()
    return _REFERENCE[key]


def one_by_one(llm, prompts: list[list[int]], params) -> list:
    """Each prompt as a request of its own, after the one before has finished."""
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def assert_folder_matches_the_tiers(llm, folder: Path) -> None:
    """The disk tier's folder holds a block file for every block the index names and no other, nor any
    write left unfinished. A file's name gives its hash and its fingerprint, which tells its KV cache group
    apart: the hashes under each fingerprint are those of one group of the index."""
    by_fingerprint: dict[str, set[str]] = {}
    for file in folder.glob(f"*{SUFFIX}"):
        block_hash, fingerprint, _ = file.name.split(".")
        by_fingerprint.setdefault(fingerprint, set()).add(block_hash)
    by_group: dict[int, set[str]] = {}
    for block_hash, group in llm.engine.scheduler.kv_cache_manager.offload.disk_blocks():
        by_group.setdefault(group, set()).add(block_hash.hex())
    assert sorted(map(sorted, by_fingerprint.values())) == sorted(map(sorted, by_group.values()))
    assert not list(folder.glob(".*.tmp"))
