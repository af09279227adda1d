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

import math
import re
from collections import Counter
from typing import Any

from octavo.checkpoint.bounds import MAX_CONTEXT, MAX_LAYERS, MAX_ROPE_FACTOR, bounded_float, bounded_int
from octavo.checkpoint.gguf_file import GgufFile
from octavo.checkpoint.gguf_vocab import end_token_ids
from octavo.model.gguf.experts import experts_config_json, quantized_experts
from octavo.model.gguf.names import ARCHITECTURES, FUSED_GROUPS, ROUTERS, hf_name

# Block types the int8/int4 kernels run as stored (octavo/quant/formats/gguf.py).
KERNEL_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ROPE_SCALING = ("none", "linear", "yarn")
_REQUIRED = object()
_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")
# Widths and head counts: the widest released models are about 2^15 wide; a
# declared width the tensors do not have is refused by the loader's memory budget.
_MAX_WIDTH = 1 << 20


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
    heads = _count(file, "attention.head_count")
    hidden = _count(file, "embedding_length")
    layers = _count(file, "block_count", high=MAX_LAYERS)
    stored = max((int(m.group(1)) + 1 for name in tensors if (m := _BLOCK_INDEX.match(name))), default=0)
    if stored < layers:
        raise ValueError(f"{file.path}: metadata '{arch}.block_count' is {layers}; the file holds tensors of "
                         f"{stored} blocks")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _count(file, "attention.head_count_kv", heads),
        "head_dim": _count(file, "attention.key_length", hidden // heads),
        "intermediate_size": _count(file, "feed_forward_length"),
        # GGUF dims are innermost first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "max_position_embeddings": _count(file, "context_length", 2048, high=MAX_CONTEXT),
        "rms_norm_eps": _number(file, "attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "rope_theta": _number(file, "rope.freq_base", 10000.0),
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id", kind=int),
        "eos_token_id": list(end_token_ids(file)),
        "dtype": _float_dtype(file),
    }
    window = file.arch_key("attention.sliding_window", None, int)
    if window:  # Mistral converted with its window kept; llama.cpp's own converter drops it
        raw["architectures"] = ["MistralForCausalLM"]
        raw["sliding_window"] = _count(file, "attention.sliding_window", high=MAX_CONTEXT)
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        raw["attention_bias"] = True
    raw.update(_rope_scaling(file))
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
                              "factor": _number(file, "rope.scaling.factor", high=MAX_ROPE_FACTOR)}
    if file.arch_key("rope.scaling.original_context_length", None) is not None:
        params["original_max_position_embeddings"] = _count(file, "rope.scaling.original_context_length",
                                                            high=MAX_CONTEXT)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if file.arch_key(f"rope.scaling.{key}", None) is not None:
            params[name] = _number(file, f"rope.scaling.{key}")
    return {"rope_scaling": params}


def _count(file: GgufFile, suffix: str, default: Any = _REQUIRED, high: int = _MAX_WIDTH) -> int:
    """The integer metadata ``<arch>.<suffix>``, from 1 to ``high``; ValueError naming the key and its value."""
    value = file.arch_key(suffix) if default is _REQUIRED else file.arch_key(suffix, default)
    return bounded_int(value, f"{file.path}: metadata '{file.architecture}.{suffix}'", 1, high)


def _number(file: GgufFile, suffix: str, default: Any = _REQUIRED, high: float = math.inf) -> float:
    """The positive finite number metadata ``<arch>.<suffix>``; ValueError naming the key and its value."""
    value = file.arch_key(suffix) if default is _REQUIRED else file.arch_key(suffix, default)
    return bounded_float(value, f"{file.path}: metadata '{file.architecture}.{suffix}'", high)


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
    are dequantized while loading; lm_head and a mixture's routers always are
    (they stay float, as with --quantization)."""
    types: dict[str, str] = {}
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        if name and name.endswith(".weight") and tensor.tensor_type.name in KERNEL_TYPES:
            types[name.removesuffix(".weight")] = KERNEL_TYPES[tensor.tensor_type.name]
    result = {}
    for module, kind in types.items():
        if not module.startswith("model.layers.") or module.endswith(ROUTERS):
            continue
        layer_prefix = ".".join(module.split(".")[:3])  # model.layers.N
        group = next((g for g in FUSED_GROUPS if module.endswith(tuple("." + p for p in g))), None)
        if group is None or all(types.get(f"{layer_prefix}.{part}") == kind for part in group):
            result[module] = kind
    result.update(quantized_experts(file, KERNEL_TYPES))
    return result
