"""A GGUF file's metadata as the config.json fields Octavo reads.

The converter writes a model's shape under ``<arch>.*`` keys (llama.cpp's
names); this maps them back, so the rest of Octavo builds the model from
the same ``ArchConfig`` as for a Hugging Face folder. Tied embeddings are
read from the tensors (no ``output.weight``), the vocabulary size from the
embedding, the stop tokens from the tokenizer metadata. Linear layers whose
blocks are Q8_0, Q4_0 or Q4_1 become a ``quantization_config`` of method "gguf"
(octavo/quant/checkpoint_config.py) so they run on the int8/int4 kernels.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

from octavo.checkpoint.bounds import MAX_CONTEXT, MAX_LAYERS, MAX_ROPE_FACTOR
from octavo.checkpoint.gguf_file import GgufFile
from octavo.checkpoint.gguf_vocab import end_token_ids
from octavo.model.gguf.checks import metadata_float, metadata_int
from octavo.model.gguf.deepseek2 import deepseek2_config_json
from octavo.model.gguf.experts import experts_config_json, quantized_experts
from octavo.model.gguf.names import ARCHITECTURES, FLOAT_LINEARS, FUSED_GROUPS, hf_name

# Block types the int8/int4 kernels run as stored (octavo/quant/formats/gguf.py).
KERNEL_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ROPE_SCALING = ("none", "linear", "yarn")
_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")


def gguf_config_json(file: GgufFile) -> dict[str, Any]:
    """config.json's fields for ``file``; ValueError naming an unsupported architecture or setting."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    tensors = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file.path} has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{file.path}: per-dimension rope frequency factors (rope_freqs.weight, Llama 3.1 "
                         "rope scaling) are not supported in GGUF files; load the Hugging Face folder instead")
    heads = metadata_int(file, "attention.head_count")
    hidden = metadata_int(file, "embedding_length")
    layers = metadata_int(file, "block_count", high=MAX_LAYERS)
    stored = max((int(m.group(1)) + 1 for name in tensors if (m := _BLOCK_INDEX.match(name))), default=0)
    if stored < layers:
        raise ValueError(f"{file.path}: metadata '{arch}.block_count' is {layers}; the file holds tensors of "
                         f"{stored} blocks")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": metadata_int(file, "attention.head_count_kv", heads),
        "head_dim": metadata_int(file, "attention.key_length", hidden // heads),
        "intermediate_size": metadata_int(file, "feed_forward_length"),
        # GGUF dims are innermost first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "max_position_embeddings": metadata_int(file, "context_length", 2048, high=MAX_CONTEXT),
        "rms_norm_eps": metadata_float(file, "attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "rope_theta": metadata_float(file, "rope.freq_base", 10000.0),
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id", kind=int),
        "eos_token_id": list(end_token_ids(file)),
        "dtype": _float_dtype(file),
    }
    window = file.arch_key("attention.sliding_window", None, int)
    if window:  # Mistral converted with its window kept; llama.cpp's own converter drops it
        raw["architectures"] = ["MistralForCausalLM"]
        raw["sliding_window"] = metadata_int(file, "attention.sliding_window", high=MAX_CONTEXT)
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        raw["attention_bias"] = True
    raw.update(_rope_scaling(file))
    if arch == "deepseek2":
        raw.update(deepseek2_config_json(file, tensors, raw.get("rope_scaling")))
    else:
        raw.update(experts_config_json(file, tensors))
    modules = quantized_modules(file)
    if modules:
        raw["quantization_config"] = {"quant_method": "gguf", "modules": modules}
    return raw


def _rope_scaling(file: GgufFile) -> dict[str, Any]:
    kind = file.arch_key("rope.scaling.type", "none", str)
    if kind not in _ROPE_SCALING:
        raise ValueError(f"{file.path}: rope.scaling.type {kind!r} is not supported; supported: {_ROPE_SCALING}")
    if kind == "none":
        return {}
    params: dict[str, Any] = {"rope_type": kind,
                              "factor": metadata_float(file, "rope.scaling.factor", high=MAX_ROPE_FACTOR)}
    if file.arch_key("rope.scaling.original_context_length", None) is not None:
        params["original_max_position_embeddings"] = metadata_int(file, "rope.scaling.original_context_length",
                                                            high=MAX_CONTEXT)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if file.arch_key(f"rope.scaling.{key}", None) is not None:
            params[name] = metadata_float(file, f"rope.scaling.{key}")
    return {"rope_scaling": params}


def _float_dtype(file: GgufFile) -> str:
    """The checkpoint's dtype for ``dtype="auto"``: the float type most of
    its matrices are stored in; bfloat16 for a quantized file (its
    dequantized layers and activations; the kernels take bf16)."""
    counts = Counter(FLOAT_TYPES[t.tensor_type.name] for t in file.tensors
                     if len(t.shape) >= 2 and t.tensor_type.name in FLOAT_TYPES)
    return counts.most_common(1)[0][0] if counts else "bfloat16"


def quantized_modules(file: GgufFile) -> dict[str, str]:
    """Linear module (Hugging Face name) -> block type, for the layers that
    run quantized: Q8_0/Q4_0/Q4_1 weights whose fused partners (q/k/v,
    gate/up) share the type, and experts as ``quantized_experts`` says. Others
    are dequantized while loading; lm_head, a mixture's routers and latent
    attention's kv_b_proj always are (they stay float, as with --quantization)."""
    types: dict[str, str] = {}
    stored: set[str] = set()  # every linear module the file holds, of any type
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        if name and name.endswith(".weight"):
            stored.add(name.removesuffix(".weight"))
            if tensor.tensor_type.name in KERNEL_TYPES:
                types[name.removesuffix(".weight")] = KERNEL_TYPES[tensor.tensor_type.name]
    result = {}
    for module, kind in types.items():
        if not module.startswith("model.layers.") or module.endswith(FLOAT_LINEARS):
            continue
        layer_prefix = ".".join(module.split(".")[:3])  # model.layers.N
        group = next((g for g in FUSED_GROUPS if module.endswith(tuple("." + p for p in g))), None)
        # The partners the file holds (DeepSeek's q_proj has none: its keys and values come from the latent).
        partners = [] if group is None else [m for m in (f"{layer_prefix}.{p}" for p in group) if m in stored]
        if all(types.get(m) == kind for m in partners):
            result[module] = kind
    result.update(quantized_experts(file, KERNEL_TYPES))
    return result
