"""Decode steps through DecodeGraphs' static buffers (what a CUDA graph replays) give the hidden states and K/V
writes of the eager step: padding rows touch only the null block, and a smaller step after a larger one is not
disturbed by the rows the larger one left in the buffers. On CPU the static step runs eagerly; the attention is
the CUDA backend's Triton kernel in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from octavo.attention.kv_quant import allocate_layer_cache
from octavo.core.request import Request
from octavo.core.step_state import ScheduledRow
from octavo.model.backends import ModelBackends
from octavo.model.loader import load_model
from octavo.sampling_params import SamplingParams
from octavo.worker.decode_graphs import DecodeGraphs, capture_sizes
from octavo.worker.input_batch import prepare_inputs
from tests.model_factory import make_tiny_model

pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
from octavo.attention.triton_cuda import TritonBackend  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 24, 64
CPU = torch.device("cpu")


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[-1] == 256 and all(min(s for s in sizes if s >= n) - n < 8 for n in range(1, 257))


def _decode_step(contexts: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    rows = []
    for i, context in enumerate(contexts):
        blocks = [order.pop() for _ in range(-(-context // BLOCK))]
        tokens = torch.randint(0, 100, (context,), generator=gen).tolist()
        rows.append(ScheduledRow(Request(f"r{i}", tokens, SamplingParams()), context - 1, 1, blocks, True))
    return rows


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the CPU (interpreter) form of this check; on a GPU tests/cuda replay real graphs")
def test_static_step_matches_the_eager_step(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    backend = TritonBackend({None})
    model, arch = load_model(folder, "float32", CPU, MAX_LEN, ModelBackends(attention=backend))
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
    graphs = DecodeGraphs(model, static_caches, null_block, BLOCK, max_batch=6, max_model_len=MAX_LEN,
                          device=CPU, capture=False)
    with torch.inference_mode():
        # Six rows, then five in the same size-6 buffers (its last row left over from the first step), then one.
        for contexts, seed in (([30, 17, 9, 5, 2, 11], 1), ([21, 3, 8, 14, 6], 2), ([40], 3)):
            inputs = prepare_inputs(_decode_step(contexts, seed), BLOCK, backend, CPU)
            want = model(inputs.input_ids, inputs.positions, eager_caches, inputs.attn)
            got = graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for eager, static in zip(eager_caches, static_caches):
        # Not bit-equal: the padded batch's matmuls round differently from the unpadded one's.
        torch.testing.assert_close(static.data[:, :NUM_BLOCKS], eager.data[:, :NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        assert static.data[:, null_block].abs().sum() > 0  # the padding rows wrote there, and only there
