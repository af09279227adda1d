"""KV cache tiers below the block pool: host memory, then disk.

Registered blocks that the pool evicts go to a host-memory tier; what the host
tier evicts (LRU) spills to files on disk, which a restarted engine reuses. A
prefix lookup that runs past the pool's hits continues through the tiers, and
the blocks it finds there are loaded into fresh pool blocks before the
request's first forward.

Two halves, meeting at plain data (``transfers.py``): the scheduler's half
(``index.py``, torch-free) knows which block hashes each tier holds and
decides what moves each step; the worker's half (``connector.py`` the seam,
``local_tiers.py`` the host-memory and disk implementation) copies block
contents between the pool's per-layer cache tensors and the tiers, in the
order the scheduler listed the moves.
"""
