"""llama.cpp's tensor names and layouts, mapped back to Hugging Face's.

llama.cpp's converter renames every tensor (``blk.0.attn_q.weight`` for
``model.layers.0.self_attn.q_proj.weight``) and, for the llama family
only, reorders the rows of q_proj and k_proj: llama.cpp rotates adjacent
pairs of a head's dims (GPT-J style), Hugging Face's Llama rotates the two
halves, so each head's rows are interleaved as [0, d/2, 1, d/2+1, ...].
Qwen2/3 keep Hugging Face's order (llama.cpp runs them with NeoX rotary).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

# llama.cpp's architecture name -> the Hugging Face architecture it was converted from.
# A llama file with experts is Mixtral (experts.py); a deepseek2 file with sigmoid gating is DeepSeek-V3
# (deepseek2.py).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "deepseek2": "DeepseekV2ForCausalLM"}
# Architectures whose q/k rows the converter interleaved.
PERMUTED = ("llama",)

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture's router and Qwen2-MoE's shared expert (the experts themselves: experts.py).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    # DeepSeek-V2/V3's latent attention (deepseek2; its split kv_b_proj: deepseek2.py).
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
# Block tensors whose Hugging Face name is not their module's weight or bias: DeepSeek-V3's router bias.
_BLOCK_TENSORS = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")
# Linear layers that run fused (one product): their parts must share a storage type to stay quantized.
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"))
# Linear layers that always run in float: a mixture's routers (they choose which weights run) and latent
# attention's kv_b_proj (decode multiplies by its halves directly, model/layers/latent_attention.py).
FLOAT_LINEARS = (".mlp.gate", ".mlp.shared_expert_gate", ".self_attn.kv_b_proj")


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor; None for one the model has no place for."""
    match = _BLOCK_NAME.match(gguf_name)
    if match:
        layer, part, leaf = match.groups()
        if f"{part}.{leaf}" in _BLOCK_TENSORS:
            return f"model.layers.{layer}.{_BLOCK_TENSORS[part + '.' + leaf]}"
        module = _BLOCK.get(part)
        return None if module is None else f"model.layers.{layer}.{module}.{leaf}"
    match = _GLOBAL_NAME.match(gguf_name)
    if match and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    return None


def unpermute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's per-head interleave of q/k rows (any trailing dims)."""
    rows = tensor.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of an even size")
    return (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape).contiguous())


def rotary_heads(architecture: str, hf: str, num_heads: int, num_kv_heads: int) -> Optional[int]:
    """The head count to unpermute ``hf``'s rows by, None when it was not permuted."""
    if architecture not in PERMUTED:
        return None
    if ".self_attn.q_proj." in hf:
        return num_heads
    if ".self_attn.k_proj." in hf:
        return num_kv_heads
    return None
