"""Expert parallelism, rank by rank without processes (``parallel_state`` simulates rank r of 2):
each rank holds whole experts, half of them, reads only their tensors from the checkpoint (per
expert or fused 3-D), and the ranks' expert outputs sum to the whole layer's, which is what the
block's all-reduce computes. Through worker processes: tests/executor/test_expert_parallel.py."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model import loader
from octavo.model.config import ExpertsConfig
from octavo.model.layers.moe import FusedMoE, select_experts
from octavo.model.loader import load_model
from tests.model_factory import load_hf_model

RANKS = 2


def _fused_copy(folder, tmp_path):
    """The checkpoint with every layer's experts as the 3-D tensors transformers keeps in memory."""
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    save_file({k: v.contiguous() for k, v in load_hf_model(folder).state_dict().items()},
              str(fused / "model.safetensors"))
    return fused


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_each_rank_holds_and_reads_only_its_experts(name, layout, variant, tmp_path, monkeypatch):
    folder = variant(name) if layout == "per_expert" else _fused_copy(variant(name), tmp_path)
    whole, arch = load_model(folder, "float32")
    block = whole.model.layers[0].mlp
    experts = arch.experts.num_experts
    x = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(block.gate(x), arch.experts.top_k, arch.experts.renormalize)
    read: list[set[str]] = []
    load_tensors = loader._load_tensors
    monkeypatch.setattr(loader, "_load_tensors", lambda net, source, wanted, device: (
        read.append(set(wanted)), load_tensors(net, source, wanted, device))[1])
    total = torch.zeros_like(x)
    for rank in range(RANKS):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=RANKS, expert_parallel=True)):
            shard, _ = load_model(folder, "float32")
        held = range(rank * experts // RANKS, (rank + 1) * experts // RANKS)
        for layer, ours in zip(whole.model.layers, shard.model.layers):
            if not hasattr(ours.mlp, "experts"):
                continue  # Qwen2-MoE's dense layer
            assert torch.equal(ours.mlp.experts.w13_weight, layer.mlp.experts.w13_weight[held.start:held.stop])
            assert torch.equal(ours.mlp.experts.w2_weight, layer.mlp.experts.w2_weight[held.start:held.stop])
        names = read[-1]
        if layout == "per_expert":
            numbered = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
            assert numbered == set(held)
        total += shard.model.layers[0].mlp.experts(x, weights, ids)
    torch.testing.assert_close(total, block.experts(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_experts_that_do_not_split_evenly_name_the_field():
    experts = ExpertsConfig(num_experts=6, top_k=2, intermediate_size=8, renormalize=False)
    with parallel_state(ParallelState(tp_rank=0, tp_size=4, expert_parallel=True)):
        with pytest.raises(ValueError, match="enable_expert_parallel: the model's 6 experts do not split evenly "
                                             "over tensor_parallel_size 4"):
            FusedMoE(experts, hidden=8, act="silu", names=("gate_proj", "up_proj", "down_proj"))
