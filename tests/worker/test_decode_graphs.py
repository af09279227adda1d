"""Decode steps through DecodeGraphs' static buffers (what a CUDA graph or a kernel tape replays) give the hidden
states and K/V writes of the eager step: padding rows touch only the null block, and a smaller step after a larger
one is not disturbed by the rows the larger one left in the buffers. The CUDA backend's form runs eagerly, its
Triton kernel in Triton's interpreter; the CPU's records kernel tapes (each size on its second step) and replays
them, keeps a size eager when its recording is refused or would pass the memory budget."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from octavo.attention.kv_quant import allocate_layer_cache
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.core.request import Request
from octavo.core.step_state import ScheduledRow
from octavo.kernels.fused_ops import fused_ops
from octavo.model.layers.elementwise import NativeElementwiseOps
from octavo.model.backends import ModelBackends
from octavo.model.loader import load_model
from octavo.sampling_params import SamplingParams
from octavo.worker.decode_graphs import DecodeGraphs, capture_sizes
from octavo.worker.input_batch import prepare_inputs
from octavo.worker.kernel_tape import KernelReplayError, TapeRecorder
from tests.model_factory import make_tiny_model


BLOCK, NUM_BLOCKS, MAX_LEN = 4, 24, 64
CPU = torch.device("cpu")


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[-1] == 256 and all(min(s for s in sizes if s >= n) - n < 8 for n in range(1, 257))


def _decode_step(contexts: list[int], seed: int, queries: Optional[list[int]] = None):
    """Request i computes the last ``queries[i]`` (default 1) of its ``contexts[i]`` positions: more than one
    is a speculative verification's k + 1 rows, which run as decode rows (``StepLayout.num_short``)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    rows = []
    for i, context in enumerate(contexts):
        blocks = [order.pop() for _ in range(-(-context // BLOCK))]
        tokens = torch.randint(0, 100, (context,), generator=gen).tolist()
        q = queries[i] if queries else 1
        rows.append(ScheduledRow(Request(f"r{i}", tokens, SamplingParams()), context - q, q, [blocks], True))
    return rows


def _triton_backend():
    pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
    if torch.cuda.is_available():
        pytest.skip("the CPU (interpreter) form of this check; on a GPU tests/cuda replay real graphs")
    from octavo.attention.triton_cuda import TritonBackend

    return TritonBackend({None}), None


def _tapes():
    return NativeCpuBackend.create({None}, required=True), TapeRecorder()


# Six rows, five in the same size-6 buffers (its last row left over), six again (recorded on the second
# size-6 step), five (replayed), then one, twice.
STEPS = (([30, 17, 9, 5, 2, 11], 1), ([21, 3, 8, 14, 6], 2), ([31, 18, 10, 6, 3, 12], 4), ([22, 4, 9, 15, 7], 5),
         ([40], 3), ([41], 6))
# Verification steps: requests of 2-4 rows; 5 rows (padded to 6), 6, 5 (replayed), then 4 rows twice.
VERIFY_STEPS = (([30, 17], 1, [3, 2]), ([31, 19], 2, [3, 3]), ([33, 20], 4, [2, 3]), ([40], 3, [4]), ([44], 6, [4]))


def _run_steps(tmp_path, make_backend, forward_wrap=lambda f: f, memory_budget=None, before_step=None, steps=STEPS):
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    backend, recorder = make_backend()
    model, arch = load_model(folder, "float32", CPU, MAX_LEN, ModelBackends(
        attention=backend, ops=NativeElementwiseOps(fused_ops(required=True))))
    layer = model.local_layers[0].self_attn
    null_block = NUM_BLOCKS  # the pool the scheduler sees is 0 .. NUM_BLOCKS-1

    def caches(seed: int):
        gen = torch.Generator().manual_seed(seed)
        made = [allocate_layer_cache(NUM_BLOCKS + 1, BLOCK, layer.num_kv_heads, arch.head_dim, torch.float32, CPU)
                for _ in model.local_layers]
        for cache in made:
            cache.data[:, :NUM_BLOCKS].copy_(torch.randn(cache.data[:, :NUM_BLOCKS].shape, generator=gen))
        return made

    eager_caches, static_caches = caches(0), caches(0)
    with torch.inference_mode():
        graphs = DecodeGraphs(forward_wrap(model), static_caches, null_block, BLOCK, capture_sizes(6), MAX_LEN,
                              backend, CPU, recorder, memory_budget)
        for index, step in enumerate(steps):
            if before_step is not None:
                before_step(graphs, index)
            inputs = prepare_inputs(_decode_step(*step), BLOCK, backend, CPU)
            assert not inputs.attn[0].prefills  # every row a decode row, verification rows too
            want = model(inputs.input_ids, inputs.positions, eager_caches, inputs.attn * len(eager_caches))
            got = graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for eager, static in zip(eager_caches, static_caches):
        # Not bit-equal: the padded batch's matmuls round differently from the unpadded one's.
        torch.testing.assert_close(static.data[:, :NUM_BLOCKS], eager.data[:, :NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        assert static.data[:, null_block].abs().sum() > 0  # the padding rows wrote there, and only there
    return graphs


@pytest.mark.parametrize("make_backend", [_triton_backend, _tapes], ids=["triton-static-buffers", "cpu-tapes"])
def test_static_step_matches_the_eager_step(tmp_path, make_backend):
    graphs = _run_steps(tmp_path, make_backend)
    if make_backend is _tapes:
        assert graphs.recorded_sizes == [1, 6] and graphs.recorded_bytes > 0


@pytest.mark.parametrize("make_backend", [_triton_backend, _tapes], ids=["triton-static-buffers", "cpu-tapes"])
def test_verification_steps_replay_as_the_eager_step(tmp_path, make_backend):
    """A speculative step (k + 1 rows per request, over its cached context) runs through the buffers and
    recordings of a decode step of as many rows, as the target's verification and a draft's catch-up do."""
    graphs = _run_steps(tmp_path, make_backend, steps=VERIFY_STEPS)
    if make_backend is _tapes:
        assert graphs.recorded_sizes == [4, 6]


def test_a_size_whose_recording_passes_the_budget_stays_eager(tmp_path):
    graphs = _run_steps(tmp_path, _tapes, memory_budget=1)
    assert graphs.recorded_sizes == [] and graphs.recorded_bytes == 0


def test_a_refused_recording_leaves_the_size_eager_and_its_step_right(tmp_path):
    def reads_a_value(model):
        def forward(*args):
            hidden = model(*args)
            hidden.abs().max().item()  # Python reads the step's data: a replay could not
            return hidden
        return forward

    graphs = _run_steps(tmp_path, _tapes, forward_wrap=reads_a_value)
    assert graphs.recorded_sizes == []


def test_a_failing_replay_runs_its_step_eagerly_and_leaves_the_size_eager(tmp_path):
    def sabotage(graphs, index):
        if index == 3:  # the size-6 step recorded at step 2 fails its next replay
            def failing():
                raise KernelReplayError("octavo_paged_decode returned -1, recorded 0")
            graphs._steps[6].replay = failing

    graphs = _run_steps(tmp_path, _tapes, before_step=sabotage)  # every step still equals the eager one
    assert graphs.recorded_sizes == [1]
