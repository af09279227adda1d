"""DeepSeek-V2/V3: the latent KV cache's size (float and quantized), absorbed decode against decompressed
attention over a float and a quantized cache, config errors (grouped routing: tests/model/test_expert_routing.py;
a quantized latent cache's logits: tests/worker/test_kv_quant_runner.py). Per-position logits against transformers are in
tests/worker/test_runner_parity.py (the deepseek_* variants); greedy output through the engine with
chunked prefill, prefix sharing, preemption and n > 1 in tests/model/test_moe.py, with speculation
in tests/spec_decode/test_greedy_parity.py."""
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
        assert cache.scales is None if kv == "auto" else tuple(cache.scales.shape) == (1, 8, 1, 16)


def _attention_backend(name: str) -> AttentionBackend:
    if name == "triton":  # the CUDA backend's kernel, run by Triton's interpreter on CPU tensors (tests/conftest.py)
        pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
        from octavo.attention.triton_cuda import TritonBackend

        return TritonBackend({None})
    return select_attention_backend(name, torch.device("cpu"), torch.float32, torch.float32, {None})


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
    block_size, contexts = 4, [11, 6, 3]
    spec = layer.kv_cache_spec(block_size, cache_dtype)
    cache = attention.allocate_cache(spec, 12, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(12 * block_size)
    write_vectors(cache, (torch.randn(len(slots), 1, spec.head_dim, generator=gen),), slots)
    tables = [[3, 7, 1], [5, 2], [9]]
    table = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    rows = len(contexts)
    q_nope = torch.randn(rows, layer.num_heads, layer.nope_dim, generator=gen)
    q_rope = torch.randn(rows, layer.num_heads, layer.rope_dim, generator=gen)
    last_slots = torch.tensor([t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                               for t, c in zip(tables, contexts)])

    def layout(num_decodes: int) -> StepLayout:
        return StepLayout(block_size, num_decodes, list(range(rows)), [1] * rows, contexts,
                          [len(t) for t in tables], table, last_slots, torch.device("cpu"))

    with torch.inference_mode():
        absorbed = layer.absorbed_decode(q_nope, q_rope, cache, attention.build_metadata(layout(rows)))
        chunks = attention.build_metadata(layout(0)).prefills
        decompressed = torch.cat([
            layer.decompressed_prefill(q_nope[c.q_start:c.q_end], q_rope[c.q_start:c.q_end], None, cache, c)
            for c in chunks])
    assert all(not c.fresh for c in chunks)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-5, atol=1e-5)


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
