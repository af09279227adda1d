"""A mixture of experts' products in one call per product (quant/moe.py's GroupedProducts): at decode
the experts kernels of qdot_linear.c (int8/int4 weights, int8-rounded rows) and bf16_linear.c (bf16
weights), under every CPU target this machine runs, against torch references; at many rows an expert
the AMX ones (bf16 experts prepacked, quantized ones dequantized onto tiles; their kernels:
tests/kernels/test_amx_experts.py); a layer's output through them equal to its output through one
product per expert, and bf16 within rounding of the plain products."""
from __future__ import annotations

import json

import pytest
import torch

from octavo.kernels.amx_linear import amx_linear_kernel
from octavo.kernels.bf16_linear import bf16_linear_kernel
from octavo.kernels.quant_linear import quant_linear_kernel
from octavo.kernels import cpu_features
from octavo.kernels.cpu_features import TARGETS
from octavo.kernels.qdot_linear import qdot_linear_kernel
from octavo.model.config import ExpertsConfig
from octavo.model.layers.moe import FusedMoE
from octavo.model.loader import default_dtype
from octavo.quant import linear_table, moe
from octavo.quant.moe import QuantizedExperts, QuantizedMoEMethod, run_routed
from octavo.quant.onthefly import quantize_int4, quantize_int8
from octavo.quant.linear_table import LinearTable
from octavo.quant.qweights import QDOT_ROWS
from octavo.quant.unquantized import PackedMoEMethod, TableMoEMethod, can_pack
from tests.kernels.test_bf16_linear import assert_close_to_float32, runnable
from tests.quant.test_qdot import RUNNABLE, _check, _rows, _weight, needs_kernel

X86_AND_PORTABLE = [t.name for t in TARGETS if t.arch in ("x86_64", "any")]
# The expert of each row, sorted: runs of 1, 2 and 5 rows (the kernels share a weight load among up to 4).
EXPERTS = [0, 2, 2, 3, 3, 3, 3, 3]
# Rows given to each expert at many rows: none, one, past the few-row kernels' 4, Mixtral's ~8 at 32
# requests, and more than two tiles of 16.
COUNTS = [0, 1, 5, 8, 33]


def _tables(weights: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    def table(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

    mins = None if weights[0].mins is None else table([w.mins for w in weights])
    return table([w.packed for w in weights]), table([w.scales for w in weights]), mins


@needs_kernel
@pytest.mark.parametrize("target", RUNNABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["int8", "int8_zeros", "int4_g32_sym", "int4_g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdot_experts_kernel_gives_each_row_its_own_experts_product(target, kind, dtype):
    """Each row equals the torch reference of its own expert's weight, and the bits the one-expert kernel
    gives that expert's rows."""
    kernel = qdot_linear_kernel(target, required=True)
    weights = [_weight(kind) for _ in range(4)]
    for i, w in enumerate(weights):  # four different experts of one shape
        w.scales = w.scales * (1 + i)
    packed, scales, mins = _tables(weights)
    x = _rows(len(EXPERTS), weights[0].in_features, dtype, seed=7)
    experts = torch.tensor(EXPERTS)
    first = weights[0]
    out = kernel.experts(x, experts, first.bits, first.group_size, packed, scales, mins, first.out_features)
    assert out.dtype == dtype and out.shape == (len(EXPERTS), first.out_features)
    for e, w in enumerate(weights):
        rows = (experts == e).nonzero().flatten()
        if rows.numel():
            _check(out[rows], w, x[rows], None)
            alone = kernel(x[rows].contiguous(), w.bits, w.group_size, w.packed, w.scales, w.mins, None,
                           w.out_features)
            assert torch.equal(out[rows], alone), f"expert {e}"
    assert not torch.equal(out[0], out[1])  # different experts, different results
    with pytest.raises(ValueError, match=r"^experts must be int64 \[8\]"):
        kernel.experts(x, experts[:3], first.bits, first.group_size, packed, scales, mins, first.out_features)


@pytest.mark.parametrize("target_name", X86_AND_PORTABLE)
def test_bf16_experts_kernel_gives_each_row_its_own_experts_product(target_name):
    kernel = bf16_linear_kernel(runnable(target_name), required=True)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(4, 40, 72, generator=gen).to(torch.bfloat16)  # 40 outputs: not whole blocks of 16
    x = torch.randn(len(EXPERTS), 72, generator=gen).to(torch.bfloat16)
    experts = torch.tensor(EXPERTS)
    out = kernel.experts(x, weights, experts)
    for e in set(EXPERTS):
        rows = (experts == e).nonzero().flatten()
        assert_close_to_float32(out[rows], x[rows], weights[e], None)
    with pytest.raises(ValueError, match="weights contiguous bfloat16"):
        kernel.experts(x, weights.transpose(1, 2), experts)


def _layer(quantize, dtype: torch.dtype) -> FusedMoE:
    experts = ExpertsConfig(num_experts=6, top_k=2, intermediate_size=64, renormalize=True)
    method = None if quantize is None else QuantizedMoEMethod(quantize, lambda n, where: None, "experts")
    with default_dtype(dtype):
        layer = FusedMoE(experts, hidden=96, act="silu", names=("gate_proj", "up_proj", "down_proj"), method=method)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    layer.finish_loading()
    return layer


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    return weights / weights.sum(dim=1, keepdim=True), ids


def _as_chosen(layer: FusedMoE) -> tuple:
    """Per-expert products that take the kernel the layer's grouped calls choose for an expert of that many
    rows: the integer dot products on int8 rows up to ``grouped.max_rows``, else the expert's own product
    (AMX tiles for bf16 rows past FMA_ROWS where the CPU has them)."""
    experts: QuantizedExperts = layer.prepared
    most = experts.grouped.max_rows

    def of(weights: list) -> object:
        def product(e: int) -> object:
            w = weights[e]
            return lambda rows: (w.qdot(rows.contiguous(), w.bits, w.group_size, w.packed, w.scales, w.mins, None,
                                        w.out_features) if rows.shape[0] <= most else w(rows))
        return product

    return of(experts.gate_up), of(experts.down)


@needs_kernel
@pytest.mark.parametrize("quantize", [quantize_int8, lambda w: quantize_int4(w, 32)], ids=["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdot_rows", [QDOT_ROWS, 16])
def test_quantized_layer_through_grouped_products_equals_one_product_per_expert(quantize, dtype, qdot_rows,
                                                                                monkeypatch):
    """Decode (every expert given few rows) and a larger batch (some experts given more rows than the
    grouped kernel takes: those run on the AMX call or on their own) give the bits of one call per expert
    on the kernel chosen for its rows, whichever number of rows the measured table let the integer dot
    products take."""
    monkeypatch.setattr(moe, "qdot_rows_per_expert", lambda qdot, amx: qdot_rows)
    layer = _layer(quantize, dtype)
    experts: QuantizedExperts = layer.prepared
    assert experts.grouped is not None
    if experts.many is not None:
        assert experts.grouped.max_rows == qdot_rows and experts.many.min_rows == qdot_rows + 1
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        weights, ids = _routing(tokens, tokens)
        assert torch.equal(layer(x, weights, ids), run_routed(layer, x, weights, ids, *_as_chosen(layer))), \
            f"{tokens} tokens"


@pytest.mark.skipif(bf16_linear_kernel() is None, reason="no C compiler: the kernel cannot be built")
def test_bf16_layer_through_grouped_products_stays_within_bf16_rounding_of_float64():
    layer = _layer(None, torch.bfloat16)
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        weights, ids = _routing(tokens, tokens)
        expected = torch.zeros(tokens, 96, dtype=torch.float64)
        for t in range(tokens):
            for k in range(2):
                w13, w2 = layer.w13_weight[ids[t, k]].double(), layer.w2_weight[ids[t, k]].double()
                gate, up = (x[t].double() @ w13.T).chunk(2)
                expected[t] += weights[t, k] * ((torch.nn.functional.silu(gate) * up) @ w2.T)
        got = layer(x, weights, ids).double()
        # bf16 roundings of the gate/up products, the activation and the result: a few bf16 steps.
        assert (got - expected).abs().max() <= 2**-6 * expected.abs().max(), f"{tokens} tokens"


def _counted_layer(method) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    """A bf16 layer of len(COUNTS) experts, one per token, and its plain stacked weights (cloned before
    loading finishes: a prepacking method releases them)."""
    experts = ExpertsConfig(num_experts=len(COUNTS), top_k=1, intermediate_size=64, renormalize=False)
    with default_dtype(torch.bfloat16):
        layer = FusedMoE(experts, hidden=96, act="silu", names=("gate_proj", "up_proj", "down_proj"), method=method)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    layer.finish_loading()
    return layer, w13, w2


def _counted_routes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weights, ids): expert e chosen by COUNTS[e] tokens, in a shuffled order."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([e for e, count in enumerate(COUNTS) for _ in range(count)])
    ids = ids[torch.randperm(len(ids), generator=gen)].unsqueeze(1)
    x = torch.randn(len(ids), 96, generator=gen).to(torch.bfloat16)
    return x, torch.rand(len(ids), 1, generator=gen) + 0.5, ids


def _bf16_method(kind: str, tmp_path):
    """The experts' method a bf16 engine gets: prepacked for oneDNN (with the AMX kernel where the CPU has it), or,
    as on CPUs without AMX, plain weights multiplied by the ways a measured table picks."""
    if kind == "packed":
        if not can_pack(torch.device("cpu"), torch.bfloat16):
            pytest.skip("needs a CPU with oneDNN bf16 support (AVX-512)")
        return PackedMoEMethod(amx_linear_kernel())
    if bf16_linear_kernel() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    return TableMoEMethod(LinearTable(path=tmp_path / "table.json"))


@pytest.mark.parametrize("kind", ["packed", "table"])
def test_bf16_experts_give_the_plain_products_at_many_rows(kind, tmp_path):
    """Experts given 0 to 33 rows, within bf16 rounding of per-expert F.linear on the plain weights. Prepacked
    (the plain weights released; the AMX kernel for all the experts in one call where the CPU has it): the
    bits of one packed product per expert. On the table: the plain weights kept."""
    _check_bf16_experts(kind, tmp_path)


@pytest.mark.parametrize("target_name", X86_AND_PORTABLE)
def test_table_planned_experts_under_each_target(target_name, monkeypatch, tmp_path):
    """The table's ways and the few-row kernel as each CPU target builds them (forced as OCTAVO_CPU_TARGET
    would; the table measured afresh)."""
    runnable(target_name)
    monkeypatch.setenv("OCTAVO_CPU_TARGET", target_name)
    cpu_features.cpu_target.cache_clear()
    try:
        _check_bf16_experts("table", tmp_path)
    finally:
        monkeypatch.delenv("OCTAVO_CPU_TARGET")
        cpu_features.cpu_target.cache_clear()


def _check_bf16_experts(kind: str, tmp_path) -> None:
    layer, w13, w2 = _counted_layer(_bf16_method(kind, tmp_path))
    x, weights, ids = _counted_routes()
    out = layer(x, weights, ids)
    if kind == "packed":
        assert layer.w13_weight.is_meta and layer.w2_weight.is_meta  # replaced, not duplicated
        assert (layer.prepared.grouped is not None) == (amx_linear_kernel() is not None)
        assert torch.equal(out, run_routed(layer, x, weights, ids, *layer.method.products(layer)))
    else:
        assert not layer.w13_weight.is_meta and "(experts)" in layer.method.kernel_name(layer)
    plain = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(len(COUNTS)):
        rows = (ids[:, 0] == e).nonzero().flatten()
        gate, up = torch.nn.functional.linear(x[rows], w13[e]).chunk(2, dim=-1)
        down = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        plain[rows] = down.float() * weights[rows]
    # The kernels sum in another order than F.linear: a few bf16 steps of the result.
    assert (out.float() - plain).abs().max() <= 2**-6 * plain.abs().max()


@needs_kernel
@pytest.mark.parametrize("quantize", [quantize_int8, lambda w: quantize_int4(w, 32)], ids=["int8", "int4"])
@pytest.mark.parametrize("qdot_rows", [QDOT_ROWS, 16])
def test_quantized_experts_at_many_rows_give_one_product_per_experts_bits(quantize, qdot_rows, monkeypatch):
    """Experts given 0 to 33 rows: those past the rows the integer dot products take go through one AMX call
    for all of them where the CPU has AMX (else one product each): the bits of one product per expert on
    the kernel chosen for its rows either way."""
    monkeypatch.setattr(moe, "qdot_rows_per_expert", lambda qdot, amx: qdot_rows)
    layer, _, _ = _counted_layer(QuantizedMoEMethod(quantize, lambda n, where: None, "experts"))
    kernel = quant_linear_kernel()
    assert (layer.prepared.many is not None) == (kernel is not None and kernel.has_amx)
    x, weights, ids = _counted_routes()
    assert torch.equal(layer(x, weights, ids), run_routed(layer, x, weights, ids, *_as_chosen(layer)))


@needs_kernel
def test_rows_the_integer_dot_products_take_are_measured_once_per_shape_and_kept(monkeypatch, tmp_path):
    """Where both experts kernels run, the table times them at each bucket of rows per expert on the layer's
    own experts, the grouped calls split where the integer dot products stop winning, and a second layer of
    the same shape reads the table instead of measuring."""
    kernel = quant_linear_kernel()
    if not kernel.has_amx:
        pytest.skip("needs a CPU with AMX tiles: elsewhere experts past QDOT_ROWS rows run one product each")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))  # a table of its own (the shared one is per folder)
    layer = _layer(lambda w: quantize_int4(w, 32), torch.bfloat16)
    (table,) = tmp_path.glob("kernels/linear-table-*.json")
    saved = json.loads(table.read_text())
    key = "experts:int4g32z:6x128x96:bfloat16"
    ways = [saved[f"{key}@{bucket}"] for bucket in moe.EXPERT_ROW_BUCKETS]
    assert set(ways) <= {"qdot", "amx"}
    assert all(saved[f"{key}@{bucket}:{way}_ms"] > 0 for bucket in moe.EXPERT_ROW_BUCKETS for way in ("qdot", "amx"))
    qdot_buckets = [b for b, way in zip(moe.EXPERT_ROW_BUCKETS, ways)][:ways.index("amx") if "amx" in ways else None]
    assert layer.prepared.grouped.max_rows == max([QDOT_ROWS, *qdot_buckets])
    assert layer.prepared.many.min_rows == layer.prepared.grouped.max_rows + 1

    def no_measuring(*_):
        raise AssertionError("measured again")

    monkeypatch.setattr(linear_table, "_best_seconds_in_turns", no_measuring)
    again = _layer(lambda w: quantize_int4(w, 32), torch.bfloat16)
    assert again.prepared.grouped.max_rows == layer.prepared.grouped.max_rows
