"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is mostly kernel-launch time: hundreds of small kernels whose launches
cost more than their work. A CUDA graph records one step's launches once and replays them with a single call.
Replay reads fixed addresses, so every input lives in a static buffer per captured batch size; a step of n
decodes copies its inputs into the smallest captured size >= n and pads the rest with rows that write their K/V
into a spare block no request owns (the "null block", one more than the pool the scheduler manages) and attend
over it alone. The attention grid is sized for ``max_model_len``, so one graph serves every context length.

Without ``capture`` (CPU tests) the same static buffers and padding run eagerly: everything but the recording.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.triton_cuda import TritonMetadata

logger = logging.getLogger(__name__)

# Model forward: (input_ids, positions, kv_caches, metadata) -> hidden states [tokens, hidden].
Forward = Callable[[torch.Tensor, torch.Tensor, Sequence[LayerKVCache], TritonMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: every size to 8, then steps of 8 to max_batch (at most 7 padded rows of waste,
    which at these sizes costs less than another graph's memory)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sizes + [max_batch]


@dataclass
class _StaticStep:
    size: int
    input_ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    meta: TritonMetadata  # its slot_mapping, block table and context lengths are the static buffers
    hidden: Optional[torch.Tensor] = None  # the graph's output
    graph: Optional["torch.cuda.CUDAGraph"] = None


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv_caches: Sequence[LayerKVCache],
        null_block: int,
        block_size: int,
        max_batch: int,
        max_model_len: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        self._forward = forward
        self._kv_caches = kv_caches
        self._null_slot = null_block * block_size
        self._null_block = null_block
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self._steps: dict[int, _StaticStep] = {}
        for size in capture_sizes(max_batch):
            meta = TritonMetadata(
                slot_mapping=torch.full((size,), self._null_slot, dtype=torch.int64, device=device),
                num_decodes=size,
                prefills=[],
                decode_block_table=torch.full((size, max_blocks), null_block, dtype=torch.int64, device=device),
                decode_context_lens=torch.ones(size, dtype=torch.int32, device=device),
                max_decode_context=max_model_len,
            )
            self._steps[size] = _StaticStep(size, torch.zeros(size, dtype=torch.int64, device=device),
                                            torch.zeros(size, dtype=torch.int64, device=device), meta)
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return max(self._steps)

    def _capture(self) -> None:
        """Record each size's step, largest first so the smaller ones reuse its memory from the shared pool.
        Warm-up runs on a side stream first (the allocator and Triton's compilation must not happen while
        recording); all rows are padding then, so they only write the null block."""
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self._steps, reverse=True):
            step = self._steps[size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run_eager(step)
            torch.cuda.current_stream().wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=pool):
                step.hidden = self._run_eager(step)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", sorted(self._steps))

    def _run_eager(self, step: _StaticStep) -> torch.Tensor:
        return self._forward(step.input_ids, step.positions, self._kv_caches, step.meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TritonMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a step of n <= max_batch decodes laid out by the attention backend."""
        n = meta.num_decodes
        step = self._steps[min(size for size in self._steps if size >= n)]
        static = step.meta
        width = meta.decode_block_table.shape[1]
        step.input_ids[:n].copy_(input_ids)
        step.positions[:n].copy_(positions)
        static.slot_mapping[:n].copy_(meta.slot_mapping)
        static.decode_block_table[:n, :width].copy_(meta.decode_block_table)
        static.decode_context_lens[:n].copy_(meta.decode_context_lens)
        # Rows n.. still hold the previous replay's values: reset them to padding.
        step.input_ids[n:].zero_()
        step.positions[n:].zero_()
        static.slot_mapping[n:].fill_(self._null_slot)
        static.decode_block_table[n:, 0].fill_(self._null_block)
        static.decode_context_lens[n:].fill_(1)
        if step.graph is None:
            return self._run_eager(step)[:n]
        step.graph.replay()
        return step.hidden[:n]
