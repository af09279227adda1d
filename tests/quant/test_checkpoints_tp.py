"""Pre-quantized layers split across tensor-parallel ranks: each rank cuts
the packed tensors (packed along the inputs or the outputs, fused parts,
replicated KV heads, act-order groups that straddle ranks) and the ranks'
products add up to the whole layer's ``x @ dequant(W).T``. Then the whole
engine at tensor-parallel size 2 on GPTQ act-order and AWQ checkpoints."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from octavo.quant.checkpoint_config import parse_quantization_config
from octavo.quant.prequantized import PrequantizedLinearMethod
from tests.engine.conftest import hf_greedy
from tests.model_factory import make_tiny_model
from tests.quant.quantized_checkpoints import Quant, layer_tensors, quantization_config, quantize, write_quantized

QUANTS = {
    "gptq4-actorder": Quant("gptq", bits=4, sym=False, act_order=True, group_size=16),
    "gptq8": Quant("gptq", bits=8, group_size=16),
    "awq4": Quant("awq", bits=4, sym=False, group_size=16),
    "ct-w4a16-asym-actorder": Quant("compressed-tensors", bits=4, sym=False, act_order=True, group_size=16),
    "ct-w8a16-channel": Quant("compressed-tensors", bits=8, group_size=-1),
}


def _method(quant: Quant) -> PrequantizedLinearMethod:
    parsed = parse_quantization_config({"quantization_config": quantization_config(quant)})
    return PrequantizedLinearMethod(parsed.format_for("model.layers.0.mlp.down_proj"))


def _parts(quant: Quant, sizes: list[int], k: int, seed: int):
    """Checkpoint tensors and dequantized weights of fused parts sharing one input (one act-order)."""
    stored, weights = [], []
    for i, n in enumerate(sizes):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + i))
        known = quantize(w, quant, torch.float16, seed=seed)
        stored.append(layer_tensors(known, quant, n, k))
        weights.append(known.dequantized())
    return stored, torch.cat(weights)


def _rank_outputs(make_layer, tp: int, parts: list[dict], shard_ids: list, x_for_rank):
    outs = []
    for rank in range(tp):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=tp)):
            layer = make_layer()
        for shard_id, tensors in zip(shard_ids, parts):
            for name, tensor in tensors.items():
                param = getattr(layer, name)
                if shard_id is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
        layer.finish_loading()
        outs.append(layer.linear_method.apply(layer, x_for_rank(rank), None))
    return outs


@pytest.mark.parametrize("name", QUANTS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shards_add_up_to_the_layer(name, tp):
    quant, x = QUANTS[name], torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    # q/k/v with 4 query heads and 2 KV heads of 16: at tp 4 each KV head is on two ranks.
    parts, w = _parts(quant, [64, 32, 32], 64, seed=1)
    outs = _rank_outputs(lambda: QKVParallelLinear(64, 16, 4, 2, False, _method(quant)), tp, parts, "qkv",
                         lambda rank: x)
    want = x @ w.T
    q, kv = 64 // tp, 32 // min(tp, 2)
    for rank, out in enumerate(outs):
        head = rank * 2 // max(tp, 2)  # the KV shard this rank holds
        torch.testing.assert_close(out[:, :q], want[:, rank * q:(rank + 1) * q], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[:, q:q + kv], want[:, 64 + head * kv:64 + (head + 1) * kv], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[:, q + kv:], want[:, 96 + head * kv:96 + (head + 1) * kv], atol=1e-4, rtol=0)

    parts, w = _parts(quant, [64, 64], 64, seed=2)
    outs = _rank_outputs(lambda: MergedColumnParallelLinear(64, [64, 64], False, _method(quant)), tp, parts,
                         [0, 1], lambda rank: x)
    half = 64 // tp
    gate = torch.cat([o[:, :half] for o in outs], 1)
    up = torch.cat([o[:, half:] for o in outs], 1)
    torch.testing.assert_close(torch.cat([gate, up], 1), x @ w.T, atol=1e-4, rtol=0)

    # Row-parallel: input features split; act-order groups of 16 scattered over 128 straddle ranks.
    xr = torch.randn(5, 128, generator=torch.Generator().manual_seed(10))
    parts, w = _parts(quant, [64], 128, seed=3)
    outs = _rank_outputs(lambda: RowParallelLinear(128, 64, False, _method(quant)), tp, parts, [None],
                         lambda rank: xr[:, rank * 128 // tp:(rank + 1) * 128 // tp])
    torch.testing.assert_close(sum(outs), xr @ w.T, atol=1e-4, rtol=0)


def test_a_group_split_between_ranks_is_refused_where_no_g_idx_can_say_so():
    quant = Quant("awq", bits=4, sym=False, group_size=32)
    with parallel_state(ParallelState(tp_rank=0, tp_size=8)):
        with pytest.raises(ValueError, match="group_size 32 does not divide the 16 input features .* split "
                                             "between ranks"):
            RowParallelLinear(128, 64, False, _method(quant))


@pytest.mark.parametrize("name", ["gptq4-actorder", "awq4"])
def test_engine_at_tensor_parallel_2_matches_transformers(name, tmp_path):
    base = make_tiny_model(tmp_path / "base", "qwen2", num_key_value_heads=1, vocab_size=511)
    folder, reference = write_quantized(base, tmp_path / name, QUANTS[name])
    prompts = [[5, 17, 250, 33, 480, 91], list(range(100, 131))]
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, threads_per_worker=1, num_blocks=16, block_size=8,
              quantized_activations="float")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=12)
