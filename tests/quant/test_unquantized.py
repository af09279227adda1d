"""UnquantizedLinearMethod: weights created for the layer's shard, bf16
weights prepacked for oneDNN after loading (the same results as F.linear),
the AMX kernel for few rows, and the backends' refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels.amx_linear import amx_linear_kernel
from octavo.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from octavo.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from octavo.model.loader import default_dtype
from octavo.quant.base import LinearMethod
from octavo.quant.unquantized import SMALL_ROWS, STREAMED_ROWS, UnquantizedLinearMethod, can_pack

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="this torch build/CPU has no oneDNN bf16")
needs_amx = pytest.mark.skipif(
    not can_pack(CPU, torch.bfloat16) or amx_linear_kernel() is None, reason="this CPU (or OS) offers no AMX bf16 tiles"
)


def _filled(layer: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Give every parameter random values; returns copies of them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # Same float32 sums rounded to bf16; at most one step apart where the order differs.
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref.float()).abs() <= ref.float().abs().clamp(min=1e-3) * 2**-7).all()


def test_create_weights_registers_the_shard_with_its_split_dims():
    layer = nn.Module()
    UnquantizedLinearMethod().create_weights(layer, 48, [32, 16, 16], torch.bfloat16)
    assert layer.weight.shape == (64, 48) and layer.weight.dtype == torch.bfloat16
    assert (layer.weight.output_dim, layer.weight.input_dim) == (0, 1)
    assert not layer.weight.requires_grad


def test_the_torch_method_is_f_linear():
    layer = RowParallelLinear(24, 40, bias=True, linear_method=UnquantizedLinearMethod.for_backend("torch", CPU, torch.float32))
    params = _filled(layer, seed=1)
    layer.finish_loading()
    x = torch.randn(5, 24)
    assert torch.equal(layer(x), F.linear(x, params["weight"], params["bias"]))
    assert layer.linear_method.kernel_name(layer) == "torch"


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 128, 300])
def test_packed_equals_plain(rows, bias):
    with default_dtype(torch.bfloat16):
        layer = MergedColumnParallelLinear(96, [100, 100], bias, UnquantizedLinearMethod(pack=True))
    params = _filled(layer, seed=rows)
    layer.finish_loading()
    assert layer.weight.device.type == "meta"  # the plain copy is freed
    assert layer.linear_method.kernel_name(layer) == "onednn"
    x = torch.randn(rows, 96).bfloat16()
    _bf16_close(layer(x), F.linear(x, params["weight"], params.get("bias")))


@needs_packing
def test_tied_lm_head_is_packed_and_the_embedding_keeps_its_table():
    with default_dtype(torch.bfloat16):
        embed = VocabParallelEmbedding(50, 32)
        head = ParallelLMHead(50, 32, UnquantizedLinearMethod(pack=True))
    head.tie_to(embed)
    table = _filled(embed, seed=3)["weight"]
    head.finish_loading()
    assert embed.weight.device.type == "cpu" and torch.equal(embed.weight, table)  # the embedding still reads it
    ids = torch.tensor([3, 7])
    _bf16_close(head(embed(ids)), F.linear(table[ids], table))


def test_float32_layers_are_left_alone():
    method = UnquantizedLinearMethod.for_backend("auto", CPU, torch.float32)
    layer = RowParallelLinear(8, 4, bias=False, linear_method=method)
    _filled(layer, seed=4)
    layer.finish_loading()
    assert layer.prepared is None and layer.weight.device.type == "cpu"
    assert not can_pack(CPU, torch.float32)


@pytest.mark.parametrize("backend", ["native", "onednn"])
def test_packing_backends_refuse_what_they_cannot_run(backend):
    with pytest.raises(ValueError, match=f"linear_backend '{backend}' runs bfloat16"):
        UnquantizedLinearMethod.for_backend(backend, CPU, torch.float32)
    with pytest.raises(ValueError, match="amx needs pack"):
        UnquantizedLinearMethod(pack=False, amx=object())


@needs_amx
@pytest.mark.parametrize("rows", [1, SMALL_ROWS, SMALL_ROWS + 1, 300])
def test_few_rows_go_to_the_amx_kernel(rows):
    method = UnquantizedLinearMethod.for_backend("native", CPU, torch.bfloat16)
    with default_dtype(torch.bfloat16):
        layer = RowParallelLinear(96, 200, bias=True, linear_method=method)
    params = _filled(layer, seed=rows)
    layer.finish_loading()
    assert method.kernel_name(layer).startswith("amx")
    x = torch.randn(rows, 96).bfloat16()
    out = layer(x)
    _bf16_close(out, F.linear(x, params["weight"], params["bias"]))
    packed = layer.prepared
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, layer.bias, "none", [], "")
    assert torch.equal(out, packed.amx(x, layer.bias) if rows <= SMALL_ROWS else onednn)


@needs_amx
@pytest.mark.parametrize("rows", [SMALL_ROWS + 1, 128, STREAMED_ROWS, STREAMED_ROWS + 1])
def test_an_lm_head_sized_output_goes_to_the_amx_kernel_up_to_the_streamed_rows(rows):
    """Past SMALL_ROWS a product stays on the kernel only where it writes its output past the caches
    (4 MiB and more: 32768 outputs from 65 rows); a narrow layer's goes to oneDNN."""
    method = UnquantizedLinearMethod.for_backend("native", CPU, torch.bfloat16)
    with default_dtype(torch.bfloat16):
        wide, narrow = (RowParallelLinear(32, n, bias=False, linear_method=method) for n in (32768, 200))
    for layer in (wide, narrow):
        params = _filled(layer, seed=rows)
        layer.finish_loading()
        x = torch.randn(rows, 32).bfloat16()
        out = layer(x)
        _bf16_close(out, F.linear(x, params["weight"]))
        packed = layer.prepared
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")
        on_kernel = layer is wide and rows <= STREAMED_ROWS
        assert packed.amx.streams_output(rows) == (layer is wide)
        assert torch.equal(out, packed.amx(x) if on_kernel else onednn)
    assert method.kernel_name(wide) == f"amx (<= {SMALL_ROWS} rows, <= {STREAMED_ROWS} streamed) + onednn"
    assert method.kernel_name(narrow) == f"amx (<= {SMALL_ROWS} rows) + onednn"


@needs_amx
def test_a_weight_the_kernel_cannot_read_stays_on_onednn_unless_native_is_required():
    for method, refused in ((UnquantizedLinearMethod.for_backend("auto", CPU, torch.bfloat16), False),
                            (UnquantizedLinearMethod.for_backend("native", CPU, torch.bfloat16), True)):
        with default_dtype(torch.bfloat16):
            layer = RowParallelLinear(40, 64, bias=False, linear_method=method)  # K = 40: not whole 32-blocks
        _filled(layer, seed=5)
        if refused:
            with pytest.raises(ValueError, match="linear_backend 'native': the AMX kernel cannot read"):
                layer.finish_loading()
        else:
            layer.finish_loading()
            assert method.kernel_name(layer) == "onednn"


def test_the_seam_is_abstract():
    with pytest.raises(TypeError):
        LinearMethod()  # type: ignore[abstract]


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_table_method_keeps_the_plain_weight_and_matches_f_linear(rows, tmp_path):
    """The method CPUs without AMX get (forced here by building it directly):
    the weight stays plain, every row count gives F.linear's values."""
    from octavo.quant.linear_table import LinearTable
    from octavo.quant.unquantized import TableLinearMethod

    method = TableLinearMethod(LinearTable(path=tmp_path / "table.json"))
    with default_dtype(torch.bfloat16):
        layer = RowParallelLinear(70, 90, bias=True, linear_method=method)  # K = 70: not whole 32-blocks
    params = _filled(layer, seed=rows)
    layer.finish_loading()
    assert layer.weight.device.type == "cpu" and method.kernel_name(layer).startswith("rows ")
    x = torch.randn(rows, 70).bfloat16()
    _bf16_close(layer(x), F.linear(x, params["weight"], params["bias"]))
