"""Attention backends: the registry's choices and refusals, and both backends
giving plain causal (and sliding-window, and soft-capped with another softmax
scale: Gemma 2) attention over a paged cache for a step that mixes decodes, a fresh prefill and a chunk after a cached prefix
(its context read in one tile or in many), over float and quantized (int8, fp8) caches."""
from __future__ import annotations

import pytest
import torch

from octavo.attention.base import AttentionBackend
from octavo.attention.kv_quant import allocate_layer_cache, dequantize, write_kv
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.attention.registry import ATTENTION_BACKENDS, select_attention_backend
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.attention.triton_cuda import TritonBackend
from octavo.core.step_state import ScheduledRow
from octavo.core.request import Request
from octavo.sampling_params import SamplingParams
from octavo.worker.input_batch import prepare_inputs

CPU = torch.device("cpu")
F32 = torch.float32
BLOCK, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 4, 4, 2, 8, 40


def test_registry_names_both_backends():
    assert ATTENTION_BACKENDS == {"native": NativeCpuBackend, "triton": TritonBackend, "torch": TorchSdpaBackend}
    assert isinstance(select_attention_backend("torch", CPU, F32, F32, {None}), TorchSdpaBackend)
    native = select_attention_backend("native", CPU, torch.bfloat16, F32, {None, 8})
    assert isinstance(native, NativeCpuBackend) and native.windows == {None, 8}


def test_auto_prefers_native_and_falls_back_to_torch(monkeypatch):
    assert isinstance(select_attention_backend("auto", CPU, F32, F32, {None}), NativeCpuBackend)
    # No compiler: the kernel cannot be built.
    monkeypatch.setattr(NativeCpuBackend, "create", classmethod(lambda cls, windows, required: None))
    assert isinstance(select_attention_backend("auto", CPU, F32, F32, {None}), TorchSdpaBackend)


def test_auto_skips_a_backend_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(NativeCpuBackend, "supports", staticmethod(lambda *_: False))
    assert isinstance(select_attention_backend("auto", CPU, F32, F32, {None}), TorchSdpaBackend)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, native, triton, torch; got 'flash'"):
        select_attention_backend("flash", CPU, F32, F32, {None})
    with pytest.raises(ValueError, match="attention_backend 'native' runs on CPU"):
        select_attention_backend("native", CPU, F32, torch.int16, {None})
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA"):
        select_attention_backend("triton", CPU, F32, F32, {None})
    with pytest.raises(TypeError):
        AttentionBackend({None})  # type: ignore[abstract]


def _step(backend: AttentionBackend):
    """Decodes at contexts 23, 9 and 1, a fresh 6-token prompt and the last 5
    tokens of a 13-token one (8 already cached); block ids shuffled."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()

    def sched(name: str, start: int, num_tokens: int) -> ScheduledRow:
        request = Request(name, list(range(start + num_tokens)), SamplingParams())
        blocks = [order.pop() for _ in range(-(-(start + num_tokens) // BLOCK))]
        return ScheduledRow(request, start, num_tokens, [blocks], True)

    scheduled = [sched("d1", 8, 1), sched("p1", 0, 6), sched("d0", 22, 1), sched("p2", 8, 5), sched("d2", 0, 1)]
    return prepare_inputs(scheduled, BLOCK, backend, CPU)


def _dense_cache(cache):
    """[2, slots, KV_HEADS, DIM] float32: what the cache holds, dequantized."""
    flat = cache.slots().float()
    if cache.quantized:
        scales = cache.scales.transpose(2, 3).reshape(2, -1, KV_HEADS)
        flat = dequantize(flat, scales, F32)
    return flat


def _reference(q, k, v, cache, inputs, window, scale=DIM**-0.5, softcap=None):
    """Dense attention per request over its cached positions, head by head; a
    fresh prompt attends over its own k, v (as the backends do), the others
    over what the cache holds."""
    out = torch.empty_like(q)
    flat = _dense_cache(cache)
    for s, first in zip(inputs.order, inputs.q_starts):
        context = s.start_pos + s.num_tokens
        if s.start_pos == 0 and s.num_tokens > 1:
            keys, values = k[first : first + context], v[first : first + context]
        else:
            slots = torch.tensor([s.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
            keys, values = flat[0][slots], flat[1][slots]
        for row in range(s.num_tokens):
            pos = s.start_pos + row
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                scores = keys[lo : pos + 1, kv] @ q[first + row, h] * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[first + row, h] = torch.softmax(scores, 0) @ values[lo : pos + 1, kv]
    return out


@pytest.mark.parametrize("key_tile", [4096, BLOCK])
@pytest.mark.parametrize("scoring", [None, (0.6, 1.5)])
@pytest.mark.parametrize("cache_dtype", [F32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("name", ["native", "torch"])
def test_backends_attend_over_the_paged_cache(monkeypatch, name, window, cache_dtype, scoring, key_tile):
    """``scoring``: (softmax scale, soft cap), large enough that the cap bends the scores. ``key_tile``:
    the chunk after a cached prefix reads its context in one tile, or a block at a time (tiles that every
    query sees, that only some rows see, and with the window, tiles some rows see nothing of)."""
    from octavo.attention import prefill

    monkeypatch.setattr(prefill, "KEY_TILE", key_tile)
    backend = select_attention_backend(name, CPU, F32, cache_dtype, {None, 3})
    inputs = _step(backend)
    gen = torch.Generator().manual_seed(1)
    tokens = inputs.input_ids.shape[0]
    cache = allocate_layer_cache(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, cache_dtype, CPU)
    every_slot = torch.arange(NUM_BLOCKS * BLOCK)
    old_k, old_v = (torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    write_kv(cache, old_k, old_v, every_slot)  # the "cached" prefix
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=gen) for _ in range(2))
    backend.write_kv(cache, k, v, inputs.attn[0])
    flat = _dense_cache(cache)
    slots = inputs.attn[0].slot_mapping
    # Exact in a float cache; within half a step of each row's scale in a quantized one.
    tol = 0 if cache_dtype == F32 else {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4}[cache_dtype]
    for stored, want in ((flat[0][slots], k), (flat[1][slots], v)):
        assert ((stored - want).abs() <= tol * want.abs().amax(-1, keepdim=True) + 1e-7).all()
    if scoring is None:
        out, ref = backend.forward(q, k, v, cache, inputs.attn[0], window), _reference(q, k, v, cache, inputs, window)
    else:
        out = backend.forward(q, k, v, cache, inputs.attn[0], window, *scoring)
        ref = _reference(q, k, v, cache, inputs, window, *scoring)
        assert (ref - _reference(q, k, v, cache, inputs, window, scoring[0])).abs().max() > 1e-2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_float32", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_chunks_attend_in_float32_where_chosen(monkeypatch, in_float32, masked):
    """A bf16 chunk of FLOAT32_MIN_QUERY tokens or more goes through float32 SDPA on x86 CPUs without AMX
    (chosen there for speed) and through bf16 SDPA elsewhere; both give causal GQA attention, rounded to bf16."""
    from octavo.attention import prefill

    monkeypatch.setattr(prefill, "_x86_without_amx", lambda: in_float32)
    gen = torch.Generator().manual_seed(3)
    n = prefill.FLOAT32_MIN_QUERY
    q, k, v = (torch.randn(1, h, n, DIM, generator=gen).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    assert prefill.attends_in_float32(q) == in_float32
    assert not prefill.attends_in_float32(q[:, :, : n - 1])
    assert not prefill.attends_in_float32(q.float())
    mask = torch.ones(n, n, dtype=torch.bool).tril() if masked else None
    out = prefill.attend(q, k, v, mask, DIM**-0.5, None)
    # float64 reference: query head h reads KV head h // (HEADS // KV_HEADS), causal.
    group = HEADS // KV_HEADS
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) * DIM**-0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ vv
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_a_short_request_attends_as_the_decodes_of_its_tokens(dtype, window):
    """Speculative verification: each row of a 4-token request over a cached context gives, bit for bit,
    what decoding its token alone at that position gives (the decode kernel runs the rows), so verified
    tokens are the ones plain decoding picks."""
    backend = select_attention_backend("native", CPU, dtype, dtype, {None, 6})
    gen = torch.Generator().manual_seed(2)
    cache = allocate_layer_cache(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype, CPU)
    every_slot = torch.arange(NUM_BLOCKS * BLOCK)
    write_kv(cache, *(torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2)),
             every_slot)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()[:7]
    verify = Request("v", list(range(24)), SamplingParams())
    other = Request("o", list(range(10)), SamplingParams())

    def rows(scheduled: list[ScheduledRow]):
        inputs = prepare_inputs(scheduled, BLOCK, backend, CPU)
        q = torch.randn(inputs.input_ids.shape[0], HEADS, DIM, generator=gen).to(dtype)
        kv = torch.zeros(inputs.input_ids.shape[0], KV_HEADS, DIM, dtype=dtype)  # the cache is not written
        return inputs, q, kv

    inputs, q, kv = rows([ScheduledRow(verify, 20, 4, [blocks], True), ScheduledRow(other, 9, 1, [blocks[4:]], True)])
    assert inputs.attn[0].num_decodes == 5 and not inputs.attn[0].prefills
    together = backend.forward(q, kv, kv, cache, inputs.attn[0], window)
    first = inputs.q_starts[[s.request.request_id for s in inputs.order].index("v")]
    for j in range(4):
        alone, _, one_kv = rows([ScheduledRow(verify, 20 + j, 1, [blocks], True)])
        out = backend.forward(q[first + j : first + j + 1], one_kv, one_kv, cache, alone.attn[0], window)
        assert torch.equal(out[0], together[first + j])
