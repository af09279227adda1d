"""The many-row bf16 GEMM (bf16_gemm.c) built for every target this CPU can
execute, both flavours (float32 products; AVX-512 BF16 dot products where
the target has them), against float32 on shapes that hit every edge of its
blocking: rows not a multiple of a register or a tile, outputs not a
multiple of a panel, K odd, K cut into blocks, rows cut into chunks."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.quant import linear_table as cpu_linear
from octavo.kernels.bf16_linear import bf16_gemm_kernel
from octavo.kernels.cpu_features import BY_NAME, TARGETS, cpu_info
from tests.kernels.test_bf16_linear import ISA, assert_close_to_float32, runnable

X86_TARGETS = [t.name for t in TARGETS if t.arch in ("x86_64", "any")]
# (rows, k, n): one row; fewer rows than a register; a register and one;
# a short last row block; K odd and tiny; K = 1; N below a panel; N = 1;
# K above a K block (1024) with an odd tail, with few and with more rows;
# rows in several chunks of packed x with K in two blocks; a model-like shape.
SHAPES = [(1, 768, 96), (3, 31, 17), (17, 100, 33), (64, 64, 64), (70, 65, 40), (2, 1, 5), (5, 33, 1),
          (9, 1030, 50), (33, 2049, 37), (300, 1500, 23), (128, 768, 130)]


def kernels(target_name: str):
    """The float32 kernel and, where the target has AVX-512 BF16, the dot one."""
    target = runnable(target_name)
    found = [bf16_gemm_kernel(target, required=True), bf16_gemm_kernel(target, required=True, dot=True)]
    return [k for k in found if k is not None]


def test_dot_flavour_exactly_where_the_target_has_avx512_bf16():
    for name in X86_TARGETS:
        if cpu_info().can_run(BY_NAME[name]):
            assert len(kernels(name)) == (2 if ISA[name] == "avx512_bf16" else 1), name
            assert all(k.isa == ISA[name] for k in kernels(name))


@pytest.mark.parametrize("target_name", X86_TARGETS)
@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_per_target_matches_float32(target_name, rows, k, n, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    for kernel in kernels(target_name):
        assert_close_to_float32(kernel(x, w, bias), x, w, bias)


@pytest.mark.parametrize("target_name", X86_TARGETS)
def test_gemm_rounds_to_nearest_even_like_torch(target_name):
    """Integers: every product and sum is exact in float32, so the one
    rounding to bf16 (sums up to ~20000, many of them ties between two bf16
    values) must give torch's bits exactly, bias included."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(-16, 17, (37, 77), generator=gen).to(torch.bfloat16)
    w = torch.randint(-16, 17, (29, 77), generator=gen).to(torch.bfloat16)
    bias = torch.randint(-100, 101, (29,), generator=gen).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float(), bias.float()).to(torch.bfloat16)
    for kernel in kernels(target_name):
        assert torch.equal(kernel(x, w, bias), ref), kernel.name


def test_gemm_special_values_propagate():
    x = torch.ones(20, 40, dtype=torch.bfloat16)
    w = torch.ones(7, 40, dtype=torch.bfloat16)
    x[3, 5], x[9, 0] = float("nan"), float("inf")
    for kernel in kernels(X86_TARGETS[-1]) + [bf16_gemm_kernel(required=True)]:
        out = kernel(x, w)
        assert out[3].isnan().all() and out[9].isinf().all() and (out[0] == 40).all()


def test_gemm_same_bits_at_any_thread_count():
    """Each output is summed by one thread in a fixed order: threads change the speed, not the result."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(150, 300, generator=gen).to(torch.bfloat16)
    w = torch.randn(200, 300, generator=gen).to(torch.bfloat16)
    kernel = bf16_gemm_kernel(required=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(kernel(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_gemm_after_a_product_whose_rows_buffer_is_released():
    """Over 8 MiB of packed rows (a long prefill) is freed after the call; the next calls allocate afresh."""
    gen = torch.Generator().manual_seed(4)
    kernel = bf16_gemm_kernel(required=True)
    for rows, k in [(2100, 1100), (20, 1100), (2100, 1100)]:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(9, k, generator=gen).to(torch.bfloat16)
        assert_close_to_float32(kernel(x, w), x, w, None)


def test_gemm_keeps_leading_dims_and_refuses_bad_input():
    kernel = bf16_gemm_kernel(required=True)
    w = torch.randn(24, 40).to(torch.bfloat16)
    x = torch.randn(2, 9, 40).to(torch.bfloat16)
    out = kernel(x, w)
    assert out.shape == (2, 9, 24)
    assert_close_to_float32(out.view(18, 24), x.view(18, 40), w, None)
    with pytest.raises(ValueError, match="input must be a CPU bfloat16 tensor"):
        kernel(x.float(), w)
    assert kernel(x[:0], w).shape == (0, 9, 24)


def test_table_offers_the_gemm_at_every_bucket_past_the_few_row_kernel(tmp_path):
    table = cpu_linear.LinearTable(path=tmp_path / "t.json")
    for b in (b for b in cpu_linear.BUCKETS if b > cpu_linear.ALWAYS_ROWS_KERNEL):
        assert "gemm" in table.candidates(b)
        assert ("gemm_dot" in table.candidates(b)) == (bf16_gemm_kernel(dot=True) is not None)


def test_table_file_changes_with_the_ways_measured(monkeypatch, tmp_path):
    """A table measured before a way existed is not reused (its file name differs)."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    now = cpu_linear.LinearTable().path
    monkeypatch.setattr(cpu_linear.LinearTable, "candidates", lambda self, rows: ["onednn", "fp32_tiles"])
    assert cpu_linear.LinearTable().path != now


def test_table_file_changes_with_the_kernel_builds(monkeypatch, tmp_path):
    """A table timed on an older build of a kernel (another source, compiler or flags) is measured again."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    now = cpu_linear.LinearTable().path
    monkeypatch.setattr(bf16_gemm_kernel(), "build", "bf16_gemm-elsewhere")
    assert cpu_linear.LinearTable().path != now


def test_another_copy_of_the_source_builds_to_the_same_kernel(tmp_path):
    """load_other_source (benchmarks' A/B of an older source) compiles as load_kernel does, headers beside it."""
    from pathlib import Path

    from octavo.kernels.bf16_linear import Bf16LinearKernel
    from octavo.kernels.build import load_other_source

    kernels = Path(ops.__file__).parent
    for name in ("bf16_gemm.c", "common.h"):
        (tmp_path / name).write_text((kernels / name).read_text())
    other = Bf16LinearKernel(load_other_source(tmp_path / "bf16_gemm.c"), "bf16_gemm")
    x, w = torch.randn(20, 48).to(torch.bfloat16), torch.randn(40, 48).to(torch.bfloat16)
    assert other.isa == bf16_gemm_kernel().isa
    assert torch.equal(other(x, w), bf16_gemm_kernel()(x, w))


def test_compiled_gemm_op_matches_eager():
    w = torch.randn(48, 96).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.call(ops.bf16_gemm, torch.ops.octavo.bf16_gemm, x, w, bias, False).float().relu()

    x = torch.randn(40, 96).to(torch.bfloat16)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
