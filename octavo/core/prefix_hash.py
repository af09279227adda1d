"""Content hashes of full KV blocks, chained so a hash names a whole prefix.

A block's hash covers its parent's hash, its own token ids and an extra key
(the request's cache salt), so equal hashes mean equal K/V for the entire
prefix up to and including that block. SHA-256 rather than Python's ``hash``:
a collision would silently serve another prompt's K/V, and the digest is the
same in every process and run (``hash`` of strings is salted per process),
which keeps hashes comparable between the engine process and any router that
reasons about cache locality. Its cost (about a microsecond per block) is
noise next to a forward pass.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

BlockHash = bytes


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int], extra_key: object = None) -> BlockHash:
    """The hash of one full block whose prefix hashes to ``parent`` (None for the first block)."""
    h = hashlib.sha256(parent or b"")
    # repr of a tuple of ints / str / None is stable across runs and platforms.
    h.update(repr((tuple(token_ids), extra_key)).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_key: object = None,
) -> None:
    """Grow ``hashes`` (the chain of the first full blocks of ``token_ids``) in
    place to ``num_blocks`` entries, or to as many full blocks as exist."""
    target = min(num_blocks, len(token_ids) // block_size)
    while len(hashes) < target:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key))
