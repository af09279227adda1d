"""Recorded decode steps for a model the worker runs, the target or a draft (octavo/worker/decode_graphs.py):
whether its steps can be recorded, which batch sizes, and with which recorder (CUDA graphs on a GPU, kernel
tapes on a CPU).

A "decode step" is any step whose rows all run through the backend's paged decode kernel: single-token decodes,
and the short rows of speculative verification and of a draft's catch-up (``StepLayout.num_short``), each of
which attends as the decode of its own token would. So a recording of n rows serves n plain decodes as well as
n / (k + 1) requests verifying k proposals each.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from octavo.attention.base import AttentionBackend
from octavo.attention.kv_quant import LayerKVCache
from octavo.model.layers.moe import has_experts
from octavo.model.models.causal_lm import CausalLM
from octavo.worker.decode_graphs import CudaGraphRecorder, DecodeGraphs, Forward, capture_sizes
from octavo.worker.kernel_tape import TAPE_MAX_BATCH, TAPE_MEMORY_BUDGET, TapeRecorder

logger = logging.getLogger(__name__)

# The most rows a CUDA graph is captured for (all sizes are captured at start-up).
CUDA_GRAPH_MAX_ROWS = 256


def can_record(model: CausalLM, backend: AttentionBackend, device: torch.device, enforce_eager: bool) -> bool:
    """Whether ``model``'s decode steps can be recorded on ``device``: with a backend that records there, unless
    the config asks for eager steps, and on a GPU without experts (their products there read each expert's row
    count back, quant/moe.py, which no CUDA graph can hold). On a CPU a mixture's steps of few rows record whole,
    routing included (the grouped experts kernels take the chosen experts as tensor data, quant/moe.py); a size
    of more rows reads counts back, its recording is refused and it runs eagerly."""
    return (device.type in backend.recorded_on and not enforce_eager
            and (device.type == "cpu" or not has_experts(model)))


def record_decode_steps(forward: Forward, kv_caches: Sequence[LayerKVCache], null_block: int, block_size: int,
                        max_rows: int, longest_sequence: int, backend: AttentionBackend, device: torch.device,
                        layer_groups: Optional[Sequence[int]] = None, row_mask: Optional[torch.Tensor] = None,
                        ) -> Optional[DecodeGraphs]:
    """Recorded steps of up to ``max_rows`` decode rows (CUDA: at most ``CUDA_GRAPH_MAX_ROWS``, captured now;
    CPU: at most ``TAPE_MAX_BATCH``, where the Python around the kernels is still a noticeable share of a step,
    each size recorded on its second step within ``TAPE_MEMORY_BUDGET``). ``null_block``: the block past the
    pool the padding rows write to. A capture that fails leaves the model eager, with the reason logged, rather
    than the engine not starting. ``forward``: the model's (hidden states), or a function of the same inputs
    whose rows are what the caller needs (a draft's logits); ``row_mask``: DecodeGraphs'."""
    on_cuda = device.type == "cuda"
    recorder = CudaGraphRecorder() if on_cuda else TapeRecorder()
    sizes = capture_sizes(min(max_rows, CUDA_GRAPH_MAX_ROWS if on_cuda else TAPE_MAX_BATCH))
    try:
        with torch.inference_mode():  # as the steps that replay them run
            return DecodeGraphs(forward, kv_caches, null_block, block_size, sizes, longest_sequence, backend, device,
                                recorder, memory_budget=None if on_cuda else TAPE_MEMORY_BUDGET,
                                layer_groups=layer_groups, row_mask=row_mask)
    except Exception:
        logger.exception("recording decode steps (%s) failed; running every step eagerly", recorder.name)
        return None
