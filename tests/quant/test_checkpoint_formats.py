"""Pre-quantized layouts, one layer at a time: packed words unpack to the
integers that were packed (round trips exact, and the published spec
vectors), each format's tensors unpack to the layer's known integers and
dequantize to exactly its dequantized weight, and quantization_config
settings the loader does not read are errors naming the key."""
from __future__ import annotations

import pickle

import pytest
import torch

from octavo.model.models.causal_lm import CausalLM
from octavo.quant.checkpoint_config import parse_quantization_config
from octavo.quant.formats.base import LayerShape
from octavo.quant.formats.int_weight import IntWeight, with_group_index
from octavo.quant.formats.packing import unpack_int32
from octavo.quant.prequantized import CheckpointScheme
from octavo.quant.unquantized import UniformScheme
from tests.quant.quantized_checkpoints import AWQ_ORDER, Quant, layer_tensors, pack_words, quantization_config, quantize


@pytest.mark.parametrize("bits, dim, order", [
    (4, 0, None), (4, 1, None), (8, 0, None), (8, 1, None),
    (4, 1, AWQ_ORDER), (4, 0, AWQ_ORDER),  # the AWQ order is a 4-bit layout
])
def test_pack_unpack_round_trip(bits, dim, order):
    values = torch.randint(0, 2**bits, (24, 40), generator=torch.Generator().manual_seed(bits + dim))
    packed = pack_words(values, bits, dim, order)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == values.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(packed, bits, dim, order), values.to(torch.uint8))


def test_published_spec_vectors():
    # AWQ GEMM: output features 0..7 holding 0..7 land in fields 0,4,1,5,2,6,3,7.
    assert unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 4, 1, AWQ_ORDER).tolist() == [
        list(range(8))]
    # GPTQ v1 symmetric int4: every zero point 8 is stored as 7 (0x77777777).
    assert (unpack_int32(torch.tensor([[0x77777777]], dtype=torch.int32), 4, 1) + 1).tolist() == [[8] * 8]
    # compressed-tensors pack_to_int32's docstring: int8 values [1, 2] (stored 129, 130) -> 33409.
    assert unpack_int32(torch.tensor([[33409]], dtype=torch.int32), 8, 1)[0, :2].tolist() == [129, 130]
    # A set sign bit is a field like any other, not a negative number.
    assert unpack_int32(torch.tensor([[-1]], dtype=torch.int32), 4, 1).tolist() == [[15] * 8]


CASES = [
    Quant("gptq", bits=4, sym=True),
    Quant("gptq", bits=4, sym=False),
    Quant("gptq", bits=4, sym=True, act_order=True),
    Quant("gptq", bits=8, sym=False, act_order=True),
    Quant("gptq", bits=8, group_size=-1),
    Quant("gptq", bits=4, sym=False, checkpoint_format="gptq_v2"),
    Quant("awq", bits=4, sym=False),
    Quant("awq", bits=4, sym=False, group_size=-1),
    Quant("compressed-tensors", bits=4, sym=True),
    Quant("compressed-tensors", bits=4, sym=False, act_order=True),
    Quant("compressed-tensors", bits=8, group_size=-1),
    Quant("compressed-tensors", bits=8, sym=False),
]


def _ids(quant: Quant) -> str:
    return (f"{quant.method}-{quant.bits}bit-g{quant.group_size}-{'sym' if quant.sym else 'asym'}"
            f"{'-actorder' if quant.act_order else ''}{'-v2' if quant.checkpoint_format == 'gptq_v2' else ''}")


def _format(quant: Quant):
    parsed = parse_quantization_config({"quantization_config": quantization_config(quant)})
    return parsed.format_for("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("quant", CASES, ids=_ids)
def test_layer_unpacks_to_its_known_integers(quant):
    n, k = 48, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    known = quantize(w, quant, torch.float16, seed=5)
    fmt = _format(quant)
    shape = LayerShape(k, (n,))
    stored = layer_tensors(known, quant, n, k)
    specs = {spec.name: spec for spec in fmt.tensors(shape)}
    assert set(specs) == set(stored)  # the checkpoint's tensor names, no more, no fewer
    for name, tensor in stored.items():
        assert tuple(tensor.shape) == specs[name].shape, name
    weight = fmt.unpack({name: t.to(specs[name].dtype) for name, t in stored.items()}, shape)
    assert torch.equal(weight.dequantize(), known.dequantized())
    perm = torch.arange(k) if weight.perm is None else weight.perm
    assert torch.equal(weight.q.long(), known.q[:, perm])
    assert (weight.perm is not None) == quant.act_order


def test_act_order_sorts_columns_into_whole_groups():
    q = torch.randint(0, 16, (4, 8), dtype=torch.int32)
    scales, zeros = torch.rand(4, 2) + 0.5, torch.randint(0, 16, (4, 2), dtype=torch.int32)
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0])
    weight = with_group_index(q, scales, zeros, g_idx, group_size=4, bits=4)
    assert weight.perm.tolist() == [1, 3, 4, 7, 0, 2, 5, 6]
    expected = (q - zeros[:, g_idx]) * scales[:, g_idx]
    assert torch.equal(weight.dequantize(), expected)
    # A rank holding 3 of a group's 4 features cannot run it as a group:
    # each column keeps its own group's scale and zero point.
    split = with_group_index(q[:, :6], scales, zeros, g_idx[:6], group_size=4, bits=4)
    assert split.group_size == 1 and split.perm is None
    assert torch.equal(split.dequantize(), expected[:, :6])


def test_int_weight_checks_its_shapes():
    with pytest.raises(ValueError, match="scales has shape"):
        IntWeight(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 3), torch.zeros(4, 2, dtype=torch.int32), 4, 4)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; supported: gptq, awq"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3 is not supported; supported: 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head True is not supported"),
    ({"quant_method": "gptq", "bits": 4, "format": "bitblas"}, "checkpoint_format 'bitblas'"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format True"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}}, "dynamic is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be a positive integer or -1"),
    ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "bits 8 is not supported; supported: 4"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv' is not supported; supported: 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point False is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {}}},
     "format 'float-quantized' is not supported; supported: 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": {"num_bits": 8}}}},
     r"config_groups.g.input_activations.dynamic False is not supported; supported: True"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}},
     r"config_groups.g.weights.type 'float' is not supported; supported: 'int'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "strategy": "tensor"}}}}, "strategy 'tensor' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "config_groups must name at least one"),
])
def test_unsupported_settings_name_the_key_and_what_is_supported(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config({"quantization_config": qc})


def test_which_modules_are_quantized():
    gptq = parse_quantization_config({"quantization_config": quantization_config(
        Quant("gptq", skip=("mlp.down_proj",)))})
    assert gptq.format_for("model.layers.3.self_attn.q_proj") is not None
    assert gptq.format_for("model.layers.3.mlp.down_proj") is None
    assert gptq.format_for("lm_head") is None
    ct = parse_quantization_config({"quantization_config": quantization_config(
        Quant("compressed-tensors", skip=("mlp.down_proj",)))})
    assert ct.format_for("model.layers.0.mlp.up_proj") is not None
    assert ct.format_for("model.layers.0.mlp.down_proj") is None
    assert ct.format_for("lm_head") is None
    assert parse_quantization_config({}) is None
    # ArchConfig carries this; it must survive the trip to a rank process.
    again = pickle.loads(pickle.dumps(ct))
    assert again.format_for("model.layers.0.mlp.down_proj") is None
    assert again.format_for("model.layers.0.mlp.up_proj").describe() == "compressed-tensors int4 group 32"


def test_compressed_tensors_groups_pick_formats_per_module():
    """llm-compressor may quantize module groups differently (W8A16 attention, W4A16 MLP)."""
    qc = quantization_config(Quant("compressed-tensors", bits=4))
    w8 = {**qc["config_groups"]["group_0"], "targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"],
          "weights": {**qc["config_groups"]["group_0"]["weights"], "num_bits": 8, "strategy": "channel"}}
    qc["config_groups"] = {"attention": w8, "rest": {**qc["config_groups"]["group_0"], "targets": ["Linear"]}}
    parsed = parse_quantization_config({"quantization_config": qc})
    assert parsed.format_for("model.layers.0.self_attn.k_proj").describe() == "compressed-tensors int8 per-channel"
    assert parsed.format_for("model.layers.0.mlp.gate_proj").describe() == "compressed-tensors int4 group 32"


def test_a_quantized_lm_head_is_refused():
    qc = quantization_config(Quant("compressed-tensors"))
    qc["ignore"] = []
    scheme = CheckpointScheme(parse_quantization_config({"quantization_config": qc}),
                              CausalLM.packed_modules_mapping, UniformScheme())
    assert scheme.linear_method("model.layers.0.mlp.gate_up_proj").fmt.describe() == "compressed-tensors int4 group 32"
    with pytest.raises(ValueError, match="a quantized lm_head is not supported"):
        scheme.linear_method("lm_head")
