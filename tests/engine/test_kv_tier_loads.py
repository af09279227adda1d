"""The engine's loads from the disk tier: they overlap other requests' steps
(a read held on an event leaves the request waiting while another one
decodes), and a disk that fails (full, I/O errors, files gone) never fails a
request: outputs equal transformers' greedy tokens, the failures are counted
and logged once, and the folder holds exactly what the index names."""
from __future__ import annotations

import errno
import logging
import os
import pathlib
import threading
from pathlib import Path

from octavo import LLM, SamplingParams
from octavo.core.prefix_hash import extend_block_hashes
from octavo.kv_offload import local_tiers as local_tiers_module
from tests.engine.conftest import (assert_folder_matches_the_tiers, assert_no_leak, hf_greedy, one_by_one,
                                   random_prompts)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 4 full blocks each (16 tokens a block), and the pool holds 10 blocks: two more prompts evict one.
PROMPTS = random_prompts([70, 75, 66, 80], seed=3)
BOUND = 400_000  # the disk tier's bytes: ~48 blocks of this model (8 KiB each)


def _tiers_on_disk(folder: Path, kv: Path) -> LLM:
    return LLM(folder, dtype="float32", num_blocks=10, kv_offload_dir=str(kv), kv_offload_disk_bytes=BOUND)


def test_a_load_from_disk_waits_while_another_request_decodes(folder, tmp_path, monkeypatch):
    llm = _tiers_on_disk(folder, tmp_path)
    one_by_one(llm, PROMPTS[:3], PARAMS)  # the first prompt's blocks are on disk now
    gate = threading.Event()
    read = local_tiers_module.read_block
    monkeypatch.setattr(local_tiers_module, "read_block", lambda *args: gate.wait(30) and read(*args))
    engine = llm.engine
    other = random_prompts([20], seed=9)[0]
    engine.add_request("other", other, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.step()  # its prompt
    engine.add_request("back", PROMPTS[0], PARAMS)
    steps_while_loading = 0
    while steps_while_loading < 5:
        outs = {o.request_id: o for o in engine.step()}
        assert "back" not in outs
        assert engine.scheduler.kv_cache_manager.is_loading(engine.scheduler.get_request("back"))
        steps_while_loading += "other" in outs
    gate.set()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    want = hf_greedy(folder, [PROMPTS[0], other], 24)
    assert done["back"].outputs[0].token_ids == want[0][: PARAMS.max_tokens]
    assert done["other"].outputs[0].token_ids == want[1]
    assert done["back"].num_cached_tokens == 64
    assert engine.get_stats().kv_offload_hits["disk"] == 64
    assert_no_leak(llm)
    assert_folder_matches_the_tiers(llm, tmp_path)


def test_a_full_disk_is_a_miss_never_an_error(folder, tmp_path, monkeypatch, caplog):
    """Every other block file finds the disk full: every answer is still
    transformers', the failed writes are counted (and logged once), the
    folder holds exactly what the index names, with no half-written file."""
    llm = _tiers_on_disk(folder, tmp_path)
    replace = os.replace
    writes = iter(range(10**6))

    def disk_full_every_other_write(src, dst):
        if Path(dst).parent == tmp_path and next(writes) % 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", disk_full_every_other_write)
    with caplog.at_level(logging.WARNING, logger="octavo.kv_offload.local_tiers"):
        first = one_by_one(llm, PROMPTS, PARAMS)
        again = one_by_one(llm, PROMPTS[::-1], PARAMS)[::-1]
    want = hf_greedy(folder, PROMPTS, PARAMS.max_tokens)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    stats = llm.engine.get_stats()
    assert stats.kv_offload_errors["write"] > 0 and stats.kv_offload_errors["read"] == 0
    logged = [r.getMessage() for r in caplog.records if r.name == local_tiers_module.__name__]
    assert len(logged) == 1 and "cannot write" in logged[0] and str(tmp_path) in logged[0]
    assert_no_leak(llm)
    assert_folder_matches_the_tiers(llm, tmp_path)


def test_files_that_cannot_be_read_are_misses_never_errors(folder, tmp_path, monkeypatch, caplog):
    """The first block of one prompt reads with an I/O error, that of another
    vanished after it was indexed: both prompts are computed again, with
    transformers' answers; both files are counted and forgotten."""
    llm = _tiers_on_disk(folder, tmp_path)
    first = one_by_one(llm, PROMPTS, PARAMS)  # the first two prompts are on disk only now
    index = llm.engine.scheduler.kv_cache_manager.offload
    broken, vanished = (_first_block_hash(p) for p in PROMPTS[:2])
    assert index.tier_of((broken, 0)) == index.tier_of((vanished, 0)) == "disk"
    next(tmp_path.glob(f"{vanished.hex()}.*")).unlink()
    open_file = pathlib.Path.open

    def io_error_on_one_file(path, *args, **kwargs):
        if path.name.startswith(broken.hex()):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return open_file(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", io_error_on_one_file)
    with caplog.at_level(logging.WARNING, logger="octavo.kv_offload.local_tiers"):
        again = one_by_one(llm, PROMPTS[::-1], PARAMS)[::-1]
    want = hf_greedy(folder, PROMPTS, PARAMS.max_tokens)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    assert [o.num_cached_tokens for o in again[:2]] == [0, 0]
    assert llm.engine.get_stats().kv_offload_errors == {"read": 2, "write": 0}
    assert index.tier_of((broken, 0)) is None and index.tier_of((vanished, 0)) is None
    logged = [r.getMessage() for r in caplog.records if r.name == local_tiers_module.__name__]
    assert len(logged) == 1 and "cannot read" in logged[0]  # both "unreadable": one kind, logged once
    assert_no_leak(llm)
    assert_folder_matches_the_tiers(llm, tmp_path)


def _first_block_hash(prompt: list[int]) -> bytes:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 16, 1)
    return hashes[0]
