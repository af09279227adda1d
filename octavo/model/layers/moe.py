"""A mixture-of-experts feed-forward block: a softmax router picks each token's top-k experts, the
experts' gated MLPs run on the rows routed to them (``quant/moe.py``), the weighted results are
summed; Qwen2-MoE adds a shared expert every token goes through, scaled by a sigmoid gate.

Under tensor parallelism every rank holds every expert's slice of the intermediate features (the
experts split as a gated MLP does: gate/up by outputs, down by inputs) and one all-reduce sums the
block."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.distributed.communication import tensor_model_parallel_all_reduce
from octavo.distributed.parallel_state import get_parallel_state
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ExpertsConfig
from octavo.model.layers.elementwise import ACTIVATIONS
from octavo.model.layers.linear import ReplicatedLinear, divide, load_shard, load_unsplit, output_part
from octavo.model.layers.mlp import GatedMLP
from octavo.quant.base import FusedMoEMethod, LinearWeightHolder
from octavo.quant.moe import UnquantizedMoEMethod
from octavo.quant.unquantized import UnquantizedLinearMethod

# A checkpoint tensor's place in the experts' parameters: (expert, "gate" | "up" | "down"), or
# (None, "gate_up" | "down") for the fused 3-D tensors holding every expert at once.
ExpertShard = tuple[Optional[int], str]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k]): softmax over the experts in
    float32, the top_k largest, renormalised to sum to one when asked (Mixtral; Qwen's norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(LinearWeightHolder):
    """Every expert of one layer: ``w13_weight`` [experts, 2 * intermediate, hidden] (gate rows, then
    up rows) and ``w2_weight`` [experts, hidden, intermediate], this rank's intermediate slice."""

    def __init__(self, experts: ExpertsConfig, hidden: int, act: str, names: tuple[str, str, str],
                 method: Optional[FusedMoEMethod] = None) -> None:
        """``names``: what the checkpoint calls each expert's gate, up and down projections
        (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral: ``w1``, ``w3``, ``w2``)."""
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_experts = experts.num_experts
        self.intermediate = divide(experts.intermediate_size, self.tp_size, "the experts' intermediate features")
        self.names = names
        self.activation = ACTIVATIONS[act]
        self.method = method or UnquantizedMoEMethod()
        self.method.create_weights(self, self.num_experts, hidden, self.intermediate, torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    @property
    def weight_method(self) -> FusedMoEMethod:
        return self.method

    def checkpoint_tensors(self, leaf: str, stored: set[str], prefix: str) -> dict[str, ExpertShard]:
        """The checkpoint tensors (names relative to this module) that fill parameter ``leaf``: one
        per expert, or the fused 3-D tensor where the checkpoint (``stored``) has it. ``leaf`` is
        ``w13_<tensor>`` (gate and up) or ``w2_<tensor>`` (down), ``<tensor>`` what the checkpoint
        calls each expert's tensor: ``weight``, or a pre-quantized format's ``qweight``, ``scales`` ..."""
        side, _, tensor = leaf.partition("_")
        gate, up, down = self.names
        if side == "w13":
            if tensor == "weight" and f"{prefix}.gate_up_proj" in stored:
                return {"gate_up_proj": (None, "gate_up")}
            return {**{f"{e}.{gate}.{tensor}": (e, "gate") for e in range(self.num_experts)},
                    **{f"{e}.{up}.{tensor}": (e, "up") for e in range(self.num_experts)}}
        if tensor == "weight" and f"{prefix}.down_proj" in stored:
            return {"down_proj": (None, "down")}
        return {f"{e}.{down}.{tensor}": (e, "down") for e in range(self.num_experts)}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: ExpertShard) -> None:
        """One expert's tensor into its slice of ``param``, split as a gated MLP's: gate/up along
        ``param.output_dim``, down along ``param.input_dim`` (dims counted within one expert)."""
        expert, part = shard
        n = self.intermediate
        if part in ("gate", "up"):
            if param.output_dim is None:  # one tensor for gate and up (or each its own copy: per_part)
                load_unsplit(param, loaded, ("gate", "up").index(part), param.data[expert])
            else:  # gate rows, then up rows
                rows = output_part(param, 0 if part == "gate" else n, n, param.data[expert])
                load_shard(rows, loaded, param.output_dim, self.tp_rank, self.tp_size)
        elif part == "down" and expert is not None:
            load_shard(param.data[expert], loaded, param.input_dim, self.tp_rank, self.tp_size)
        elif part == "gate_up":  # [experts, 2 * intermediate, hidden]: gate rows then up rows
            gate, up = loaded.chunk(2, dim=1)
            load_shard(param.data[:, :n], gate, 1, self.tp_rank, self.tp_size)
            load_shard(param.data[:, n:], up, 1, self.tp_rank, self.tp_size)
        else:  # fused down: [experts, hidden, intermediate]
            load_shard(param.data, loaded, 2, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, topk_weights, topk_ids)


class SparseMoEBlock(nn.Module):
    """The router (``gate``), the experts, and the shared expert where the family has one."""

    def __init__(self, arch: ArchConfig, backends: ModelBackends, prefix: str,
                 expert_names: tuple[str, str, str]) -> None:
        super().__init__()
        experts = arch.experts
        if experts is None:
            raise ValueError(f"{arch.architecture}: a mixture-of-experts block needs the experts' config")
        self.top_k, self.renormalize = experts.top_k, experts.renormalize
        # The router stays in float: it decides which weights run, and is tiny.
        self.gate = ReplicatedLinear(arch.hidden_size, experts.num_experts, False, UnquantizedLinearMethod(),
                                     f"{prefix}.gate")
        method = backends.quantization.moe_method(f"{prefix}.experts", expert_names, experts.num_experts)
        self.experts = FusedMoE(experts, arch.hidden_size, arch.hidden_act, expert_names, method)
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[ReplicatedLinear] = None
        if experts.shared_intermediate_size:
            self.shared_expert = GatedMLP(arch.hidden_size, experts.shared_intermediate_size, arch.hidden_act,
                                          False, backends, f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(arch.hidden_size, 1, False, UnquantizedLinearMethod(),
                                                       f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.experts.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
