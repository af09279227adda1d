"""config.json -> ArchConfig: the model's shape and switches, validated."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from octavo.checkpoint.gguf_file import is_gguf, open_gguf
from octavo.model.gguf.config import gguf_config_json
from octavo.model.registry import ArchSwitches, switches_for
from octavo.quant.checkpoint_config import CheckpointQuantization, parse_quantization_config

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config layout."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    rope: RopeConfig
    switches: ArchSwitches
    # Per layer: the sliding window (tokens a query may look back, itself
    # included) or None for full attention.
    layer_windows: tuple[Optional[int], ...]
    dtype: Optional[str]  # the checkpoint's dtype as written in config.json
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    # How the checkpoint's linear layers are stored (config.json's
    # quantization_config); None: unquantized.
    quantization: Optional[CheckpointQuantization] = None

    def max_model_len(self, cap: Optional[int] = None) -> int:
        """The checkpoint's context length, lowered to ``cap`` when given."""
        return min(self.max_position_embeddings, cap or self.max_position_embeddings)


def load_arch_config(folder: str | Path) -> ArchConfig:
    """The config of a checkpoint folder (config.json) or a GGUF file (its metadata)."""
    if is_gguf(folder):
        return parse_arch_config(gguf_config_json(open_gguf(folder)))
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {folder}")
    with open(path) as f:
        return parse_arch_config(json.load(f))


def parse_arch_config(raw: dict[str, Any]) -> ArchConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    architecture = archs[0]
    switches = switches_for(architecture, raw)  # ValueError for unknown archs

    hidden = _positive_int(raw, "hidden_size")
    heads = _positive_int(raw, "num_attention_heads")
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    num_layers = _positive_int(raw, "num_hidden_layers")
    window = raw.get("sliding_window") if switches.sliding_window_enabled else None
    return ArchConfig(
        architecture=architecture,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        intermediate_size=_positive_int(raw, "intermediate_size"),
        vocab_size=_positive_int(raw, "vocab_size"),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        rope=parse_rope(raw),
        switches=switches,
        layer_windows=_layer_windows(raw, num_layers, window),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=token_id_list(raw.get("eos_token_id")),
        quantization=parse_quantization_config(raw),
    )


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """transformers v5 writes ``rope_parameters`` (theta inside); older files
    write ``rope_theta`` and an optional ``rope_scaling`` (type under "type"
    or "rope_type"). Both are merged, the v5 keys winning."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params and rope_type != "yarn":
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    original = (
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings")
    )
    factor = params.get("factor")
    if factor is None:  # yarn may leave it implicit in the two lengths
        if not (original and raw.get("max_position_embeddings")):
            raise ValueError("rope scaling 'yarn' needs a 'factor' or both context lengths")
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original) if original else None,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def token_id_list(value: Any) -> tuple[int, ...]:
    """eos_token_id is an int, a list of ints, or absent."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _layer_windows(raw: dict[str, Any], num_layers: int, window: Optional[int]) -> tuple[Optional[int], ...]:
    if not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # Qwen2/3 without layer_types: sliding from max_window_layers on;
        # Mistral has no such key and slides everywhere.
        first = int(raw.get("max_window_layers", 0) or 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value
