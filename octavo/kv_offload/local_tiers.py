"""Host memory and disk as the tiers below one rank's pool.

A block's bytes on this rank are the slices ``[:, block]`` of every cache
tensor (blocks sit on dim 1 of each: K/V data, quantized scales, a draft
model's caches), concatenated as raw bytes: the tiers copy bytes losslessly
and never need to know the dtypes or the backend's layout, which the file's
fingerprint pins instead.

Host memory is one ``[slots, block_bytes]`` uint8 buffer, pinned on CUDA so
that copies to and from the device run at full bus speed. On CPU the copy is
plain and lossless: compressing does not pay. Measured on the shipped
model's K/V (bf16, ``python -m benchmarks.kv_tier_compression``, one thread's
CPU time): the copy runs at ~18 GB/s; zlib at level 1 keeps 78% of the bytes
(70% with the bytes split into planes first) at 0.04-0.06 GB/s, some 300x
slower, for a host tier a quarter larger at best.

Each block is copied slice by slice between the pool and its host slot (or
a file's staging row), with no temporary: gathering a block (or a run) into a
new tensor of ~200 KiB or more per call made a returning 1,100-token turn of
llama-100m spend 0.4-0.6 s in 66 such copies on a loaded 2-core machine,
against 0.04-0.11 s now.
"""
from __future__ import annotations

import logging
import os
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from octavo.config import CacheConfig
from octavo.kv_offload.block_file import HEADER_BYTES, BadBlockFile, file_name, read_block, scan_folder, write_block
from octavo.kv_offload.connector import KVTierConnector
from octavo.kv_offload.fingerprint import cache_fingerprint, group_fingerprint, model_identity
from octavo.kv_offload.transfers import (DELETE_FILE, FROM_DISK, FROM_HOST, HOST_TO_DISK, TO_DISK, TO_HOST,
                                         BlockKey, KVTransfer, TierLayout, TierReport)

logger = logging.getLogger(__name__)

# How long a step with nothing to compute waits for a read to finish before it
# returns: short, so that the engine takes new requests meanwhile, long enough
# that waiting for a load does not spin.
IDLE_WAIT_S = 0.05
_PENDING, _FAILED, _DONE = 0, 1, 2  # a block's load, as the ranks agree on it (each position's smallest)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as uint8 (its last dim widened by the element
    size): the tiers copy bytes, whatever the dtype (float8 included, which
    torch's index ops refuse on CPU)."""
    return t.view(torch.uint8)


@dataclass
class _Read:
    """One step's loads from disk, read by the reader thread into
    ``staging`` (a row per block: no more than the pool blocks being filled):
    the pool blocks to fill and their files' blocks (hash, group); the future
    holds, per block, None or why its file is bad."""

    blocks: list[int]
    keys: list[BlockKey]
    staging: torch.Tensor
    future: Future


class LocalTiers(KVTierConnector):
    """``tensors``: the rank's cache tensors, blocks on dim 1, dim 0 K/V.
    ``host_bytes`` and ``disk_bytes`` are this rank's budgets; ``folder``
    None: no disk tier. ``agree``: each position's smallest value over every
    rank (None: this rank alone), so that all ranks finish a load in the same
    step and a read failed on one is a miss on all. ``num_groups``: the
    model's KV cache groups, whose files are told apart by their fingerprints
    (``group_fingerprint``). A block's bytes are the same slices whatever its
    group: the groups share the cache tensors, block by block.

    Files are read by one thread while steps run; every other move, and
    writing what is read into the pool, happens on the caller's thread, so
    the pool's tensors are only ever touched from there. A file that cannot
    be written, read or deleted (a full disk, an I/O error, a permission
    lost, a file deleted by hand) never fails a step: the block is a miss, the
    first failure of each kind is logged with its path, and ``finish_loads``
    reports it for the scheduler to count and forget."""

    def __init__(self, tensors: Sequence[torch.Tensor], host_bytes: int, folder: Path | None, disk_bytes: int,
                 fingerprint: bytes, agree: Optional[Callable[[list[int]], list[int]]] = None,
                 num_groups: int = 1) -> None:
        self._pool = [_as_bytes(t) for t in tensors]
        # Bytes of one block in each tensor, and where each starts in a block's bytes.
        self._sizes = [t[:, 0].numel() for t in self._pool]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self.block_bytes = sum(self._sizes)
        device = self._pool[0].device
        host_blocks = host_bytes // self.block_bytes
        self._host = torch.empty((host_blocks, self.block_bytes), dtype=torch.uint8,
                                 pin_memory=device.type == "cuda")
        self._row = torch.empty(self.block_bytes, dtype=torch.uint8)  # a block on its way to a file
        self._folder = folder
        self._fingerprints = [group_fingerprint(fingerprint, g) for g in range(num_groups)]
        self._disk_blocks = disk_bytes // (HEADER_BYTES + self.block_bytes) if folder is not None else 0
        self._files = scan_folder(folder, self._fingerprints, self.block_bytes) if folder is not None else []
        self._agree = agree
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="octavo-kv-disk") if folder is not None else None
        self._reads: list[_Read] = []  # in the order the steps asked, the same on every rank
        self._failed_writes: list[bytes] = []
        self._logged: set[tuple[str, str]] = set()

    def layout(self) -> TierLayout:
        return TierLayout(self._host.shape[0], self._disk_blocks, self.block_bytes, self._files)

    def apply(self, transfers: Sequence[KVTransfer]) -> None:
        # Runs of loads from disk go as one read; order between moves is kept.
        i = 0
        while i < len(transfers):
            move = transfers[i]
            i += 1
            if move.op == TO_HOST:
                self._copy_out(move.block_id, self._host[move.slot])
            elif move.op == FROM_HOST:
                self._copy_in(self._host[move.slot], move.block_id)
            elif move.op == FROM_DISK:
                run = [move]
                while i < len(transfers) and transfers[i].op == FROM_DISK:
                    run.append(transfers[i])
                    i += 1
                blocks, keys = [t.block_id for t in run], [t.key for t in run]
                staging = torch.empty((len(run), self.block_bytes), dtype=torch.uint8)
                job = self._reader.submit(self._read_files, keys, staging)
                self._reads.append(_Read(blocks, keys, staging, job))
            else:
                self._apply_file_move(move)

    def _apply_file_move(self, move: KVTransfer) -> None:
        try:
            fingerprint = self._fingerprints[move.group]
            if move.op == TO_DISK:
                self._copy_out(move.block_id, self._row)
                write_block(self._folder, fingerprint, move.block_hash, self._row.numpy())
            elif move.op == HOST_TO_DISK:
                write_block(self._folder, fingerprint, move.block_hash, self._host[move.slot].numpy())
            elif move.op == DELETE_FILE:
                for read in self._reads:
                    if move.key in read.keys:
                        futures.wait([read.future])  # a file being read is deleted once it is read
                self._path(move.key).unlink(missing_ok=True)
            else:
                raise ValueError(f"unknown KV transfer {move.op!r}")
        except OSError as exc:
            failing = "delete" if move.op == DELETE_FILE else "write"
            self._log_failure(failing, self._path(move.key), exc.strerror or str(exc))
            if failing == "write":
                self._failed_writes.append(move.key)

    def finish_loads(self, wait: bool) -> TierReport:
        """Fill the pool blocks whose files every rank has read; what came of
        the loads finished and of the writes failed since the last call.
        ``wait``: the step has nothing else to do, so wait a little
        (``IDLE_WAIT_S``) for a read to finish."""
        report = TierReport(failed_writes=self._failed_writes)
        self._failed_writes = []
        if not self._reads:
            return report
        if wait:
            futures.wait([r.future for r in self._reads], timeout=IDLE_WAIT_S, return_when=futures.FIRST_COMPLETED)
        results = [self._results(read) for read in self._reads]
        mine: list[int] = []
        for read, got in zip(self._reads, results):
            if got is None:
                mine += [_PENDING] * len(read.blocks)
            else:
                mine += [_DONE if x is None else _FAILED for x in got]
        agreed = iter(self._agree(mine) if self._agree is not None else mine)
        pending: list[_Read] = []
        for read, got in zip(self._reads, results):
            status = [next(agreed) for _ in read.blocks]
            if status[0] == _PENDING:  # a rank has not read them all yet (each read finishes whole)
                pending.append(read)
                continue
            ok = [i for i, s in enumerate(status) if s == _DONE]
            for i in ok:
                self._copy_in(read.staging[i], read.blocks[i])
            report.loaded += [read.blocks[i] for i in ok]
            for i, s in enumerate(status):
                if s == _FAILED:
                    report.failed.append(read.blocks[i])
                    if got[i] is not None:
                        self._log_failure("read", self._path(read.keys[i]), str(got[i]))
        self._reads = pending
        return report

    def _results(self, read: _Read) -> Optional[list[Optional[Exception]]]:
        """Per block of the read, None (read and checked) or why not; None while it runs."""
        if not read.future.done():
            return None
        exc = read.future.exception()
        return [exc] * len(read.blocks) if exc is not None else read.future.result()

    def _read_files(self, keys: list[BlockKey], staging: torch.Tensor) -> list[Optional[BadBlockFile]]:
        """On the reader thread: each file's payload into its row of ``staging``, checked, or why it cannot be."""
        rows = staging.numpy()
        out: list[Optional[BadBlockFile]] = []
        for (block_hash, group), row in zip(keys, rows):
            try:
                read_block(self._path((block_hash, group)), self._fingerprints[group], block_hash, memoryview(row))
                out.append(None)
            except BadBlockFile as exc:
                out.append(exc)
        return out

    def _log_failure(self, op: str, path: Path, reason: str) -> None:
        """The first failure of each kind, with its path (failed reads and writes are all
        counted: octavo:kv_offload_errors_total)."""
        kind = (op, reason.split(":")[0])
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("KV tiers: cannot %s %s: %s (further failures of this kind are not logged)",
                           op, path, reason)

    def _path(self, key: BlockKey) -> Path:
        block_hash, group = key
        return self._folder / file_name(self._fingerprints[group], block_hash)

    def _copy_out(self, block: int, row: torch.Tensor) -> None:
        """Pool block ``block``'s bytes of every tensor into ``row`` (``[block_bytes]``, host memory)."""
        for t, offset, size in zip(self._pool, self._offsets, self._sizes):
            row[offset : offset + size].view(t.shape[0], *t.shape[2:]).copy_(t[:, block])

    def _copy_in(self, row: torch.Tensor, block: int) -> None:
        """``row`` (a block's bytes, host memory) into pool block ``block`` of every tensor."""
        for t, offset, size in zip(self._pool, self._offsets, self._sizes):
            t[:, block].copy_(row[offset : offset + size].view(t.shape[0], *t.shape[2:]))


def local_tiers(config: CacheConfig, tensors: Sequence[torch.Tensor], models: Sequence[str | Path], rank: int,
                world_size: int, agree: Optional[Callable[[list[int]], list[int]]] = None,
                num_groups: int = 1) -> LocalTiers | None:
    """This rank's tiers as ``config`` asks (None: no tier), over its cache
    ``tensors``; ``models``: the model's path and any draft model's;
    ``agree`` and ``num_groups``: as ``LocalTiers`` takes them. The byte budgets are the
    engine's, split evenly between its ranks (they share the machine's
    memory and the folder)."""
    if not config.kv_offload_enabled:
        return None
    folder = None
    if config.kv_offload_dir is not None:
        folder = Path(config.kv_offload_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir: cannot create {folder}: {exc.strerror}") from None
        if not os.access(folder, os.W_OK):
            raise ValueError(f"kv_offload_dir: {folder} is not writable")
    shapes = [f"{(t.shape[0], *t.shape[2:])}:{t.dtype}" for t in tensors]
    fingerprint = cache_fingerprint([model_identity(m) for m in models], shapes, config.block_size, rank, world_size)
    tiers = LocalTiers(tensors, config.kv_offload_host_bytes // world_size, folder,
                       config.kv_offload_disk_bytes // world_size, fingerprint, agree, num_groups)
    layout = tiers.layout()
    if config.kv_offload_host_bytes and not layout.host_blocks:
        raise ValueError(f"kv_offload_host_bytes: {config.kv_offload_host_bytes} bytes hold no KV block "
                         f"({tiers.block_bytes} bytes on each of {world_size} rank(s))")
    if folder is not None and not layout.disk_blocks:
        raise ValueError(f"kv_offload_disk_bytes: {config.kv_offload_disk_bytes} bytes hold no KV block file "
                         f"({HEADER_BYTES + tiers.block_bytes} bytes on each of {world_size} rank(s))")
    if layout.files:
        logger.info("KV tiers: %d block files of an earlier run found in %s", len(layout.files), folder)
    return tiers
