"""Two real ranks on gloo (one CPU thread each): the collectives, and the
tiny Llama split over both gives the logits of the unsplit model.

This is the layers' own proof; the engine-level TP tests come with the
multi-process executor."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.core.request import Request
from octavo.core.step_state import ScheduledRow
from octavo.distributed.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from octavo.distributed.parallel_state import ParallelState, init_model_parallel, parallel_state
from octavo.model.backends import ModelBackends
from octavo.model.loader import load_model
from octavo.quant.onthefly import OnTheFlyScheme
from octavo.sampling_params import SamplingParams
from octavo.worker.input_batch import prepare_inputs
from tests.model_factory import make_variant

WORLD = 2


def _logits(folder: Path, prompts: list[list[int]], quantization: Optional[str] = None) -> Optional[torch.Tensor]:
    """Every position's logits of a step prefilling ``prompts``, with this
    process's parallel state; ``quantization``: int8/int4 on the fly."""
    backend = TorchSdpaBackend({None})
    backends = ModelBackends(attention=backend)
    if quantization is not None:
        # Groups of 32: the row-parallel layers' shards have 32 and 64 in-features.
        backends = ModelBackends(attention=backend, quantization=OnTheFlyScheme(quantization, 32, (), head="int8"))
    model, arch = load_model(folder, "float32", backends=backends)
    attn = model.model.layers[0].self_attn
    caches = [LayerKVCache(torch.zeros(2, 16, 16, attn.num_kv_heads, arch.head_dim)) for _ in range(arch.num_layers)]
    scheduled, next_block = [], 0
    for i, prompt in enumerate(prompts):
        blocks = list(range(next_block, next_block + -(-len(prompt) // 16)))
        next_block += len(blocks)
        scheduled.append(ScheduledRow(Request(str(i), prompt, SamplingParams()), 0, len(prompt), [blocks], True))
    inputs = prepare_inputs(scheduled, 16, backend, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, caches, inputs.attn * len(caches))
        return model.compute_logits(hidden)


def _rank(rank: int, port: int, folder: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        state = init_model_parallel(WORLD)
        assert (state.tp_rank, state.tp_size) == (rank, WORLD)
        x = torch.full((2, 3), float(rank + 1))
        assert torch.equal(tensor_model_parallel_all_reduce(x.clone()), torch.full((2, 3), 3.0))
        gathered = tensor_model_parallel_all_gather(x, dim=-1)
        assert torch.equal(gathered, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], dim=-1))

        prompts = [[0, 17, 250, 33, 480, 91, 5], [0, 400, 3, 3, 77, 12, 18, 90, 4, 8, 1, 300]]
        split = _logits(folder, prompts)
        with parallel_state(ParallelState()):
            whole = _logits(folder, prompts)
        _assert_same(rank, split, whole, "unquantized")
        # Quantized: the ranks hold the unsplit model's integers (row-parallel
        # int8 layers share each row's scale), so the split model is the same too.
        for quantization in ("int8", "int4"):
            split = _logits(folder, prompts, quantization)
            with parallel_state(ParallelState()):
                whole = _logits(folder, prompts, quantization)
            _assert_same(rank, split, whole, quantization)
    finally:
        dist.destroy_process_group()


def _assert_same(rank: int, split: Optional[torch.Tensor], whole: torch.Tensor, what: str) -> None:
    if rank != 0:
        assert split is None  # the logits are gathered on the driver rank only
        return
    assert split.shape == whole.shape
    diff = (split - whole).abs().max().item()
    assert diff < 1e-5, f"{what}: TP={WORLD} logits differ from TP=1 by {diff}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_unsplit_models_logits(tmp_path):
    # 4 heads, 2 KV heads, vocab 512: one KV head per rank. Odd vocab and replicated KV heads
    # are covered by the sharding tests (tests/model/test_parallel_layers.py).
    mp.start_processes(_rank, args=(_free_port(), make_variant(tmp_path, "llama")), nprocs=WORLD, join=True, start_method="spawn")
