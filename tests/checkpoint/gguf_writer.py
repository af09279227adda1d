"""GGUF files written from tiny transformers checkpoints, laid out as
llama.cpp's convert_hf_to_gguf.py lays them out (CI has no llama.cpp):
its tensor names, q/k rows interleaved per head for the llama family,
1-D tensors in F32, metadata under ``<arch>.*``, and the tokenizer as a
"gpt2" (byte-level BPE from tokenizer.json) or "llama" (SentencePiece from
tokenizer.model) vocabulary with CONTROL types for special tokens.

Mixtures of experts (Mixtral as "llama", Qwen2-MoE, Qwen3-MoE) as the
converter's Llama and Qwen2-MoE classes write them: each layer's experts
stacked into ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, the
router ``ffn_gate_inp`` always F32, the expert counts and widths in the
metadata.

DeepSeek-V2/V3 as "deepseek2", as the converter's DeepseekV2Model writes
them: the latent attention's tensors under llama.cpp's names, kv_b_proj
split per head into ``attn_k_b`` (transposed) and ``attn_v_b`` with one KV
head of kv_lora_rank + rope declared (``split_kv_b``), or whole
(``attn_kv_b``) with per-head lengths, as older converters wrote it; the
router bias as ``exp_probs_b.bias``, the shared experts as ``*_shexp``, the
yarn mscale_all_dim as 0.1 x it in ``rope.scaling.yarn_log_multiplier``.

``reference_folder`` writes the Hugging Face folder whose weights are what
the file holds after its block quantization (dequantized), so a quantized
file can be judged against transformers."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from octavo.checkpoint.sentencepiece import read_model_file

ARCH_NAMES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2moe",
              "Qwen3MoeForCausalLM": "qwen3moe", "DeepseekV2ForCausalLM": "deepseek2",
              "DeepseekV3ForCausalLM": "deepseek2"}
_TYPES = {name: getattr(gguf.GGMLQuantizationType, name) for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
          "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b"}
# Tensors that are not their module's weight or bias (the converter renames e_score_correction_bias first).
_LEAVES = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
            "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}
_ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight")  # ffn_gate_inp: the converter keeps it F32


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    if rest in _LEAVES:
        return f"blk.{layer}.{_LEAVES[rest]}"
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK[module]}.{leaf}"


def interleave(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's permute: each head's halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def tensor_type(name: str, tensor: torch.Tensor, matrix_type: str, types: Optional[dict[str, str]]) -> str:
    """The type Hugging Face tensor ``name`` is written in: ``types``' override, else F32 for 1-D
    tensors and routers, ``matrix_type`` for the other matrices."""
    if types and name in types:
        return types[name]
    return "F32" if tensor.dim() < 2 or name.endswith(_ROUTERS) else matrix_type


def _quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.quantize(values.astype(np.float32), _TYPES[type_name])


def stored_values(tensor: torch.Tensor, type_name: str) -> torch.Tensor:
    """What a ``type_name`` GGUF tensor gives back for ``tensor``, as float32."""
    if type_name in ("F32",):
        return tensor.float()
    if type_name == "F16":
        return tensor.half().float()
    if type_name == "BF16":
        return tensor.bfloat16().float()
    data = _quantize(tensor.float().numpy(), type_name)
    return torch.from_numpy(gguf.quants.dequantize(data, _TYPES[type_name]).copy()).reshape(tensor.shape)


def write_gguf(
    folder: Path,
    path: Path,
    matrix_type: str = "F32",
    *,
    types: Optional[dict[str, str]] = None,
    vocab: str = "gpt2",
    sliding_window: bool = False,
    split_kv_b: bool = True,
) -> Path:
    """``folder``'s model as a GGUF file at ``path``: 2-D weights in
    ``matrix_type`` (``types`` overrides per Hugging Face tensor name), 1-D
    in F32; ``vocab`` "gpt2" from tokenizer.json or "llama" from tokenizer.model;
    ``split_kv_b``: DeepSeek's kv_b_proj as attn_k_b and attn_v_b (else whole)."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCH_NAMES[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if sliding_window and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "deepseek2":
        _write_latent_attention_metadata(writer, config, split_kv_b)
        _write_deepseek_experts_metadata(writer, config)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_rope_dimension_count(config["head_dim"])
        _write_experts_metadata(writer, config)
    _write_vocab(writer, folder, vocab)
    experts: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}  # stacked name -> expert -> (name, tensor)
    for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
        expert = _EXPERT.match(name)
        if expert:
            layer, index, projection = expert.groups()
            experts.setdefault(f"blk.{layer}.{_STACKED[projection]}.weight", {})[int(index)] = name, tensor
            continue
        if arch == "llama" and ".self_attn.q_proj." in name:
            tensor = interleave(tensor, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            tensor = interleave(tensor, kv_heads)
        elif split_kv_b and name.endswith(".self_attn.kv_b_proj.weight"):
            kind = tensor_type(name, tensor, matrix_type, types)
            for half, values in zip(("attn_k_b", "attn_v_b"), _split_kv_b(tensor, config)):
                _add_tensor(writer, gguf_name(name).replace("attn_kv_b", half), values, kind)
            continue
        _add_tensor(writer, gguf_name(name), tensor, tensor_type(name, tensor, matrix_type, types))
    for stacked, by_expert in experts.items():
        parts = [by_expert[e] for e in sorted(by_expert)]
        _add_tensor(writer, stacked, torch.stack([t for _, t in parts]),
                    tensor_type(parts[0][0], parts[0][1], matrix_type, types))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, kind: str) -> None:
    values = tensor.float().numpy()
    if kind == "F32":
        writer.add_tensor(name, values)
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    else:
        writer.add_tensor(name, _quantize(values, kind), raw_dtype=_TYPES[kind])


def _split_kv_b(weight: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_b [heads, kv_lora_rank, nope], v_b [heads, v, kv_lora_rank]) of kv_b_proj's weight."""
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    by_head = weight.view(config["num_attention_heads"], nope + v, config["kv_lora_rank"])
    return by_head[:, :nope].transpose(1, 2).contiguous(), by_head[:, nope:].contiguous()


def _write_latent_attention_metadata(writer: gguf.GGUFWriter, config: dict, split_kv_b: bool) -> None:
    """The attention keys: one KV head of the latent and rotary key, the per-head lengths apart, for a split
    kv_b_proj; every head's own lengths beside a whole one."""
    kv_lora, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    qk, v = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(kv_lora + rope)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(qk)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(config["num_attention_heads"])
        writer.add_key_length(qk)
        writer.add_value_length(v)
    writer.add_rope_dimension_count(rope)
    writer.add_kv_lora_rank(kv_lora)
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    params = config.get("rope_parameters") or {}
    if params.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if params.get(key) is not None:
                add(params[key])
        if params.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _write_deepseek_experts_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """The expert keys: counts, widths, groups, the dense lead, the gating function; the scale and
    renormalisation as the converter writes them (only when set, only when true)."""
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("n_group") is not None:
        writer.add_expert_group_count(config["n_group"])
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(config["topk_group"])
    if config.get("scoring_func"):
        kinds = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
        writer.add_expert_gating_func(kinds[config["scoring_func"]])


def _write_experts_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """The converter's expert keys: counts for every mixture, Qwen's widths (Mixtral's experts are
    feed_forward_length wide)."""
    count = config.get("num_local_experts") or config.get("num_experts")
    if not count:
        return
    writer.add_expert_count(count)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _write_vocab(writer: gguf.GGUFWriter, folder: Path, vocab: str) -> None:
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    if vocab == "gpt2":
        data = json.loads((folder / "tokenizer.json").read_text())
        ids = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
        tokens = [token for token, _ in sorted(ids.items(), key=lambda kv: kv[1])]
        special = {t["content"] for t in data["added_tokens"] if t["special"]}
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
        writer.add_token_merges(merges)
        by_text = {t: i for i, t in enumerate(tokens)}
        # The converter reads tokenizer.json's post-processor: this one adds BOS.
        writer.add_add_bos_token(True)
    else:
        spm = read_model_file(folder / "tokenizer.model")
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(spm.pieces)
        writer.add_token_scores(spm.scores)
        writer.add_token_types(spm.types)
        writer.add_add_bos_token(bool(tok_config.get("add_bos_token", True)))
        by_text = {t: i for i, t in enumerate(spm.pieces)}
    writer.add_bos_token_id(by_text[tok_config.get("bos_token", "<s>")])
    writer.add_eos_token_id(by_text[tok_config.get("eos_token", "</s>")])
    if "pad_token" in tok_config:
        writer.add_pad_token_id(by_text[tok_config["pad_token"]])
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def reference_folder(folder: Path, dst: Path, matrix_type: str, types: Optional[dict[str, str]] = None) -> Path:
    """A copy of ``folder`` whose weights are the values the GGUF file of
    ``write_gguf(folder, ..., matrix_type, types=types)`` stores."""
    shutil.copytree(folder, dst)
    tensors = load_file(folder / "model.safetensors")
    stored = {name: stored_values(t, tensor_type(name, t, matrix_type, types)).to(t.dtype)
              for name, t in tensors.items()}
    save_file(stored, dst / "model.safetensors")
    return dst


def rewrite_gguf(src: Path, dst: Path, drop: tuple[str, ...] = (),
                 tensors: Optional[dict[str, Optional[np.ndarray]]] = None, **fields: Any) -> Path:
    """``src`` with metadata ``fields`` set (each stored as its Python type says: str, bool, int as
    UINT64 or INT64, float as FLOAT64, a list as an array of its first element's type), the keys in
    ``drop`` left out, and the tensors named in ``tensors`` replaced by the values given there (None:
    left out)."""
    reader = gguf.GGUFReader(str(src))
    arch = fields.get("general.architecture", reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in fields:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, value in fields.items():
        if key != "general.architecture":
            vtype, sub = _value_type(value), None
            if isinstance(value, list):
                sub = _value_type(value[0]) if value else gguf.GGUFValueType.STRING
            writer.add_key_value(key, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = (tensors or {}).get(tensor.name, tensor.data)
        if data is not None:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _value_type(value: Any) -> gguf.GGUFValueType:
    types = gguf.GGUFValueType
    if isinstance(value, bool):
        return types.BOOL
    if isinstance(value, int):
        return types.UINT64 if value >= 0 else types.INT64
    if isinstance(value, float):
        return types.FLOAT64
    if isinstance(value, list):
        return types.ARRAY
    return types.STRING
