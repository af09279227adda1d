"""The worker's half of the KV tiers on real cache tensors: blocks moved to
host memory or disk and loaded back are bitwise identical (every dtype the
pool stores, quantized scales included); files that are corrupted,
truncated, foreign or misnamed are reported once each and never loaded;
loads from disk run on a thread and end in a later call; reads and writes
that fail are reported as misses, never raised; the ranks agree on which
loads are done; the disk tier stays within its byte bound."""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from octavo.attention.kv_quant import allocate_layer_cache
from octavo.config import CacheConfig
from octavo.kv_offload import local_tiers as local_tiers_module
from octavo.kv_offload.block_file import HEADER_BYTES, SUFFIX, file_name
from octavo.kv_offload.index import TierIndex
from octavo.kv_offload.local_tiers import LocalTiers, local_tiers
from octavo.kv_offload.transfers import (DELETE_FILE, FROM_DISK, FROM_HOST, HOST_TO_DISK, TO_DISK, TO_HOST,
                                         KVTransfer, TierReport)
from tests.model_factory import make_tiny_model

NUM_BLOCKS, BLOCK_SIZE = 6, 4
FP = bytes(range(32))


def _caches(dtype: torch.dtype, layers: int = 2) -> list[torch.Tensor]:
    """Cache tensors of ``layers`` layers (data, and scales when quantized), filled with random bits."""
    gen = torch.Generator().manual_seed(7)
    tensors = []
    for _ in range(layers):
        cache = allocate_layer_cache(NUM_BLOCKS, BLOCK_SIZE, 2, 8, dtype, torch.device("cpu"))
        for t in (cache.data, cache.scales):
            if t is not None:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
                tensors.append(t)
    return tensors


def _block(tensors: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [t[:, block_id].clone() for t in tensors]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def _finish(tiers: LocalTiers, num_loads: int) -> TierReport:
    """What the tiers report once ``num_loads`` loads from disk have ended (the reads run on their thread)."""
    report = TierReport()
    for _ in range(200):
        step = tiers.finish_loads(wait=True)
        report.loaded += step.loaded
        report.failed += step.failed
        report.failed_writes += step.failed_writes
        if len(report.loaded) + len(report.failed) >= num_loads:
            return report
    raise AssertionError(f"{num_loads} loads did not end: {report}")


H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_a_block_moved_down_and_back_is_bitwise_identical(tmp_path, dtype):
    tensors = _caches(dtype)
    tiers = LocalTiers(tensors, 4 * 4096, tmp_path, 2**20, FP)
    want = [_block(tensors, b) for b in range(3)]
    # Block 0 to host, block 1 straight to disk, block 2 to host and on to disk.
    tiers.apply([KVTransfer(TO_HOST, 0, 0), KVTransfer(TO_DISK, 1, block_hash=H1), KVTransfer(TO_HOST, 2, 1),
                 KVTransfer(HOST_TO_DISK, slot=1, block_hash=H2)])
    for t in tensors:  # the pool reuses the blocks
        t.view(torch.uint8)[:, :3] = 0
    tiers.apply([KVTransfer(FROM_HOST, 5, 0), KVTransfer(FROM_DISK, 4, block_hash=H1),
                 KVTransfer(FROM_DISK, 3, block_hash=H2)])
    assert _finish(tiers, 2) == TierReport(loaded=[4, 3])
    assert _same_bits(_block(tensors, 5), want[0])
    assert _same_bits(_block(tensors, 4), want[1])
    assert _same_bits(_block(tensors, 3), want[2])


def test_one_hash_in_two_kv_cache_groups_is_two_files_each_loaded_into_its_own_block(tmp_path):
    """The groups of a model with sliding-window layers cache the same prefix in different blocks: a file
    names its group (by fingerprint), a restart finds each group's, and each loads back bitwise."""
    tensors = _caches(torch.bfloat16)
    tiers = LocalTiers(tensors, 0, tmp_path, 2**20, FP, num_groups=2)
    want = [_block(tensors, b) for b in range(2)]
    tiers.apply([KVTransfer(TO_DISK, 0, block_hash=H1, group=0), KVTransfer(TO_DISK, 1, block_hash=H1, group=1)])
    assert len(list(tmp_path.iterdir())) == 2
    again = LocalTiers(tensors, 0, tmp_path, 2**20, FP, num_groups=2)
    assert sorted(again.layout().files) == [(H1, 0), (H1, 1)]
    assert LocalTiers(tensors, 0, tmp_path, 2**20, FP).layout().files == [(H1, 0)]  # a one-group model's view
    again.apply([KVTransfer(FROM_DISK, 3, block_hash=H1, group=1), KVTransfer(FROM_DISK, 2, block_hash=H1, group=0)])
    assert _finish(again, 2) == TierReport(loaded=[3, 2])
    assert _same_bits(_block(tensors, 2), want[0]) and _same_bits(_block(tensors, 3), want[1])


def test_a_step_s_moves_apply_in_order(tmp_path):
    """Block 0 leaves for a host slot and a load fills it in the same step:
    the load sees the slot it reads, the pool block keeps the load."""
    tensors = _caches(torch.float32)
    tiers = LocalTiers(tensors, 2 * 4096, None, 0, FP)
    first, second = _block(tensors, 0), _block(tensors, 1)
    tiers.apply([KVTransfer(TO_HOST, 1, 0)])
    tiers.apply([KVTransfer(TO_HOST, 0, 1), KVTransfer(FROM_HOST, 0, 0), KVTransfer(TO_HOST, 0, 0),
                 KVTransfer(FROM_HOST, 2, 1)])
    assert _same_bits(_block(tensors, 0), second)
    assert _same_bits(_block(tensors, 2), first)


def _write_files(folder: Path, tensors: list[torch.Tensor], hashes: list[bytes]) -> LocalTiers:
    tiers = LocalTiers(tensors, 0, folder, 2**20, FP)
    tiers.apply([KVTransfer(TO_DISK, i, block_hash=h) for i, h in enumerate(hashes)])
    return tiers


def test_bad_files_are_reported_once_each_and_never_loaded(tmp_path, caplog):
    tensors = _caches(torch.bfloat16)
    hashes = [bytes([i]) * 32 for i in range(1, 7)]
    tiers = _write_files(tmp_path, tensors, hashes)
    path = [tmp_path / file_name(FP, h) for h in hashes]
    data = path[1].read_bytes()
    path[1].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the payload flipped
    path[2].write_bytes(path[2].read_bytes()[:-10])  # truncated payload
    path[3].write_bytes(path[3].read_bytes()[:20])  # truncated header
    (tmp_path / "other").mkdir()
    other = LocalTiers(tensors, 0, tmp_path / "other", 2**20, bytes(32))  # another model's file, renamed ours
    other.apply([KVTransfer(TO_DISK, 4, block_hash=hashes[4])])
    os.replace(tmp_path / "other" / file_name(bytes(32), hashes[4]), path[4])
    os.replace(path[5], tmp_path / f"not-a-hash.{FP.hex()[:16]}{SUFFIX}")
    (tmp_path / file_name(bytes([9]) * 32, hashes[0])).write_bytes(b"another fingerprint: not ours to judge")
    unfinished = tmp_path / f".{file_name(FP, hashes[5])}.123.tmp"
    unfinished.write_bytes(b"a write cut short")
    with caplog.at_level(logging.WARNING, logger="octavo.kv_offload.block_file"):
        layout = LocalTiers(tensors, 0, tmp_path, 2**20, FP).layout()
    assert layout.files == [(hashes[0], 0)]
    assert not unfinished.exists() and (tmp_path / file_name(bytes([9]) * 32, hashes[0])).exists()
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 5, reasons
    for needle in ("checksum", "payload bytes", "-byte header", "fingerprint differs", "not a block hash"):
        assert sum(needle in r for r in reasons) == 1, (needle, reasons)
    # A file gone bad after the start is a failed load, never a filled block nor an error of the step.
    before = _block(tensors, 0)
    tiers.apply([KVTransfer(FROM_DISK, 0, block_hash=hashes[1])])
    assert _finish(tiers, 1) == TierReport(failed=[0])
    assert _same_bits(_block(tensors, 0), before)


def test_a_load_runs_on_the_reader_thread_and_fills_its_block_in_a_later_call(tmp_path, monkeypatch):
    """``apply`` only starts a load from disk: until the file is read the block
    is untouched and nothing is reported; a file the index then deletes is
    deleted only once read; the call after the read fills the block."""
    tensors = _caches(torch.float32)
    tiers = _write_files(tmp_path, tensors, [H1])
    want = _block(tensors, 0)
    for t in tensors:
        t.view(torch.uint8)[:, 2] = 0
    empty = _block(tensors, 2)
    gate = threading.Event()
    read = local_tiers_module.read_block
    monkeypatch.setattr(local_tiers_module, "read_block", lambda *args: gate.wait(10) and read(*args))
    tiers.apply([KVTransfer(FROM_DISK, 2, block_hash=H1)])
    assert tiers.finish_loads(wait=True) == TierReport()  # waited IDLE_WAIT_S: the read is held
    assert _same_bits(_block(tensors, 2), empty)
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    tiers.apply([KVTransfer(DELETE_FILE, block_hash=H1)])  # waits for the read
    assert not (tmp_path / file_name(FP, H1)).exists()
    assert _finish(tiers, 1) == TierReport(loaded=[2])
    assert _same_bits(_block(tensors, 2), want)


def test_writes_that_fail_leave_no_file_are_reported_and_logged_once(tmp_path, monkeypatch, caplog):
    tensors = _caches(torch.float32)
    tiers = LocalTiers(tensors, 2 * 4096, tmp_path, 2**20, FP)

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger="octavo.kv_offload.local_tiers"):
        tiers.apply([KVTransfer(TO_DISK, 0, block_hash=H1), KVTransfer(TO_HOST, 1, 0),
                     KVTransfer(HOST_TO_DISK, slot=0, block_hash=H2)])
    assert tiers.finish_loads(wait=False) == TierReport(failed_writes=[(H1, 0), (H2, 0)])
    assert list(tmp_path.iterdir()) == []  # not even the temporary files
    logged = [r.getMessage() for r in caplog.records if r.name == local_tiers_module.__name__]
    assert len(logged) == 1 and os.strerror(errno.ENOSPC) in logged[0] and str(tmp_path) in logged[0]


def test_ranks_agree_a_load_is_done_once_every_rank_read_it_and_failed_if_any_could_not(tmp_path):
    """``agree`` stands for the other rank: each position's smallest status
    (0 reading, 1 failed, 2 read). The first call it is still reading; then
    it has read H1's file and failed H2's, so block 5 stays as it was here
    too, though this rank read its file."""
    tensors = _caches(torch.float32)
    _write_files(tmp_path, tensors, [H1, H2])
    want = _block(tensors, 0)
    other_rank = [[0, 0]]  # reading at the first call; from then on H1's file read and H2's failed
    tiers = LocalTiers(tensors, 0, tmp_path, 2**20, FP,
                       agree=lambda mine: [min(a, b) for a, b in zip(mine, other_rank.pop() if other_rank else [2, 1])])
    before = _block(tensors, 5)
    tiers.apply([KVTransfer(FROM_DISK, 4, block_hash=H1), KVTransfer(FROM_DISK, 5, block_hash=H2)])
    time.sleep(0.2)  # this rank's read is done by now
    assert tiers.finish_loads(wait=True) == TierReport()
    assert _finish(tiers, 2) == TierReport(loaded=[4], failed=[5])
    assert _same_bits(_block(tensors, 4), want)
    assert _same_bits(_block(tensors, 5), before)


def test_the_disk_tier_stays_under_its_bound(tmp_path):
    """The index's deletions keep the folder within kv_offload_disk_bytes at every step."""
    tensors = _caches(torch.float32)
    block_bytes = sum(t[:, 0].numel() * t.element_size() for t in tensors)
    bound = 3 * (HEADER_BYTES + block_bytes) + 100
    tiers = LocalTiers(tensors, block_bytes, tmp_path, bound, FP)  # one host slot
    index = TierIndex([tiers.layout()], BLOCK_SIZE)
    for i in range(12):
        index.evicted((bytes([i]) * 32, 0), i % NUM_BLOCKS)
        tiers.apply(index.take_transfers())
        files = list(tmp_path.iterdir())
        assert sum(f.stat().st_size for f in files) <= bound
        assert {f.name for f in files} == {file_name(FP, h) for h, _ in index.disk_blocks()}
    assert len(index.disk_blocks()) == 3


def test_config_budgets_that_hold_no_block_are_refused(tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    tensors = _caches(torch.float32)
    with pytest.raises(ValueError, match="kv_offload_host_bytes"):
        local_tiers(CacheConfig(block_size=BLOCK_SIZE, kv_offload_host_bytes=100), tensors, [folder], 0, 1)
    with pytest.raises(ValueError, match="kv_offload_disk_bytes"):
        local_tiers(CacheConfig(block_size=BLOCK_SIZE, kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_bytes=100),
                    tensors, [folder], 0, 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        local_tiers(CacheConfig(kv_offload_dir=str(blocker / "kv")), tensors, [folder], 0, 1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(kv_offload_host_bytes=-1), "kv_offload_host_bytes"),
    (dict(kv_offload_disk_bytes=0), "kv_offload_disk_bytes"),
    (dict(kv_offload_dir=""), "kv_offload_dir"),
    (dict(kv_offload_host_bytes=2**20, enable_prefix_caching=False), "enable_prefix_caching"),
])
def test_bad_tier_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)
