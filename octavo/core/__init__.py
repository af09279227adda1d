"""Torch-free engine core: requests, block pool, KV cache manager, scheduler."""
