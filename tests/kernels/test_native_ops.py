"""The fused elementwise kernels and paged decode attention as torch ops
(``torch.ops.octavo.*``): their schemas declare what each kernel writes in
place (opcheck checks that, the fake implementations and autograd
registration against real calls), and ``torch.compile`` traces a decode
layer made of them whole (fullgraph), giving what the eager kernels give,
cache writes included."""
from __future__ import annotations

import pytest
import torch

from octavo.kernels import ops
from octavo.kernels.bf16_linear import bf16_linear_widening_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 2, 32, 16, 6


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rope(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seed)) * 6
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def _cache() -> torch.Tensor:
    # One pool [2, blocks, block, kv_heads, head_dim]; each layer's K and V are views of it, as in the engine.
    return _randn(2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, seed=9)


def _decode_inputs(seqs: int) -> dict[str, torch.Tensor]:
    table = torch.tensor([[2, 5, 0], [1, 3, 4], [0, 0, 0]][:seqs], dtype=torch.int64)
    return {"table": table, "lens": torch.tensor([20, 40, 3][:seqs], dtype=torch.int64)}


def test_opcheck_elementwise_ops():
    x, w = _randn(5, 64, seed=1), _randn(64, seed=2)
    torch.library.opcheck(torch.ops.octavo.rms_norm, (x, w, 1e-6, None))
    torch.library.opcheck(torch.ops.octavo.rms_norm, (x, w, 1e-6, _randn(5, 64, seed=3)))
    torch.library.opcheck(torch.ops.octavo.silu_mul, (_randn(5, 128, seed=4),))
    torch.library.opcheck(torch.ops.octavo.argmax, (_randn(3, 1000, seed=5),))


def test_opcheck_linear_ops():
    x, w, bias = _randn(3, 64, seed=6), _randn(48, 64, seed=7), _randn(48, seed=8)
    torch.library.opcheck(torch.ops.octavo.bf16_linear, (x, w, bias))
    if bf16_linear_widening_kernel() is not None:
        torch.library.opcheck(torch.ops.octavo.bf16_linear, (x, w, bias, True))
    torch.library.opcheck(torch.ops.octavo.bf16_gemm, (_randn(40, 64, seed=9), w, None, False))


def test_opcheck_rotary_and_decode():
    rows = 3
    cos, sin = _rope(rows, seed=6)
    qkv = _randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, seed=7)
    cache = _cache()
    slots = torch.tensor([20, 41, 2], dtype=torch.int64)
    torch.library.opcheck(torch.ops.octavo.rotary_write_kv,
                          (qkv, HEADS, KV_HEADS, cos, sin, cache[0], cache[1], slots, None, None))
    d = _decode_inputs(rows)
    q = _randn(rows, HEADS, HEAD_DIM, seed=8)
    torch.library.opcheck(torch.ops.octavo.paged_decode,
                          (q, cache[0], cache[1], d["table"], d["lens"], None, HEAD_DIM**-0.5, None, None, None))
    torch.library.opcheck(torch.ops.octavo.paged_decode,
                          (q, cache[0], cache[1], d["table"], d["lens"], 8, 0.2, None, None, 30.0))


def test_opcheck_int8_cache_write_and_read():
    rows = 2
    cos, sin = _rope(rows, seed=10)
    qkv = _randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, seed=11)
    cache = torch.zeros(2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.int8)
    scales = torch.ones(2, BLOCKS, KV_HEADS, BLOCK)
    slots = torch.tensor([19, 39], dtype=torch.int64)
    torch.library.opcheck(torch.ops.octavo.rotary_write_kv,
                          (qkv, HEADS, KV_HEADS, cos, sin, cache[0], cache[1], slots, scales, None))
    d = _decode_inputs(rows)
    torch.library.opcheck(torch.ops.octavo.paged_decode,
                          (_randn(rows, HEADS, HEAD_DIM, seed=12), cache[0], cache[1], d["table"], d["lens"], None,
                           0.1, scales[0], scales[1], None))


def _layer(fused, kernel):
    """One decode step of a small attention + MLP layer, every native kernel through ``ops.call``."""
    w_qkv = _randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, 64, seed=20)
    w_o, w_up, w_down = _randn(64, HEADS * HEAD_DIM, seed=21), _randn(256, 64, seed=22), _randn(64, 128, seed=23)
    norm_w = _randn(64, seed=24)

    def step(x, residual, cos, sin, cache, slots, table, lens):
        h = ops.call(fused.rms_norm, torch.ops.octavo.rms_norm, x, norm_w, 1e-6, residual)
        qkv = torch.nn.functional.linear(h, w_qkv)
        ops.call(fused.rotary_write_kv, torch.ops.octavo.rotary_write_kv, qkv, HEADS, KV_HEADS, cos, sin,
                 cache[0], cache[1], slots, None, None)
        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        o = ops.call(kernel, torch.ops.octavo.paged_decode, q, cache[0], cache[1], table, lens, None,
                     HEAD_DIM**-0.5, None, None, None)
        y = torch.nn.functional.linear(o.reshape(o.shape[0], -1), w_o)
        up = ops.call(fused.silu_mul, torch.ops.octavo.silu_mul, torch.nn.functional.linear(y, w_up))
        out = torch.nn.functional.linear(up, w_down)
        return out, ops.call(fused.argmax, torch.ops.octavo.argmax, out)

    return step


def test_compiled_decode_layer_matches_eager():
    from octavo.kernels.fused_ops import fused_ops
    from octavo.kernels.paged_decode import paged_decode_kernel

    step = _layer(fused_ops(required=True), paged_decode_kernel(required=True))
    rows = 2
    d = _decode_inputs(rows)
    # Each row's new token goes to its last position (context length - 1) in its own blocks.
    slots = torch.tensor([5 * BLOCK + 3, 4 * BLOCK + 7], dtype=torch.int64)
    cos, sin = _rope(rows, seed=25)
    x = _randn(rows, 64, seed=26)

    def run(fn):
        residual, cache = _randn(rows, 64, seed=27), _cache()
        out, tokens = fn(x, residual, cos, sin, cache, slots, d["table"], d["lens"])
        return out, tokens, residual, cache

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    for name, want, got in zip(("out", "argmax", "residual (updated in place)", "cache (K/V written)"),
                               eager, compiled):
        assert torch.equal(got, want), name
    assert not torch.equal(eager[3], _cache()), "the step wrote no K/V"


def test_fake_elementwise_and_decode_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gate_up = torch.empty(7, 256, dtype=torch.bfloat16)
        assert torch.ops.octavo.silu_mul(gate_up).shape == (7, 128)
        logits = torch.empty(4, 1000, dtype=torch.float32)
        tokens = torch.ops.octavo.argmax(logits)
        assert tokens.shape == (4,) and tokens.dtype == torch.int64
        cache = torch.empty(2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        q = torch.empty(3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        out = torch.ops.octavo.paged_decode(q, cache[0], cache[1], torch.empty(3, 2, dtype=torch.int64),
                                            torch.empty(3, dtype=torch.int64), None, 0.1, None, None, None)
        assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_op_errors_are_value_errors(bad):
    x = _randn(3, 64, seed=30)
    w = _randn(64, seed=31) if bad == "dtype" else _randn(32, seed=31)
    if bad == "dtype":
        w = w.float()
    with pytest.raises(ValueError, match="weight"):
        torch.ops.octavo.rms_norm(x, w, 1e-6, None)
