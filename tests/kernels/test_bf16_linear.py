"""The few-row bf16 kernel (bf16_linear.c) built for every target this CPU
can execute, each forced, against a float32 reference on odd shapes; the
large-row ways of octavo/quant/linear_table.py and their measured table; the ops under
torch.compile."""
from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.quant import linear_table as cpu_linear
from octavo.kernels.amx_linear import amx_linear_kernel
from octavo.kernels.bf16_linear import bf16_gemm_kernel, bf16_linear_kernel, bf16_linear_widening_kernel
from octavo.kernels.cpu_features import BY_NAME, TARGETS, cpu_info, cpu_target

# The instruction set bf16_linear.c compiles to under each target.
ISA = {"amx": "avx512_bf16", "avx512_bf16": "avx512_bf16", "avx512": "avx512", "avx2": "avx2", "sve": "portable",
       "neon": "portable", "portable": "portable"}
SHAPES = [(1, 768, 96), (3, 31, 17), (17, 100, 33), (64, 64, 64), (300, 65, 40), (2, 1, 5), (5, 33, 1)]


def runnable(target_name: str):
    """The target, or a skip naming the CPU features it lacks here."""
    target = BY_NAME[target_name]
    if not cpu_info().can_run(target):
        pytest.skip(f"this CPU cannot run {target_name}: lacks {', '.join(cpu_info().missing(target))}")
    return target


def assert_close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """Exact products, float32 sums in another order, then one bf16 rounding:
    within a bf16 step of the float32 result (plus the sums' own rounding)."""
    ref = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    scale = x.float().abs() @ w.float().abs().t()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + scale * 1e-5 + 1e-30).all()


@pytest.mark.parametrize("target_name", [t.name for t in TARGETS if t.arch in ("x86_64", "any")])
@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_kernel_per_target(target_name, rows, k, n, with_bias):
    kernel = bf16_linear_kernel(runnable(target_name), required=True)
    assert kernel.isa == ISA[target_name]
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    assert_close_to_float32(kernel(x, w, bias), x, w, bias)


@pytest.mark.parametrize("target_name", [t.name for t in TARGETS if t.arch in ("x86_64", "any")])
def test_one_row_gives_the_bits_it_gets_among_other_rows(target_name):
    """A single row walks each weight row in turn (batch-1 decode), several rows walk all of a tile's weight rows
    together: the same sums in the same order, so a row's outputs are bitwise the same either way, alone or in an
    expert's run of rows (the experts kernel at 1, 2 and 7 rows per expert, a run past 4 rows whole)."""
    kernel = bf16_linear_kernel(runnable(target_name), required=True)
    gen = torch.Generator().manual_seed(7)
    for k, n in ((2048, 40), (768, 96), (100, 33), (31, 17)):  # whole steps of k's, a masked tail, AVX2's scalar one
        x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        alone = torch.cat([kernel(x[i:i + 1], w) for i in range(9)])
        for rows in (2, 3, 4, 7):
            assert torch.equal(kernel(x[:rows], w), alone[:rows])
        stacked = torch.stack([w, w.flip(0)])
        runs = kernel.experts(x, stacked, torch.tensor([0] * 7 + [1] * 2))
        singles = kernel.experts(x[:2], stacked, torch.tensor([0, 1]))
        assert torch.equal(runs[:7], alone[:7])
        assert torch.equal(runs[7:], kernel(x[7:], w.flip(0)))
        assert torch.equal(singles[0], alone[0]) and torch.equal(singles[1], kernel(x[1:2], w.flip(0))[0])


def test_rows_kernel_keeps_leading_dims_and_refuses_bad_input():
    kernel = bf16_linear_kernel(required=True)
    w = torch.randn(24, 40).to(torch.bfloat16)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    out = kernel(x, w)
    assert out.shape == (2, 3, 24)
    assert_close_to_float32(out.view(6, 24), x.view(6, 40), w, None)
    with pytest.raises(ValueError, match="input must be a CPU bfloat16 tensor"):
        kernel(x.float(), w)
    with pytest.raises(ValueError, match="bias must be contiguous bfloat16"):
        kernel(x, w, torch.zeros(23, dtype=torch.bfloat16))
    assert kernel(x[:0], w).shape == (0, 3, 24)


def test_bf16_vs_float_paths_equal_where_sums_are_exact():
    """Small integers: every product and partial sum is exact in float32, so
    all targets must give identical bits, whatever their summation order."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (5, 77), generator=gen).to(torch.bfloat16)
    w = torch.randint(-3, 4, (19, 77), generator=gen).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    for target in TARGETS:
        if target.arch in ("x86_64", "any") and cpu_info().can_run(target):
            assert torch.equal(bf16_linear_kernel(target, required=True)(x, w), ref), target.name


@pytest.mark.parametrize("way", sorted(cpu_linear.WAYS))
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_every_large_row_way_matches_float32(way, rows):
    if way == "onednn_packed" and not cpu_linear.can_pack_onednn():
        pytest.skip("this torch build/CPU has no oneDNN bf16 packing")
    if way == "gemm_dot" and bf16_gemm_kernel(dot=True) is None:
        pytest.skip("this CPU target has no AVX-512 BF16 dot products")
    if way == "rows_widen" and bf16_linear_widening_kernel() is None:
        pytest.skip("this CPU target has no AVX-512 BF16 dot products (its few-row kernel already widens)")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(1100, 70, generator=gen).to(torch.bfloat16)  # 1100 x 70: several fp32 tiles, a short last one
    x = torch.randn(rows, 70, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1100, generator=gen).to(torch.bfloat16)
    planned = cpu_linear.make_copies(w, {b: way for b in cpu_linear.BUCKETS})
    out = cpu_linear.WAYS[way](planned, x, bias)
    assert_close_to_float32(out, x, w, bias)


def test_fp32_tiles_small_tiles(monkeypatch):
    monkeypatch.setattr(cpu_linear, "TILE_BYTES", 16 * 4 * 30)  # 16-row tiles: many, and a partial last one
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(50, 30, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 7, 30, generator=gen).to(torch.bfloat16)
    out = cpu_linear.fp32_tiles(w, x, None)
    assert out.shape == (2, 7, 50)
    assert_close_to_float32(out.view(14, 50), x.view(14, 30), w, None)


def test_table_measures_once_and_reads_its_file(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    table = cpu_linear.LinearTable(path=path)
    ways = table.ways(40, 24)
    assert set(ways) == set(cpu_linear.BUCKETS)
    assert ways[256] != "rows" and all(w in table.candidates(b) for b, w in ways.items())
    saved = json.loads(path.read_text())
    assert all(saved[f"40x24@{b}"] == w for b, w in ways.items())
    assert saved["40x24@16:rows_ms"] > 0  # the times behind the choice are kept for reading

    def no_measuring(*_):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_linear, "_best_seconds_in_turns", no_measuring)
    assert cpu_linear.LinearTable(path=path).ways(40, 24) == ways


def test_ways_are_timed_taking_turns():
    """A warm call each, then the ways' runs interleaved: a drift in the machine's speed reaches every way alike."""
    calls: list[str] = []
    times = cpu_linear._best_seconds_in_turns({way: (lambda way=way: calls.append(way)) for way in ("a", "b", "c")})
    assert calls == ["a", "b", "c"] * 4
    assert set(times) == {"a", "b", "c"} and all(0 <= t < 1 for t in times.values())


def test_copies_are_candidates_only_when_allowed(tmp_path):
    assert "fp32_copy" not in cpu_linear.LinearTable(path=tmp_path / "a.json").candidates(256)
    assert "fp32_copy" in cpu_linear.LinearTable(copies=True, path=tmp_path / "b.json").candidates(256)
    assert "rows" not in cpu_linear.LinearTable(path=tmp_path / "c.json").candidates(cpu_linear.ROWS_KERNEL_MAX + 1)


def test_whole_weight_conversion_is_measured_only_under_its_memory_cap(tmp_path, monkeypatch):
    def timed_ways(path):
        return {key.split(":")[1].removesuffix("_ms") for key in json.loads(path.read_text()) if ":" in key}

    cpu_linear.LinearTable(path=tmp_path / "a.json").ways(32, 16)
    assert "fp32_convert" in timed_ways(tmp_path / "a.json")
    monkeypatch.setattr(cpu_linear, "CONVERT_MAX_BYTES", 32 * 16 * 4 - 1)
    ways = cpu_linear.LinearTable(path=tmp_path / "b.json").ways(32, 16)
    assert "fp32_convert" not in timed_ways(tmp_path / "b.json") and "fp32_convert" not in ways.values()


def test_few_row_buckets_are_timed_on_weights_read_in_turn(tmp_path, monkeypatch):
    """Up to ROWS_KERNEL_MAX rows each timed call reads the copy of the weight least recently read (as decode
    reads weights from beyond L2); past it, one weight (compute-bound products)."""
    read: dict[int, list[int]] = {}

    def recording(real):
        def way(pw, x, bias):
            read.setdefault(x.shape[0], []).append(pw.weight.data_ptr())
            return real(pw, x, bias)
        return way

    for name, real in list(cpu_linear.WAYS.items()):
        monkeypatch.setitem(cpu_linear.WAYS, name, recording(real))
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 64 * 48 * 2 * 6)  # six copies of a 64 x 48 weight
    cpu_linear.LinearTable(path=tmp_path / "t.json").ways(64, 48)
    # Whichever way is timed, every call reads the copy the other five calls before it did not.
    few = read[cpu_linear.ROWS_KERNEL_MAX]
    assert len(set(few)) == 6 and all(len(set(few[i:i + 6])) == 6 for i in range(len(few) - 5))
    assert len(set(read[max(cpu_linear.BUCKETS)])) == 1


def test_few_rows_choose_only_between_the_few_row_kernel_builds(tmp_path):
    table = cpu_linear.LinearTable(path=tmp_path / "t.json")
    widening = bf16_linear_widening_kernel()
    for rows in (1, cpu_linear.ALWAYS_ROWS_KERNEL):
        assert table.candidates(rows) == ["rows"] + (["rows_widen"] if widening else [])
    # The widening build exists exactly where the process's target is the one whose few-row build multiplies
    # by vdpbf16ps (an AMX target's few-row build uses it too, but AMX runs those products).
    assert (widening is not None) == (cpu_target().name == "avx512_bf16")
    if widening is not None:
        assert widening.isa == "avx512" and "rows_widen" in table.candidates(cpu_linear.ROWS_KERNEL_MAX)


def test_planned_weight_routes_by_rows():
    w = torch.randn(8, 16).to(torch.bfloat16)
    planned = cpu_linear.PlannedWeight(w, {1: "rows", 4: "rows_widen", 8: "rows", 16: "fp32_tiles", 32: "gemm",
                                           64: "onednn", 256: "fp32_tiles", 1024: "fp32_convert"})
    assert [planned.way_for(r) for r in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257, 5000)] == [
        "rows", "rows_widen", "rows_widen", "rows", "rows", "fp32_tiles", "fp32_tiles", "gemm", "gemm", "onednn",
        "onednn", "fp32_tiles", "fp32_tiles", "fp32_convert", "fp32_convert"]


def test_compiled_linear_op_matches_eager():
    w = torch.randn(48, 96).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.call(ops.bf16_linear, torch.ops.octavo.bf16_linear, x, w, bias).float().relu()

    x = torch.randn(3, 96).to(torch.bfloat16)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
    if bf16_linear_widening_kernel() is not None:
        def widened(x: torch.Tensor) -> torch.Tensor:
            return ops.call(ops.bf16_linear, torch.ops.octavo.bf16_linear, x, w, bias, True).float().relu()

        assert torch.equal(torch.compile(widened, fullgraph=True)(x), widened(x))


def test_compiled_amx_op_matches_eager():
    amx = amx_linear_kernel()
    if amx is None:
        pytest.skip("this CPU (or OS, or the forced target) offers no AMX bf16 tiles")
    w = torch.randn(64, 96).to(torch.bfloat16)
    shared = amx.share_onednn(torch.ops.mkldnn._reorder_linear_weight(w, 128), w)
    if shared is None:
        pytest.skip("oneDNN packed this weight in a layout the AMX kernel does not read")

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.call(ops.amx_linear, torch.ops.octavo.amx_linear, x, shared.blocks, None, 64) * 2

    x = torch.randn(5, 96).to(torch.bfloat16)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


def test_fake_ops_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 3, 40, dtype=torch.bfloat16)
        out = torch.ops.octavo.bf16_linear(x, torch.empty(24, 40, dtype=torch.bfloat16), None)
        assert out.shape == (7, 3, 24) and out.dtype == torch.bfloat16
        blocks = torch.empty(64 * 40, dtype=torch.bfloat16)
        assert torch.ops.octavo.amx_linear(x, blocks, None, 50).shape == (7, 3, 50)
