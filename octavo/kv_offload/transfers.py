"""The moves of K/V between the pool and the tiers that one step carries (torch-free).

The scheduler's half appends moves in the order its decisions happen, and
the worker's half applies them in that order before anything else of the
step writes the pool (block copies, the forward). Order is the whole
contract: a pool block evicted to the host tier and reused for a load in the
same step is read out (``TO_HOST``) before the load writes it (``FROM_HOST``),
and a host slot spilled to disk is read (``HOST_TO_DISK``) before a newer
block overwrites it.

Loads from disk are the one move a step only starts: the files are read
while later steps run, and each step's ``TierReport`` tells the scheduler
which pool blocks are filled (or could not be, a read that failed). Until
then the scheduler holds those blocks and schedules nothing that reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# A block in the tiers: its chained prefix hash and its KV cache group. The groups of a model with
# sliding-window layers cache the same prefixes in different blocks (different layers' K/V), so
# the hash alone names one group's block only.
BlockKey = tuple[bytes, int]

HOST = "cpu"  # the medium names of KV events (vLLM's events name host memory "cpu" too)
DISK = "disk"
TIERS = (HOST, DISK)

TO_HOST = "to_host"  # pool block -> host slot
TO_DISK = "to_disk"  # pool block -> file (no host tier, or persisting at shutdown)
HOST_TO_DISK = "host_to_disk"  # host slot -> file (spill)
FROM_HOST = "from_host"  # host slot -> pool block
FROM_DISK = "from_disk"  # file -> pool block, finished in a later step (TierReport)
DELETE_FILE = "delete_file"  # the disk tier's LRU eviction


@dataclass(frozen=True)
class KVTransfer:
    """One move. ``block_id``: the pool block read or written (-1: none);
    ``slot``: the host slot (-1: none); ``block_hash`` and ``group``: the
    chained prefix hash and the KV cache group that name the block's file on
    disk (empty hash: none)."""

    op: str
    block_id: int = -1
    slot: int = -1
    block_hash: bytes = b""
    group: int = 0

    @property
    def key(self) -> BlockKey:
        return self.block_hash, self.group


@dataclass(frozen=True)
class TierLayout:
    """What one rank's worker half holds, reported once at start: each
    tier's capacity in blocks (0: no such tier), the bytes one block takes on
    this rank (every cache tensor's share of it), and the blocks (hash, group)
    of the valid files found on disk from an earlier run, oldest first."""

    host_blocks: int
    disk_blocks: int
    block_bytes: int
    files: list[BlockKey]


@dataclass
class TierReport:
    """What a step's moves came to, as far as the scheduler must know (the
    driver rank's, which agrees with every rank on the loads): the pool
    blocks whose loads from disk are done (``loaded``) or failed on some
    rank (``failed``: the block holds nothing, its prefix is a miss from
    there on), and the blocks whose files could not be written
    (``failed_writes``, by hash and group: the disk tier does not hold them)."""

    loaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    failed_writes: list[BlockKey] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loaded or self.failed or self.failed_writes)
