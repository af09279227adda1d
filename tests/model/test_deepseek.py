"""DeepSeek-V2/V3: the latent KV cache's size (float and quantized), absorbed decode against decompressed
attention over a float and a quantized cache and its rounding in bfloat16, config errors (grouped routing:
tests/model/test_expert_routing.py; a quantized latent cache's logits: tests/worker/test_kv_quant_runner.py).
Per-position logits against transformers are in tests/worker/test_runner_parity.py (the deepseek_* variants);
greedy output through the engine with chunked prefill, prefix sharing, preemption and n > 1 in
tests/model/test_moe.py, with speculation in tests/spec_decode/test_greedy_parity.py."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from octavo.attention.base import AttentionBackend, StepLayout
from octavo.attention.kv_quant import write_vectors
from octavo.attention.registry import select_attention_backend
from octavo.model.backends import ModelBackends
from octavo.model.layers.latent_attention import LatentAttention
from octavo.model.layers.latent_up_projection import HEAD_KERNEL_ROWS, HeadProducts
from octavo.model.loader import load_model
from tests.worker.runner_utils import make_runner

DEEPSEEK = ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("name", DEEPSEEK)
def test_kv_bytes_per_token_are_the_latent_and_rope_dims(name, kv, variant, caplog):
    """((kv_lora_rank + qk_rope_head_dim) x bytes of the cache dtype + a float32 scale when quantized) x layers,
    and the start-up log says so."""
    config = json.loads((variant(name) / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="octavo.worker.kv_cache"):
        runner = make_runner(variant(name), num_blocks=8, kv_cache_dtype=kv)
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    per_layer = width * 4 if kv == "auto" else width + 4
    expected = per_layer * config["num_hidden_layers"]
    assert sum(spec.bytes_per_token for spec in runner.kv_cache_specs) == expected
    assert f"{expected} bytes per token" in caplog.text
    for cache in runner.kv_caches:  # [parts, blocks, block_size, heads, dim]: one vector per token, nothing for V
        assert cache.data.shape[0] == 1
        assert tuple(cache.data.shape[2:]) == (16, 1, width)
        blocks = cache.data.shape[1]  # the 8 asked for, and the padding block recorded decode steps write into
        assert blocks in (8, 9)
        assert cache.scales is None if kv == "auto" else tuple(cache.scales.shape) == (1, blocks, 1, 16)


def _attention_backend(name: str) -> AttentionBackend:
    if name == "triton":  # the CUDA backend's kernel, run by Triton's interpreter on CPU tensors (tests/conftest.py)
        pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
        from octavo.attention.triton_cuda import TritonBackend

        return TritonBackend({None})
    return select_attention_backend(name, torch.device("cpu"), torch.float32, torch.float32, {None})


def _cached_step(layer: LatentAttention, attention: AttentionBackend, cache_dtype: torch.dtype, latents: torch.Tensor,
                 block_size: int, contexts: list[int], tables: list[list[int]]) -> tuple:
    """(a ``cache_dtype`` cache of ``latents`` [slots, 1, kv_lora_rank + rope], one per slot; the metadata of
    a step whose rows are queries at the end of ``contexts`` over their blocks ``tables``, as decode rows; the
    same rows as prefill chunks over their cached contexts)."""
    cache = attention.allocate_cache(layer.kv_cache_spec(block_size, cache_dtype), len(latents) // block_size,
                                     torch.device("cpu"))
    write_vectors(cache, (latents,), torch.arange(len(latents)))
    width, rows = max(map(len, tables)), len(contexts)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    last_slots = torch.tensor([t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                               for t, c in zip(tables, contexts)])

    def layout(num_decodes: int) -> StepLayout:
        return StepLayout(block_size, num_decodes, list(range(rows)), [1] * rows, contexts,
                          [len(t) for t in tables], table, last_slots, torch.device("cpu"))

    chunks = attention.build_metadata(layout(0)).prefills
    assert all(not c.fresh for c in chunks)
    return cache, attention.build_metadata(layout(rows)), chunks


def _decompressed(layer: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cache, chunks) -> torch.Tensor:
    return torch.cat([layer.decompressed_prefill(q_nope[c.q_start:c.q_end], q_rope[c.q_start:c.q_end], None, cache, c)
                      for c in chunks])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=["f32", "int8", "fp8"])
@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
def test_absorbed_decode_equals_decompressed_attention(name, backend, cache_dtype, variant):
    """Queries at the end of cached contexts: attending in latent space (the decode path, each
    backend's decode over the paged blocks, dequantizing a quantized cache as it reads) gives what
    decompressing every cached latent into per-head keys and values gives (the prefill path, over the
    gathered, dequantized latents)."""
    attention = _attention_backend(backend)
    model, _ = load_model(variant(name), backends=ModelBackends(attention=attention))
    layer: LatentAttention = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(12 * 4, 1, layer.kv_lora_rank + layer.rope_dim, generator=gen)
    tables = [[3, 7, 1], [5, 2], [9]]
    cache, decodes, chunks = _cached_step(layer, attention, cache_dtype, latents, 4, [11, 6, 3], tables)
    q_nope = torch.randn(3, layer.num_heads, layer.nope_dim, generator=gen)
    q_rope = torch.randn(3, layer.num_heads, layer.rope_dim, generator=gen)
    with torch.inference_mode():
        absorbed = layer.absorbed_decode(q_nope, q_rope, cache, decodes)
        decompressed = _decompressed(layer, q_nope, q_rope, cache, chunks)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-5, atol=1e-5)


# In bfloat16 the absorbed decode rounds the query's latent projection and the latent output besides what the
# decompressed attention (transformers' way, and prefill's) rounds. Its error against the exact output, as a
# root mean square, may be at most this many times the decompressed path's. Measured here 1.02x / 1.10x with the
# native kernel (float32 inside; V2-Lite / V3 variants), 1.14x / 1.32x with torch's (bf16 SDPA over the gathered
# latents), up to 1.56x over other draws of the same sizes; at DeepSeek-V2-Lite's own sizes 1.01x (context 256)
# and 1.13x (2048), each 0.23-0.26% of the output's RMS where rounding the exact output to bfloat16 alone is
# 0.17% (benchmarks/latent_bf16.py). Products in float32 would reach that floor, at the cost of float32 copies of
# W_UK and W_UV and the kernel's bf16 x bf16 fast path: the absorbed decode is kept in the model's dtype.
BF16_ERROR_RATIO = 1.75


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
def test_bf16_absorbed_decode_rounds_as_closely_as_decompressed_attention(name, backend, variant):
    """Four rows at the end of 33-200 cached tokens, bfloat16 weights, latents and queries; the exact output is
    the decompressed attention in float32 of the same (bfloat16) values."""
    layers = {}
    for dtype in (torch.bfloat16, torch.float32):
        attention = select_attention_backend(backend, torch.device("cpu"), dtype, dtype, {None})
        model, _ = load_model(variant(name), dtype=str(dtype).removeprefix("torch."),
                              backends=ModelBackends(attention=attention))
        layers[dtype] = model.model.layers[1].self_attn, attention
    for exact, rounded in zip(layers[torch.float32][0].parameters(), layers[torch.bfloat16][0].parameters()):
        exact.data.copy_(rounded.data.float())
    gen = torch.Generator().manual_seed(0)
    contexts = [200, 120, 64, 33]
    order = torch.randperm(sum(-(-c // 16) for c in contexts), generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-c // 16))] for c in contexts]
    layer = layers[torch.bfloat16][0]
    latents = torch.randn(16 * (max(map(max, tables)) + 1), 1, layer.kv_lora_rank + layer.rope_dim, generator=gen)
    q_nope = torch.randn(4, layer.num_heads, layer.nope_dim, generator=gen).bfloat16()
    q_rope = torch.randn(4, layer.num_heads, layer.rope_dim, generator=gen).bfloat16()
    outputs = {}
    with torch.inference_mode():
        for dtype, (layer, attention) in layers.items():
            cache, decodes, chunks = _cached_step(layer, attention, dtype, latents.bfloat16(), 16, contexts, tables)
            qn, qr = q_nope.to(dtype), q_rope.to(dtype)
            outputs[dtype] = (layer.absorbed_decode(qn, qr, cache, decodes).float(),
                              _decompressed(layer, qn, qr, cache, chunks).float())
    exact = outputs[torch.float32][1]

    def error(out: torch.Tensor) -> float:
        return ((out - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

    absorbed, decompressed = (error(out) for out in outputs[torch.bfloat16])
    assert absorbed <= BF16_ERROR_RATIO * decompressed, (absorbed, decompressed)
    assert error(outputs[torch.float32][0]) < 1e-5  # the two paths are the same product in float32


@pytest.mark.parametrize("rows", [1, 3, HEAD_KERNEL_ROWS])
def test_bf16_absorbed_decode_per_head_kernel_equals_torch_bmm(rows, variant):
    """bf16 weights on a CPU: up to HEAD_KERNEL_ROWS decode rows multiply by kv_b_proj's halves through the
    experts kernel on its per-head copies; the same attention as torch.bmm on the loaded weight's views gives, up
    to bf16 rounding of the two products' outputs."""
    attention = select_attention_backend("native", torch.device("cpu"), torch.bfloat16, torch.bfloat16, {None})
    model, _ = load_model(variant("deepseek_v3"), dtype="bfloat16", backends=ModelBackends(attention=attention))
    layer: LatentAttention = model.model.layers[1].self_attn
    heads = layer.kv_b_proj.prepared
    assert isinstance(heads, HeadProducts)
    gen = torch.Generator().manual_seed(0)
    contexts = [5 + r % 10 for r in range(rows)]  # each within its two blocks of 8
    tables = [[r * 2, r * 2 + 1] for r in range(rows)]
    latents = torch.randn(8 * 2 * rows, 1, layer.kv_lora_rank + layer.rope_dim, generator=gen).bfloat16()
    cache, decodes, _ = _cached_step(layer, attention, torch.bfloat16, latents, 8, contexts, tables)
    q_nope = torch.randn(rows, layer.num_heads, layer.nope_dim, generator=gen).bfloat16()
    q_rope = torch.randn(rows, layer.num_heads, layer.rope_dim, generator=gen).bfloat16()
    with torch.inference_mode():
        kernel = layer.absorbed_decode(q_nope, q_rope, cache, decodes)
        layer.kv_b_proj.prepared = None  # torch.bmm on the loaded weight
        plain = layer.absorbed_decode(q_nope, q_rope, cache, decodes)
    torch.testing.assert_close(kernel.float(), plain.float(), rtol=2e-2, atol=2e-2 * plain.abs().max().item())


@pytest.mark.parametrize("field, value, message", [
    ("topk_method", "noaux_tc", "topk_method must be greedy or group_limited_greedy"),
    ("scoring_func", "sigmoid", "scoring_func must be softmax"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim must be even"),
    ("kv_lora_rank", 0, "kv_lora_rank must be a positive integer"),
    ("topk_group", 5, r"topk_group \(5\) must be between 1 and n_group \(4\)"),
])
def test_a_bad_config_field_is_an_error_naming_it(field, value, message, variant, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(variant("deepseek_v2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(folder)
