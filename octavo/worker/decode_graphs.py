"""Decode steps replayed from a recording: CUDA graphs on a GPU, kernel tapes on a CPU.

A decode step of a small model is mostly overhead around small kernels: on a GPU their launches, on a CPU the
Python between them. A recording of one step (a CUDA graph; on CPU a kernel tape, octavo/worker/kernel_tape.py)
replays its kernels with a single call. Replay reads fixed addresses, so every input lives in a static buffer
per recorded batch size; a step of n decodes copies its inputs into the smallest recorded size >= n and pads the
rest with rows that write their K/V into a spare block no request owns (the "null block", one more than the pool
the scheduler manages) and attend over it alone. The attention metadata is sized for the longest sequence (the
model runner's max_model_len, or the pool's size where smaller), so one recording serves every context length;
there is one per KV cache group, each layer reading its group's.

Without a recorder (tests) the same static buffers and padding run eagerly: everything but the recording.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache

logger = logging.getLogger(__name__)

# Model forward: (input_ids, positions, kv_caches, metadata per layer) -> hidden states [tokens, hidden] (or any
# output with a row per token: a draft model records its logits).
Forward = Callable[[torch.Tensor, torch.Tensor, Sequence[LayerKVCache], Sequence[AttentionMetadata]], torch.Tensor]


class StepRefused(RuntimeError):
    """The step does something a replay cannot repeat; it runs eagerly."""


class ReplayFailed(RuntimeError):
    """A replay went wrong (a kernel's status differs from the recording's)."""


@dataclass
class Recording:
    replay: Callable[[], None]
    output: torch.Tensor  # what every replay rewrites in place
    nbytes: int  # memory the recording holds beyond what it shares with others


class StepRecorder(Protocol):
    name: str
    on_use: bool  # record each size on its second step (True), or all sizes up front

    def record(self, run: Callable[[], torch.Tensor]) -> Recording:
        """Record ``run``: one step over the static buffers."""


class CudaGraphRecorder:
    """CUDA graphs sharing one memory pool. Warm-up runs on a side stream first (the allocator and Triton's
    compilation must not happen while recording)."""

    name = "CUDA graphs"

    on_use = False

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()

    def record(self, run: Callable[[], torch.Tensor]) -> Recording:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run()
        torch.cuda.synchronize()
        return Recording(graph.replay, output, 0)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then steps of 8 to max_batch (at most 7 padded rows of waste, which at
    these sizes costs less than another graph's memory)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sizes + [max_batch]


@dataclass
class _StaticStep:
    size: int
    input_ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    # Per KV cache group: its slot_mapping, decode block table and context lengths are the static buffers.
    metas: list[AttentionMetadata]
    hidden: Optional[torch.Tensor] = None  # the recording's output
    replay: Optional[Callable[[], None]] = None
    eager_runs: int = 0
    settled: bool = False  # recorded, or given up on: no more attempts


class DecodeGraphs:
    """Recorded decode steps for the batch ``sizes``. ``recorder.on_use`` False (CUDA graphs): every size is
    recorded here, largest first (the graph pool serves the smaller ones from the largest one's memory). True
    (kernel tapes): a size is recorded on its second step, the first having run eagerly through the same
    buffers (whatever a first run builds or measures stays out of the recording), and an engine that never
    decodes at a size never pays for it. With ``memory_budget`` (bytes), a recording that would take the
    recordings past it is dropped and its size stays eager (a kernel tape keeps every tensor its step made).
    ``layer_groups``: per layer, its KV cache group (default: one group). ``row_mask``: a tensor with a row per
    batch row (at least ``max(sizes)``) holding 1s that the model's statistics read to tell counted rows
    (model/layers/route_counts.py); a step writes 0 into its padding rows while it runs."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: Sequence[LayerKVCache],
        null_block: int,
        block_size: int,
        sizes: Sequence[int],
        max_model_len: int,
        backend: AttentionBackend,
        device: torch.device,
        recorder: Optional[StepRecorder],
        memory_budget: Optional[int] = None,
        layer_groups: Optional[Sequence[int]] = None,
        row_mask: Optional[torch.Tensor] = None,
    ) -> None:
        self._forward = forward
        self._kv_caches = kv_caches
        self._null_slot = null_block * block_size
        self._null_block = null_block
        self.max_model_len = max_model_len
        self._recorder = recorder
        self._memory_budget = memory_budget
        self._layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(kv_caches)
        self._row_mask = row_mask
        self.recorded_bytes = 0
        self._steps: dict[int, _StaticStep] = {}
        for size in sizes:
            metas = [backend.static_decode_metadata(size, -(-max_model_len // block_size), null_block,
                                                    self._null_slot, max_model_len, device)
                     for _ in range(max(self._layer_groups) + 1)]
            self._steps[size] = _StaticStep(size, torch.zeros(size, dtype=torch.int64, device=device),
                                            torch.zeros(size, dtype=torch.int64, device=device), metas)
        if recorder is not None and not recorder.on_use:
            for size in sorted(self._steps, reverse=True):
                self._record(self._steps[size])
            logger.info("recorded decode steps (%s) for batch sizes %s", recorder.name, sorted(self._steps))

    @property
    def max_batch(self) -> int:
        return max(self._steps)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every batch size a decode step may be padded to (recorded, or still to be on its second step)."""
        return tuple(sorted(self._steps))

    @property
    def recorded_sizes(self) -> list[int]:
        return sorted(size for size, step in self._steps.items() if step.replay is not None)

    def _record(self, step: _StaticStep) -> torch.Tensor:
        """Record ``step`` (a real step: its output is returned) and keep the recording when it fits the
        budget. A step the recorder refuses runs eagerly, now and from then on."""
        step.settled = True
        try:
            recorded = self._recorder.record(lambda: self._run_eager(step))
        except StepRefused as exc:
            logger.info("decode steps of batch %d stay eager: %s", step.size, exc)
            return self._run_eager(step)  # whatever the refused attempt wrote, rewritten
        if self._memory_budget is not None and self.recorded_bytes + recorded.nbytes > self._memory_budget:
            logger.info("decode steps of batch %d stay eager: recording them (%.1f MiB) would pass the budget "
                        "of %.0f MiB", step.size, recorded.nbytes / 2**20, self._memory_budget / 2**20)
            return recorded.output
        self.recorded_bytes += recorded.nbytes
        step.replay, step.hidden = recorded.replay, recorded.output
        logger.debug("recorded decode steps of batch %d (%s, %.1f MiB)", step.size, self._recorder.name,
                     recorded.nbytes / 2**20)
        return recorded.output

    def _size_of(self, n: int) -> _StaticStep:
        return self._steps[min(size for size in self._steps if size >= n)]

    def takes(self, n: int) -> bool:
        """Whether a step of ``n`` decode rows should run here: ``n`` fits a size that is recorded or still may
        be. A size whose recording was refused, failed or passed the budget gains nothing from the static
        buffers but costs its padding rows (a mixture of experts routes them too): its steps run as without
        recordings."""
        if n > self.max_batch:
            return False
        step = self._size_of(n)
        return step.replay is not None or not step.settled

    def _run_eager(self, step: _StaticStep) -> torch.Tensor:
        metas = [step.metas[g] for g in self._layer_groups]
        return self._forward(step.input_ids, step.positions, self._kv_caches, metas)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata]
            ) -> torch.Tensor:
        """The forward's output rows (hidden states) of a step of n <= max_batch decodes laid out by the attention
        backend (``metas``: per KV cache group)."""
        n = metas[0].num_decodes
        step = self._size_of(n)
        step.input_ids[:n].copy_(input_ids)
        step.positions[:n].copy_(positions)
        for static, meta in zip(step.metas, metas):
            width = meta.decode_block_table.shape[1]
            static.slot_mapping[:n].copy_(meta.slot_mapping)
            static.decode_block_table[:n, :width].copy_(meta.decode_block_table)
            static.decode_context_lens[:n].copy_(meta.decode_context_lens)
        if n < step.size:
            # Rows n.. still hold the previous replay's values: reset them to padding. Skipped when there are
            # none: each op costs a few microseconds even on no rows, and a speculative step at batch 1 runs
            # the draft's single-row steps k - 1 times.
            step.input_ids[n:].zero_()
            step.positions[n:].zero_()
            for static in step.metas:
                static.slot_mapping[n:].fill_(self._null_slot)
                static.decode_block_table[n:, 0].fill_(self._null_block)
                static.decode_context_lens[n:].fill_(1)
        padded = self._row_mask is not None and n < step.size
        if padded:
            self._row_mask[n:step.size].zero_()
        try:
            return self._run(step, n)
        finally:
            if padded:
                self._row_mask[n:step.size].fill_(1)

    def _run(self, step: _StaticStep, n: int) -> torch.Tensor:
        if step.replay is not None:
            try:
                step.replay()
                return step.hidden[:n]
            except ReplayFailed:
                # Not this step's requests' fault: the size goes eager for good, and the step is run again
                # eagerly (rewriting whatever K/V the failed replay wrote); an eager failure raises as ever.
                logger.exception("replaying decode steps of batch %d failed; they run eagerly now", step.size)
                step.replay = step.hidden = None
        if self._recorder is not None and not step.settled and step.eager_runs:
            return self._record(step)[:n]
        step.eager_runs += 1
        return self._run_eager(step)[:n]
