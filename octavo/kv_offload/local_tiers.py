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
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from octavo.config import CacheConfig
from octavo.kv_offload.block_file import HEADER_BYTES, file_name, read_block, scan_folder, write_block
from octavo.kv_offload.connector import KVTierConnector
from octavo.kv_offload.fingerprint import cache_fingerprint, model_identity
from octavo.kv_offload.transfers import (DELETE_FILE, FROM_DISK, FROM_HOST, HOST_TO_DISK, TO_DISK, TO_HOST,
                                         KVTransfer, TierLayout)

logger = logging.getLogger(__name__)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as uint8 (its last dim widened by the element
    size): the tiers copy bytes, whatever the dtype (float8 included, which
    torch's index ops refuse on CPU)."""
    return t.view(torch.uint8)


class LocalTiers(KVTierConnector):
    """``tensors``: the rank's cache tensors, blocks on dim 1, dim 0 K/V.
    ``host_bytes`` and ``disk_bytes`` are this rank's budgets; ``folder``
    None: no disk tier."""

    def __init__(self, tensors: Sequence[torch.Tensor], host_bytes: int, folder: Path | None, disk_bytes: int,
                 fingerprint: bytes) -> None:
        self._pool = [_as_bytes(t) for t in tensors]
        # Bytes of one block in each tensor, and where each starts in a block's bytes.
        self._sizes = [t[:, 0].numel() for t in self._pool]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self.block_bytes = sum(self._sizes)
        device = self._pool[0].device
        host_blocks = host_bytes // self.block_bytes
        self._host = torch.empty((host_blocks, self.block_bytes), dtype=torch.uint8,
                                 pin_memory=device.type == "cuda")
        self._folder = folder
        self._fingerprint = fingerprint
        self._disk_blocks = disk_bytes // (HEADER_BYTES + self.block_bytes) if folder is not None else 0
        self._files = scan_folder(folder, fingerprint, self.block_bytes) if folder is not None else []

    def layout(self) -> TierLayout:
        return TierLayout(self._host.shape[0], self._disk_blocks, self.block_bytes, self._files)

    def apply(self, transfers: Sequence[KVTransfer]) -> None:
        # Runs of host copies go as one gather/scatter per tensor; order
        # between runs and other moves is kept.
        i = 0
        while i < len(transfers):
            op = transfers[i].op
            j = i + 1
            if op in (TO_HOST, FROM_HOST):
                while j < len(transfers) and transfers[j].op == op:
                    j += 1
                run = transfers[i:j]
                blocks = [t.block_id for t in run]
                slots = [t.slot for t in run]
                if op == TO_HOST:
                    self._host[slots] = self._gather(blocks)
                else:
                    self._scatter(blocks, self._host[slots])
            else:
                self._apply_file_move(transfers[i])
            i = j

    def _apply_file_move(self, move: KVTransfer) -> None:
        if move.op == TO_DISK:
            write_block(self._folder, self._fingerprint, move.block_hash, self._gather([move.block_id])[0].numpy())
        elif move.op == HOST_TO_DISK:
            write_block(self._folder, self._fingerprint, move.block_hash, self._host[move.slot].numpy())
        elif move.op == FROM_DISK:
            payload = read_block(self._path(move.block_hash), self._fingerprint, move.block_hash, self.block_bytes)
            self._scatter([move.block_id], torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(1, -1))
        elif move.op == DELETE_FILE:
            self._path(move.block_hash).unlink(missing_ok=True)
        else:
            raise ValueError(f"unknown KV transfer {move.op!r}")

    def _path(self, block_hash: bytes) -> Path:
        return self._folder / file_name(self._fingerprint, block_hash)

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """``[len(blocks), block_bytes]`` on the CPU: the blocks' bytes of every tensor."""
        ids = torch.tensor(blocks, dtype=torch.int64, device=self._pool[0].device)
        parts = [t.index_select(1, ids).transpose(0, 1).reshape(len(blocks), -1) for t in self._pool]
        return torch.cat(parts, dim=1).cpu()

    def _scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (``[len(blocks), block_bytes]``) into the blocks of every tensor."""
        ids = torch.tensor(blocks, dtype=torch.int64, device=self._pool[0].device)
        for t, offset, size in zip(self._pool, self._offsets, self._sizes):
            part = data[:, offset : offset + size].to(t.device).view(len(blocks), t.shape[0], *t.shape[2:])
            t.index_copy_(1, ids, part.transpose(0, 1))


def local_tiers(config: CacheConfig, tensors: Sequence[torch.Tensor], models: Sequence[str | Path], rank: int,
                world_size: int) -> LocalTiers | None:
    """This rank's tiers as ``config`` asks (None: no tier), over its cache
    ``tensors``; ``models``: the model's path and any draft model's. The
    byte budgets are the engine's, split evenly between its ranks (they
    share the machine's memory and the folder)."""
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
                       config.kv_offload_disk_bytes // world_size, fingerprint)
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
