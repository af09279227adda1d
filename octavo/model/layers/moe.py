"""A mixture-of-experts feed-forward block: a router picks each token's top-k experts (softmax, or
DeepSeek's grouped and sigmoid variants), the experts' gated MLPs run on the rows routed to them
(``quant/moe.py``), the weighted results are summed; Qwen2-MoE adds a shared expert every token
goes through, scaled by a sigmoid gate, DeepSeek one without a gate.

Under tensor parallelism every rank holds every expert's slice of the intermediate features (the
experts split as a gated MLP does: gate/up by outputs, down by inputs) and one all-reduce sums the
block. With expert parallelism (``ParallelState.expert_parallel``) each rank holds whole experts
instead, ``num_experts / tp_size`` of them, and loads only those. The hidden states are already
whole on every rank after attention's all-reduce, so no dispatch is needed: every rank routes all
tokens (the router is replicated), runs the (token, choice) pairs whose expert it holds, and the
same one all-reduce sums the block. An all-to-all sending each rank only its pairs' rows moves fewer
bytes at large batches but costs three collectives and an all-gather instead of one; on gloo the
all-reduce measured 3 to 20 times faster at 1 to 128 tokens (benchmarks/ep_dispatch.py, figures in
docs/ENGINE.md). The shared expert (Qwen2-MoE) is split by tensor parallelism as a dense MLP is,
expert parallel or not."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.distributed.communication import tensor_model_parallel_all_reduce
from octavo.distributed.parallel_state import get_parallel_state
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ExpertRouting, ExpertsConfig
from octavo.model.layers.elementwise import ACTIVATIONS
from octavo.model.layers.linear import ReplicatedLinear, divide, load_shard, load_unsplit, output_part
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.route_counts import RouteCounter
from octavo.quant.base import FusedMoEMethod, LinearWeightHolder
from octavo.quant.moe import UnquantizedMoEMethod
from octavo.quant.unquantized import UnquantizedLinearMethod

# A checkpoint tensor's place in the experts' parameters: (expert, "gate" | "up" | "down"), or
# (None, "gate_up" | "down") for the fused 3-D tensors holding every expert at once.
ExpertShard = tuple[Optional[int], str]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   routing: ExpertRouting = ExpertRouting(), score_bias: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k]): softmax over the experts in
    float32, the top_k largest, renormalised to sum to one when asked (Mixtral; Qwen's norm_topk_prob).

    ``routing`` (DeepSeek): softmax or sigmoid scores; ``score_bias`` [experts] added to the scores
    that choose (never to the weights); only the ``top_groups`` best groups of experts eligible;
    the weights times ``routing.scale``."""
    if routing == ExpertRouting():
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(top_k, dim=-1)
    else:
        weights, ids = _grouped_top_k(router_logits, top_k, routing, score_bias)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routing.scale if routing.scale != 1.0 else weights, ids


def _grouped_top_k(router_logits: torch.Tensor, top_k: int, routing: ExpertRouting,
                   score_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias
    if routing.top_groups < routing.groups:
        grouped = choice.view(choice.shape[0], routing.groups, -1)
        if routing.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(routing.top_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    return scores.gather(1, ids), ids


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
        self.expert_parallel = state.expert_parallel and state.tp_size > 1
        self.total_experts = experts.num_experts
        if self.expert_parallel:
            if experts.num_experts % state.tp_size:
                raise ValueError(f"enable_expert_parallel: the model's {experts.num_experts} experts do not split "
                                 f"evenly over tensor_parallel_size {state.tp_size}")
            # This rank's experts are [expert_start, expert_start + num_experts), each whole.
            self.num_experts = experts.num_experts // state.tp_size
            self.expert_start = state.tp_rank * self.num_experts
            self.intermediate = experts.intermediate_size
            self.slice_rank, self.slice_size = 0, 1
        else:
            self.num_experts, self.expert_start = experts.num_experts, 0
            self.intermediate = divide(experts.intermediate_size, self.tp_size, "the experts' intermediate features")
            self.slice_rank, self.slice_size = self.tp_rank, self.tp_size
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
        per expert this rank holds (its index here), or the fused 3-D tensor where the checkpoint
        (``stored``) has it. ``leaf`` is ``w13_<tensor>`` (gate and up) or ``w2_<tensor>`` (down),
        ``<tensor>`` what the checkpoint calls each expert's tensor: ``weight``, or a pre-quantized
        format's ``qweight``, ``scales`` ..."""
        side, _, tensor = leaf.partition("_")
        gate, up, down = self.names
        if side == "w13":
            if tensor == "weight" and f"{prefix}.gate_up_proj" in stored:
                return {"gate_up_proj": (None, "gate_up")}
            return {**{f"{e}.{gate}.{tensor}": (e - self.expert_start, "gate") for e in self._held()},
                    **{f"{e}.{up}.{tensor}": (e - self.expert_start, "up") for e in self._held()}}
        if tensor == "weight" and f"{prefix}.down_proj" in stored:
            return {"down_proj": (None, "down")}
        return {f"{e}.{down}.{tensor}": (e - self.expert_start, "down") for e in self._held()}

    def other_ranks_tensors(self) -> set[str]:
        """The per-expert checkpoint tensors (names relative to this module) of the experts other
        ranks hold: in the checkpoint, never read here."""
        held = set(self._held())
        tensors = {name.partition("_")[2] for name, _ in self.named_parameters(recurse=False)}
        return {f"{e}.{name}.{tensor}" for e in range(self.total_experts) if e not in held
                for name in self.names for tensor in tensors}

    def _held(self) -> range:
        return range(self.expert_start, self.expert_start + self.num_experts)

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
                load_shard(rows, loaded, param.output_dim, self.slice_rank, self.slice_size)
        elif part == "down" and expert is not None:
            load_shard(param.data[expert], loaded, param.input_dim, self.slice_rank, self.slice_size)
        elif part == "gate_up":  # [experts, 2 * intermediate, hidden]: gate rows then up rows
            gate, up = loaded.chunk(2, dim=1)
            dim = 0 if self.expert_parallel else 1  # this rank's experts, or its rows of every expert
            load_shard(param.data[:, :n], gate, dim, self.tp_rank, self.tp_size)
            load_shard(param.data[:, n:], up, dim, self.tp_rank, self.tp_size)
        else:  # fused down: [experts, hidden, intermediate]
            load_shard(param.data, loaded, 0 if self.expert_parallel else 2, self.tp_rank, self.tp_size)

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
        self.top_k, self.renormalize, self.routing = experts.top_k, experts.renormalize, experts.routing
        # The router stays in float: it decides which weights run, and is tiny.
        self.gate = ReplicatedLinear(arch.hidden_size, experts.num_experts, False, UnquantizedLinearMethod(),
                                     f"{prefix}.gate")
        if experts.routing.score_bias:  # float32 as trained: it shifts scores that differ in small decimals
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(experts.num_experts, dtype=torch.float32), requires_grad=False)
        method = backends.quantization.moe_method(f"{prefix}.experts", expert_names, experts.num_experts)
        self.experts = FusedMoE(experts, arch.hidden_size, arch.hidden_act, expert_names, method)
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[ReplicatedLinear] = None
        if experts.shared_intermediate_size:
            self.shared_expert = GatedMLP(arch.hidden_size, experts.shared_intermediate_size, arch.hidden_act,
                                          False, backends, f"{prefix}.shared_expert")
            if experts.shared_expert_gate:
                self.shared_expert_gate = ReplicatedLinear(arch.hidden_size, 1, False, UnquantizedLinearMethod(),
                                                           f"{prefix}.shared_expert_gate")
        # Where this block counts its routes for the routing statistics, set by the model runner
        # (route_counts.py); a model whose statistics no one reads (a draft) counts nothing.
        self.route_counter: Optional[RouteCounter] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, self.routing,
                                      getattr(self.gate, "e_score_correction_bias", None))
        if self.route_counter is not None:
            self.route_counter.count(ids)
        out = self.experts(x, weights, ids)
        if self.experts.tp_size > 1:  # each rank's share of the intermediate features, or of the experts
            out = tensor_model_parallel_all_reduce(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def moe_blocks(model: nn.Module) -> dict[int, SparseMoEBlock]:
    """The mixture blocks of this rank's layers, by decoder layer index (empty for a dense model)."""
    # Other pipeline stages' layers are empty placeholders: the list index is the layer's.
    return {index: block for index, layer in enumerate(model.model.layers)
            for block in layer.modules() if isinstance(block, SparseMoEBlock)}


def has_experts(model: nn.Module) -> bool:
    return any(isinstance(module, SparseMoEBlock) for module in model.modules())
