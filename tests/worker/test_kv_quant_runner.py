"""A quantized KV cache (int8, fp8) against the bf16 cache it replaces, on
the tiny models of every architecture: the same steps (a fresh prefill chunk,
a chunk over the cached prefix, decodes read in place by the native kernel
or gathered by torch) give logits within a bound of the bf16 cache's.

Bound, as a fraction of the logits' standard deviation (~0.8 here): int8
0.15, fp8 0.5. Measured (60 positions, every variant and backend): int8 at
most 0.09 (max abs diff 0.07), fp8 at most 0.38 (0.30): e4m3 keeps 3
mantissa bits, a relative step of up to 1/16 per element against int8's
1/254 of the row's largest. Static scales from a checkpoint (calibrated on
the same tokens, as llm-compressor would) are held to the same bounds, and
so is DeepSeek's latent cache (one scale per token over the latent and the
rotary key; measured: int8 at most 0.069, fp8 at most 0.19)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import VARIANTS, make_tiny_model

from .runner_utils import Blocks, make_request, make_runner, step

BOUND = {"int8": 0.15, "fp8": 0.5}
BACKENDS = {"native": {"attention_backend": "native", "fused_ops": True},
            "torch": {"attention_backend": "torch", "fused_ops": False}}


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(folder, kv_cache_dtype: str, backend: str, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: 20 prompt tokens fresh, 10 over the cached 20, then decodes."""
    runner = make_runner(folder, block_size=16, num_blocks=16, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                         **BACKENDS[backend])
    blocks = Blocks(runner)
    req = make_request("a", tokens[:30])
    parts = [runner.execute_logits(step(blocks.chunk(req, 0, 20, sample=False)))["a"],
             runner.execute_logits(step(blocks.chunk(req, 20, 10)))["a"]]
    for t in tokens[30:]:
        req.append_output_token(t)
        parts.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    return torch.cat(parts)


# A mixture's router turns the cache's rounding into another choice of experts wherever two experts'
# scores are close (random tiny routers have many near-ties), which moves the logits by far more than
# the rounding itself: the bound holds for dense models only; DeepSeek's latent cache below, with its
# layers made dense.
DENSE = sorted(n for n, (arch, _) in VARIANTS.items()
               if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("name", DENSE)
def test_logits_close_to_the_bf16_cache(name, kv, backend, variant):
    tokens = _tokens(60, seed=1)
    ref = _logits(variant(name), "auto", backend, tokens)
    ours = _logits(variant(name), kv, backend, tokens)
    assert ours.shape == ref.shape == (60, 512)
    diff = (ours - ref).abs().max().item()
    assert diff < BOUND[kv] * ref.std().item(), f"max abs diff {diff}, logit std {ref.std().item()}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
def test_latent_cache_logits_close_to_the_bf16_cache(name, kv, backend, tmp_path_factory):
    """DeepSeek's latent cache, one scale per token over the latent and the rotary key, within the dense
    models' bounds; every layer's MLP dense (first_k_dense_replace = the layer count), as routers would
    make near-ties of experts flip."""
    arch, overrides = VARIANTS[name]
    folder = make_tiny_model(tmp_path_factory.mktemp("latent"), arch, **{**overrides, "first_k_dense_replace": 2})
    tokens = _tokens(60, seed=1)
    ref = _logits(folder, "auto", backend, tokens)
    ours = _logits(folder, kv, backend, tokens)
    diff = (ours - ref).abs().max().item()
    assert diff < BOUND[kv] * ref.std().item(), f"max abs diff {diff}, logit std {ref.std().item()}"


def _with_scales(src: Path, dst: Path, scales: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint ``src`` with extra tensors (k_scale / v_scale)."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, **scales}, dst / "model.safetensors")
    return dst


def _calibrated_scales(folder: Path, tokens: list[int]) -> dict[str, torch.Tensor]:
    """What a calibration run writes: per layer, max |K| and max |V| over the
    tokens / 448 (an fp8 e4m3 dequantization scale), per-tensor ([1]) in
    layer 0, per KV head ([kv_heads]) in layer 1."""
    runner = make_runner(folder, num_blocks=16, dtype="bfloat16")
    blocks = Blocks(runner)
    runner.execute_logits(step(blocks.chunk(make_request("a", tokens), 0, len(tokens))))
    scales = {}
    for layer, cache in enumerate(runner.kv_caches):
        peaks = cache.data.float().abs().amax(dim=(1, 2, 4))  # [2, kv_heads]
        for which, name in enumerate(("k_scale", "v_scale")):
            peak = peaks[which] if layer == 1 else peaks[which].max().reshape(1)
            scales[f"model.layers.{layer}.self_attn.{name}"] = peak / 448
    return scales


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_static_scales_from_the_checkpoint(kv, variant, tmp_path):
    tokens = _tokens(60, seed=2)
    scales = _calibrated_scales(variant("llama"), tokens)
    folder = _with_scales(variant("llama"), tmp_path / "llama-kv-scales", scales)
    runner = make_runner(folder, num_blocks=16, dtype="bfloat16", kv_cache_dtype=kv)
    # An fp8 scale maps the calibrated range onto +-448; int8 maps it onto +-127.
    unit = 448 / 127 if kv == "int8" else 1.0
    for layer, cache in enumerate(runner.kv_caches):
        want = torch.stack([scales[f"model.layers.{layer}.self_attn.{n}"].expand(2) for n in ("k_scale", "v_scale")])
        torch.testing.assert_close(cache.static_scales, want * unit)
    blocks = Blocks(runner)
    req = make_request("a", tokens[:30])
    runner.execute_logits(step(blocks.chunk(req, 0, 30)))
    for cache in runner.kv_caches:  # every written row took its head's static scale
        written = cache.scales[:, blocks.tables["a"][0]].transpose(2, 3).reshape(2, -1, 2)[:, :30]
        assert torch.equal(written, cache.static_scales[:, None, :].expand_as(written))
    ref = _logits(variant("llama"), "auto", "native", tokens)
    ours = _logits(folder, kv, "native", tokens)
    diff = (ours - ref).abs().max().item()
    assert diff < BOUND[kv] * ref.std().item(), f"max abs diff {diff}, logit std {ref.std().item()}"
    # An unquantized cache has no use for them: the checkpoint loads, the scales are not read.
    plain = make_runner(folder, num_blocks=4, dtype="bfloat16")
    assert plain.kv_caches[0].scales is None and plain.kv_caches[0].static_scales is None


def test_bad_static_scales_name_the_tensor(variant, tmp_path):
    one = torch.tensor([0.01])
    lone = _with_scales(variant("llama"), tmp_path / "lone", {"model.layers.1.self_attn.k_scale": one})
    with pytest.raises(ValueError, match=r"has model\.layers\.1\.self_attn\.k_scale but not .*layers\.1\.self_attn\.v_scale"):
        make_runner(lone, num_blocks=4, kv_cache_dtype="int8")
    wide = _with_scales(variant("llama"), tmp_path / "wide", {
        "model.layers.0.self_attn.k_scale": torch.full((3,), 0.01), "model.layers.0.self_attn.v_scale": one})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale has 3 values; expected 1 or one per KV"):
        make_runner(wide, num_blocks=4, kv_cache_dtype="fp8")
    zero = _with_scales(variant("llama"), tmp_path / "zero", {
        "model.layers.0.self_attn.k_scale": one, "model.layers.0.self_attn.v_scale": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"v_scale must hold positive finite scales"):
        make_runner(zero, num_blocks=4, kv_cache_dtype="int8")


@pytest.mark.parametrize("tp_size,kv_heads,want", [
    (2, 4, {0: [1, 2], 1: [3, 4]}),  # 4 KV heads split in two
    (4, 2, {0: [1], 1: [1], 2: [2], 3: [2]}),  # 2 KV heads, each replicated on two ranks
])
def test_static_scales_follow_the_ranks_kv_heads(tmp_path, variant, tp_size, kv_heads, want):
    """Under tensor parallelism a rank takes the scales of the KV heads its
    QKV projection loads (QKVParallelLinear's shards), per-head ones sliced,
    per-tensor ones broadcast."""
    from types import SimpleNamespace

    from octavo.model.kv_scales import load_static_kv_scales

    folder = _with_scales(variant("llama"), tmp_path / "tp", {
        "model.layers.0.self_attn.k_scale": torch.arange(1.0, kv_heads + 1),
        "model.layers.0.self_attn.v_scale": torch.tensor([7.0]),
    })
    local = max(kv_heads // tp_size, 1)
    for rank, heads in want.items():
        qkv = SimpleNamespace(num_kv_heads=local, num_kv_shards=kv_heads // local, tp_rank=rank, tp_size=tp_size)
        layer = SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=qkv))
        net = SimpleNamespace(model=SimpleNamespace(layer_range=range(2)), local_layers=[layer, layer])
        first, second = load_static_kv_scales(net, folder, torch.float8_e4m3fn)
        assert second is None  # layer 1 has no scales in this checkpoint
        assert first.tolist() == [heads, [7.0] * local]
