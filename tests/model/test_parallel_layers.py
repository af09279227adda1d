"""Parallel layers take their own shard of a full checkpoint tensor: for every
rank r of n (simulated through parallel_state, no processes), the shards laid
side by side along the split dim are the checkpoint tensor exactly, and the
ranks' partial products add up to the full layer's."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

import octavo.model.layers.linear as linear_module
import octavo.model.layers.vocab_parallel as vocab_module
from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from octavo.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from octavo.model.loader import default_dtype, load_model
from octavo.model.models.causal_lm import CausalLM


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ranks(n: int, build: Callable[[], torch.nn.Module]) -> list:
    """build() as rank r of n, for every r, in float64 (exact sums to compare)."""
    layers = []
    for rank in range(n):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=n)), default_dtype(torch.float64):
            layers.append(build())
    return layers


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, *shard_id: object) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard_id)


@pytest.fixture()
def no_collectives(monkeypatch):
    """Each simulated rank's forward returns its own partial result."""
    monkeypatch.setattr(linear_module, "tensor_model_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(vocab_module, "tensor_model_parallel_all_reduce", lambda x: x)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_column_parallel(tp):
    weight, bias = _randn(12, 5, seed=1), _randn(12, seed=2)
    layers = _ranks(tp, lambda: ColumnParallelLinear(5, 12, bias=True))
    for layer in layers:
        _load(layer, "weight", weight)
        _load(layer, "bias", bias)
    assert torch.equal(torch.cat([l.weight for l in layers]), weight)
    assert torch.equal(torch.cat([l.bias for l in layers]), bias)
    x = _randn(3, 5, seed=3)
    torch.testing.assert_close(torch.cat([l(x) for l in layers], dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp", [2, 3])
def test_merged_gate_up(tp):
    gate, up = _randn(12, 5, seed=4), _randn(12, 5, seed=5)
    layers = _ranks(tp, lambda: MergedColumnParallelLinear(5, [12, 12], bias=False))
    for layer in layers:
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
    # Each rank holds its gate rows, then its up rows.
    local = 12 // tp
    assert all(l.output_sizes == [local, local] for l in layers)
    assert torch.equal(torch.cat([l.weight[:local] for l in layers]), gate)
    assert torch.equal(torch.cat([l.weight[local:] for l in layers]), up)
    with pytest.raises(ValueError, match="shard_id must be a part index"):
        _load(layers[0], "weight", gate, 2)


# (query heads, KV heads, ranks): KV heads split, one per rank, and replicated
# on 2, 3 and 4 ranks when there are fewer than ranks.
@pytest.mark.parametrize("heads,kv_heads,tp", [
    (4, 2, 2), (8, 4, 2), (6, 3, 3), (12, 6, 3), (4, 1, 2), (6, 1, 3), (8, 2, 4), (4, 4, 1),
])
def test_qkv_with_grouped_kv_heads(heads, kv_heads, tp):
    head_dim, hidden = 2, 6
    q = _randn(heads * head_dim, hidden, seed=6)
    k, v = _randn(kv_heads * head_dim, hidden, seed=7), _randn(kv_heads * head_dim, hidden, seed=8)
    biases = {s: _randn(t.shape[0], seed=9 + i) for i, (s, t) in enumerate({"q": q, "k": k, "v": v}.items())}
    layers = _ranks(tp, lambda: QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True))
    for layer in layers:
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            _load(layer, "weight", tensor, shard_id)
            _load(layer, "bias", biases[shard_id], shard_id)
    local_q, local_kv = heads // tp, max(1, kv_heads // tp)
    parts = [dict(zip("qkv", l.weight.split(l.output_sizes))) for l in layers]
    bias_parts = [dict(zip("qkv", l.bias.split(l.output_sizes))) for l in layers]
    assert all(l.num_heads == local_q and l.num_kv_heads == local_kv for l in layers)
    assert torch.equal(torch.cat([p["q"] for p in parts]), q)
    assert torch.equal(torch.cat([b["q"] for b in bias_parts]), biases["q"])
    replicas = max(1, tp // kv_heads)
    for name, full in (("k", k), ("v", v)):
        # Replicas are neighbours; one of each, in rank order, is the whole tensor.
        assert torch.equal(torch.cat([p[name] for p in parts[::replicas]]), full)
        assert torch.equal(torch.cat([b[name] for b in bias_parts[::replicas]]), biases[name])
        # And every rank holds the KV heads its query heads attend with.
        group = heads // kv_heads
        for rank, p in enumerate(parts):
            first_kv = rank * local_q // group
            want = full[first_kv * head_dim : (first_kv + local_kv) * head_dim]
            assert torch.equal(p[name], want)


def test_qkv_head_counts_that_do_not_split():
    with pytest.raises(ValueError, match="num_attention_heads .6. is not divisible by tensor_parallel_size 4"):
        _ranks(4, lambda: QKVParallelLinear(8, 2, 6, 2, bias=False))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 is not a multiple of num_key_value_heads 2"):
        _ranks(3, lambda: QKVParallelLinear(8, 2, 6, 2, bias=False))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_row_parallel_adds_the_bias_once(tp, no_collectives):
    weight, bias = _randn(7, 12, seed=20), _randn(7, seed=21)
    layers = _ranks(tp, lambda: RowParallelLinear(12, 7, bias=True))
    for layer in layers:
        _load(layer, "weight", weight)
        _load(layer, "bias", bias)
        assert torch.equal(layer.bias, bias)  # whole on every rank
    assert torch.equal(torch.cat([l.weight for l in layers], dim=1), weight)
    x = _randn(3, 12, seed=22)
    partials = [l(x_part) for l, x_part in zip(layers, x.chunk(tp, dim=-1))]
    torch.testing.assert_close(sum(partials), F.linear(x, weight, bias))


@pytest.mark.parametrize("vocab,tp", [(12, 2), (10, 3), (11, 2), (10, 4)])
def test_vocab_parallel_embedding_and_lm_head(vocab, tp, no_collectives):
    table = _randn(vocab, 4, seed=30)
    rows = -(-vocab // tp)
    embeds = _ranks(tp, lambda: VocabParallelEmbedding(vocab, 4))
    heads = _ranks(tp, lambda: ParallelLMHead(vocab, 4))
    for layer in embeds + heads:
        _load(layer, "weight", table)
        assert layer.weight.shape == (rows, 4)  # padded to a multiple of tp_size
    for layers in (embeds, heads):
        stacked = torch.cat([l.weight for l in layers])
        assert torch.equal(stacked[:vocab], table) and not stacked[vocab:].any()
    ids = torch.tensor([0, vocab - 1, 3, vocab // 2])
    assert torch.equal(sum(e(ids) for e in embeds), F.embedding(ids, table))
    hidden = _randn(2, 4, seed=31)
    local = [h.linear_method.apply(h, hidden, None) for h in heads]
    torch.testing.assert_close(torch.cat(local, dim=-1)[:, :vocab], hidden @ table.T)


def test_a_tensor_of_the_wrong_shape_is_refused():
    (layer,) = _ranks(1, lambda: ColumnParallelLinear(5, 12, bias=False))
    with pytest.raises(ValueError, match=r"shape \(12, 6\) does not match the expected \(12, 5\)"):
        _load(layer, "weight", _randn(12, 6, seed=40))
    embed = _ranks(2, lambda: VocabParallelEmbedding(10, 4))[1]
    with pytest.raises(ValueError, match=r"expected \(10, 4\)"):
        _load(embed, "weight", _randn(9, 4, seed=41))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whole_model_loads_each_ranks_shards(variant, tp):
    """load_model as rank r of tp: the loader routes q/k/v and gate/up through
    packed_modules_mapping into each rank's shard, and the ranks' shards
    together are the checkpoint (tiny llama: 4 heads, 2 KV heads)."""
    folder = variant("llama")
    stored = load_file(folder / "model.safetensors")
    models = []
    for rank in range(tp):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=tp)):
            models.append(load_model(folder)[0])
    replicas = max(1, tp // 2)
    for i in range(2):
        prefix = f"model.layers.{i}"
        attn = [m.get_submodule(f"{prefix}.self_attn") for m in models]
        mlp = [m.get_submodule(f"{prefix}.mlp") for m in models]
        qkv = [dict(zip("qkv", a.qkv_proj.weight.split(a.qkv_proj.output_sizes))) for a in attn]
        assert torch.equal(torch.cat([p["q"] for p in qkv]), stored[f"{prefix}.self_attn.q_proj.weight"])
        for name in "kv":
            assert torch.equal(torch.cat([p[name] for p in qkv[::replicas]]),
                               stored[f"{prefix}.self_attn.{name}_proj.weight"])
        assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), stored[f"{prefix}.self_attn.o_proj.weight"])
        gate_up = [m.gate_up_proj.weight.chunk(2) for m in mlp]
        assert torch.equal(torch.cat([g for g, _ in gate_up]), stored[f"{prefix}.mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([u for _, u in gate_up]), stored[f"{prefix}.mlp.up_proj.weight"])
        assert torch.equal(torch.cat([m.down_proj.weight for m in mlp], dim=1), stored[f"{prefix}.mlp.down_proj.weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([m.get_parameter(name) for m in models]), stored[name])
    assert CausalLM.packed_modules_mapping["k_proj"] == ("qkv_proj", "k")
