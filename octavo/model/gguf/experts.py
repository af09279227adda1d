"""A GGUF file's mixture of experts: llama.cpp's ``qwen2moe``, ``qwen3moe``, and ``llama`` with
``expert_count`` set (Mixtral); ``deepseek2`` stacks its experts the same way (its config: deepseek2.py).

The converter stacks each sparse layer's experts into three 3-D tensors, ``blk.N.ffn_gate_exps``
and ``ffn_up_exps`` [experts, expert_ff, hidden] and ``ffn_down_exps`` [experts, hidden, expert_ff]
(torch's order; GGUF lists dims innermost first), beside the router ``ffn_gate_inp`` [experts,
hidden] (Qwen2-MoE's shared expert and its gate have names of their own, names.py). Expert ``e``'s
projections are slice ``e`` of each, so the file's tensors load as the per-expert tensors of the
Hugging Face checkpoint it came from, whatever their block type: Q8_0, Q4_0 and Q4_1 experts stay
quantized on the int kernels, as a linear layer's weight does (``quantized_experts``).

Metadata: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length`` (with llama.cpp's defaults where absent). Whether the chosen
experts' weights are renormalised is fixed per architecture in llama.cpp (Mixtral and Qwen3-MoE:
yes; Qwen2-MoE: no) unless ``expert_weights_norm`` says. A Qwen layer without a router keeps a
dense MLP (``mlp_only_layers``)."""
from __future__ import annotations

import re
from typing import Any, Optional

from octavo.checkpoint.gguf_file import GgufFile, GgufTensor
from octavo.model.gguf.checks import check_tensor

# The stacked tensors of a layer's experts, in the order gate, up, down.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# What each family's checkpoint calls an expert's gate, up and down projections.
PROJECTIONS = {"llama": ("w1", "w3", "w2"), "qwen2moe": ("gate_proj", "up_proj", "down_proj"),
               "qwen3moe": ("gate_proj", "up_proj", "down_proj"), "deepseek2": ("gate_proj", "up_proj", "down_proj")}
_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")


def expert_template(gguf_name: str, architecture: str) -> Optional[str]:
    """The Hugging Face name of expert ``{}``'s slice of a stacked expert tensor (a template for
    ``str.format``); None for any other tensor."""
    match = _EXPERT_NAME.match(gguf_name)
    if match is None or architecture not in PROJECTIONS:
        return None
    layer, kind = match.groups()
    projection = PROJECTIONS[architecture][EXPERT_TENSORS.index(kind)]
    return f"model.layers.{layer}.mlp.experts.{{}}.{projection}.weight"


def experts_config_json(file: GgufFile, tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    """config.json's expert fields for ``file`` ({} for a file without experts); ValueError naming a
    stacked expert tensor or router that is missing or of the wrong shape."""
    arch = file.architecture
    # deepseek2's experts are read with the rest of its config (deepseek2.py).
    if arch not in _RENORMALIZE or (arch == "llama" and not file.arch_key("expert_count", 0)):
        return {}
    count, used = int(file.arch_key("expert_count")), int(file.arch_key("expert_used_count"))
    hidden, ff = int(file.arch_key("embedding_length")), int(file.arch_key("feed_forward_length"))
    # llama.cpp: Mixtral's experts are feed_forward_length wide; Qwen's say so apart, else a share of it
    # (a used count of 0 is refused with the experts' config, not divided by).
    expert_ff = int(file.arch_key("expert_feed_forward_length", ff if arch == "llama" else ff // max(used, 1)))
    layers = int(file.arch_key("block_count"))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if arch == "llama" and dense:
        raise ValueError(f"{file.path}: layer {dense[0]} has no router (blk.{dense[0]}.ffn_gate_inp.weight); "
                         "every layer of a llama file with experts must have one")
    for layer in sorted(set(range(layers)) - set(dense)):
        check_expert_tensors(file, tensors, layer, hidden, expert_ff, count)
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": count, "num_experts_per_tok": used,
                "intermediate_size": expert_ff}
    raw = {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": expert_ff,
           "norm_topk_prob": bool(file.arch_key("expert_weights_norm", _RENORMALIZE[arch])),
           "decoder_sparse_step": 1, "mlp_only_layers": dense}
    if arch == "qwen2moe":
        raw["shared_expert_intermediate_size"] = int(file.arch_key("expert_shared_feed_forward_length", ff))
    return raw


def check_expert_tensors(file: GgufFile, tensors: dict[str, GgufTensor], layer: int, hidden: int, expert_ff: int,
                         count: int) -> None:
    """ValueError naming layer ``layer``'s router or stacked expert tensor that is missing or of another shape
    than ``count`` experts of ``expert_ff`` on ``hidden`` give."""
    expected = {"ffn_gate_inp": (hidden, count), "ffn_gate_exps": (hidden, expert_ff, count),
                "ffn_up_exps": (hidden, expert_ff, count), "ffn_down_exps": (expert_ff, hidden, count)}
    for kind, shape in expected.items():
        check_tensor(file, tensors, f"blk.{layer}.{kind}.weight", shape,
                     "embedding_length, expert_feed_forward_length and expert_count")


def quantized_experts(file: GgufFile, kernel_types: dict[str, str]) -> dict[str, str]:
    """Each expert's projection module (Hugging Face name) -> block type, for the layers whose
    experts run on the int kernels: gate, up and down all of a type in ``kernel_types`` (GGUF type
    name -> the kernels' name), gate and up the same (they run fused). Others are dequantized."""
    types: dict[str, dict[str, GgufTensor]] = {}
    for tensor in file.tensors:
        match = _EXPERT_NAME.match(tensor.name)
        if match:
            types.setdefault(match.group(1), {})[match.group(2)] = tensor
    result = {}
    for stacked in types.values():
        kinds = [kernel_types.get(stacked[k].tensor_type.name) if k in stacked else None for k in EXPERT_TENSORS]
        if None in kinds or kinds[0] != kinds[1]:
            continue
        for kind, tensor in zip(kinds, (stacked[k] for k in EXPERT_TENSORS)):
            template = expert_template(tensor.name, file.architecture)
            if template is not None:
                result.update({template.format(e).removesuffix(".weight"): kind for e in range(tensor.shape[-1])})
    return result
