"""llama.cpp's ``deepseek2``: DeepSeek-V2 and DeepSeek-V3 as GGUF files, read back into the
config.json fields and tensors of the Hugging Face checkpoint the converter was given.

Latent attention comes in two layouts. Older files keep ``kv_b_proj`` whole (``attn_kv_b``) and
declare ``head_count_kv`` = heads, ``key_length`` = qk_nope + qk_rope and ``value_length`` =
v_head_dim. Newer ones (those llama.cpp runs in latent space) split it per head into ``attn_k_b``
(each head's W_UK, transposed: [heads, kv_lora_rank, qk_nope] in torch's order) and ``attn_v_b``
([heads, v_head_dim, kv_lora_rank]), declare one KV head of kv_lora_rank + qk_rope (what llama.cpp
caches) and put the per-head sizes in ``key_length_mla`` / ``value_length_mla``; ``joined_kv_b``
puts kv_b_proj back together. A query LoRA is there when ``attention.q_lora_rank`` is (and not 0).

Routing: ``expert_gating_func`` sigmoid is DeepSeek-V3 (noaux_tc, with the per-expert bias
``exp_probs_b.bias`` every sparse layer then has); softmax, or no key (files older than it), is
V2, within the best ``expert_group_used_count`` of ``expert_group_count`` groups where there are
groups. The converter writes ``expert_weights_norm`` only when true and ``expert_weights_scale``
only when the checkpoint's config has it: absent, they are false and 1, as llama.cpp reads them.
The first ``leading_dense_block_count`` layers keep a dense MLP; shared experts are
``expert_shared_count`` x ``expert_feed_forward_length`` wide. YaRN: the converter keeps
mscale_all_dim as ``rope.scaling.yarn_log_multiplier`` (0.1 x mscale_all_dim) and drops mscale,
which llama.cpp then takes to equal it, as in every released DeepSeek config; so does this."""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from octavo.checkpoint.bounds import MAX_LAYERS
from octavo.checkpoint.gguf_file import GgufFile, GgufTensor
from octavo.model.gguf.checks import MAX_WIDTH, check_tensor, metadata_float, metadata_int
from octavo.model.gguf.experts import check_expert_tensors

# expert_gating_func values (llama.cpp's llama_expert_gating_func_type).
_SOFTMAX, _SIGMOID = 1, 2
# Experts of one layer: released models have a few hundred at most.
_MAX_EXPERTS = 1 << 16
_SPLIT_K_B = re.compile(r"^blk\.(\d+)\.attn_k_b\.weight$")


def deepseek2_config_json(file: GgufFile, tensors: dict[str, GgufTensor],
                          rope_scaling: Optional[dict[str, Any]]) -> dict[str, Any]:
    """config.json's DeepSeek fields for ``file`` (over those every GGUF file gives); ValueError
    naming a metadata key out of bounds, or a tensor that is missing or of another shape than the
    metadata say."""
    hidden, heads = metadata_int(file, "embedding_length"), metadata_int(file, "attention.head_count")
    layers = metadata_int(file, "block_count", high=MAX_LAYERS)
    rope = metadata_int(file, "rope.dimension_count")
    kv_lora = metadata_int(file, "attention.kv_lora_rank")
    q_lora = metadata_int(file, "attention.q_lora_rank", 0, low=0) or None
    split = file.arch_key("attention.key_length_mla", None) is not None
    qk = metadata_int(file, "attention.key_length_mla" if split else "attention.key_length")
    v = metadata_int(file, "attention.value_length_mla" if split else "attention.value_length")
    if qk <= rope or rope % 2:
        raise ValueError(f"{file.path}: metadata '{file.architecture}.rope.dimension_count' is {rope}; it must be "
                         f"even and below the key length {qk} (rotary and unrotated dims of each head)")
    experts = metadata_int(file, "expert_count", high=_MAX_EXPERTS)
    used = metadata_int(file, "expert_used_count", high=experts)
    expert_ff = metadata_int(file, "expert_feed_forward_length")
    shared = metadata_int(file, "expert_shared_count", 0, low=0, high=MAX_WIDTH // expert_ff)
    dense = metadata_int(file, "leading_dense_block_count", 0, low=0, high=layers)
    groups = metadata_int(file, "expert_group_count", 1, high=experts)
    gating = metadata_int(file, "expert_gating_func", _SOFTMAX, high=_SIGMOID)
    attention = _attention_tensors(hidden, heads, kv_lora, q_lora, rope, qk - rope, v, split)
    mlp = {"ffn_norm.weight": (hidden,)}
    ff = metadata_int(file, "feed_forward_length")
    dense_mlp = {"ffn_gate.weight": (hidden, ff), "ffn_up.weight": (hidden, ff), "ffn_down.weight": (ff, hidden)}
    width = expert_ff * shared
    shared_mlp = {"ffn_gate_shexp.weight": (hidden, width), "ffn_up_shexp.weight": (hidden, width),
                  "ffn_down_shexp.weight": (width, hidden)} if shared else {}
    bias = {"exp_probs_b.bias": (experts,)} if gating == _SIGMOID else {}
    for layer in range(layers):
        sparse = {**shared_mlp, **bias} if layer >= dense else dense_mlp
        for name, shape in {**attention, **mlp, **sparse}.items():
            check_tensor(file, tensors, f"blk.{layer}.{name}", shape, "the attention, feed-forward and expert "
                         "metadata")
        if layer >= dense:
            check_expert_tensors(file, tensors, layer, hidden, expert_ff, experts)
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if gating == _SIGMOID else "DeepseekV2ForCausalLM"],
        # Every head decompresses its own keys and values (the file's one KV head is llama.cpp's cache).
        "num_key_value_heads": heads,
        "head_dim": rope,
        "kv_lora_rank": kv_lora, "q_lora_rank": q_lora, "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope,
        "v_head_dim": v, "rope_interleave": True,
        "n_routed_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": expert_ff,
        "n_shared_experts": shared, "first_k_dense_replace": dense, "moe_layer_freq": 1,
        "routed_scaling_factor": metadata_float(file, "expert_weights_scale", 1.0),
        "norm_topk_prob": bool(file.arch_key("expert_weights_norm", False, bool)),
        "n_group": groups,
        "topk_group": metadata_int(file, "expert_group_used_count", groups, high=groups),
    }
    if gating == _SIGMOID:
        raw.update(scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        raw.update(scoring_func="softmax", topk_method="group_limited_greedy" if groups > 1 else "greedy")
    if rope_scaling is not None and file.arch_key("rope.scaling.yarn_log_multiplier", None) is not None:
        mscale = metadata_float(file, "rope.scaling.yarn_log_multiplier") / 0.1
        raw["rope_scaling"] = {**rope_scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return raw


def _attention_tensors(hidden: int, heads: int, kv_lora: int, q_lora: Optional[int], rope: int, nope: int, v: int,
                       split: bool) -> dict[str, tuple[int, ...]]:
    """A layer's attention tensors and their shapes (GGUF order: innermost dim first)."""
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,),
        "attn_kv_a_mqa.weight": (hidden, kv_lora + rope),
        "attn_kv_a_norm.weight": (kv_lora,),
        "attn_output.weight": (heads * v, hidden),
    }
    if q_lora is None:
        shapes["attn_q.weight"] = (hidden, heads * (nope + rope))
    else:
        shapes.update({"attn_q_a.weight": (hidden, q_lora), "attn_q_a_norm.weight": (q_lora,),
                       "attn_q_b.weight": (q_lora, heads * (nope + rope))})
    if split:
        shapes.update({"attn_k_b.weight": (nope, kv_lora, heads), "attn_v_b.weight": (kv_lora, v, heads)})
    else:
        shapes["attn_kv_b.weight"] = (kv_lora, heads * (nope + v))
    return shapes


def split_kv_b(gguf_name: str) -> Optional[tuple[str, str]]:
    """(kv_b_proj's Hugging Face name, the attn_v_b tensor's GGUF name) for an ``attn_k_b`` tensor; None for
    any other."""
    match = _SPLIT_K_B.match(gguf_name)
    if match is None:
        return None
    layer = match.group(1)
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight", f"blk.{layer}.attn_v_b.weight"


def joined_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj's weight [heads * (nope + v), kv_lora_rank], each head's key rows then its value rows,
    from ``k_b`` [heads, kv_lora_rank, nope] and ``v_b`` [heads, v, kv_lora_rank]."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])
