"""config.json -> ArchConfig: the model's shape, validated; its family's class says how to read the
parts where families differ (``ConfigReading``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from octavo.checkpoint.bounds import (MAX_CONTEXT, MAX_LAYERS, MAX_ROPE_FACTOR, MAX_VOCAB, bounded_float, bounded_int,
                                      read_json_file, short_repr)
from octavo.checkpoint.gguf_file import is_gguf, open_gguf
from octavo.model.gguf.config import gguf_config_json
from octavo.model.registry import model_class_for
from octavo.quant.checkpoint_config import CheckpointQuantization, parse_quantization_config

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Older Phi-3 configs name LongRoPE "su" (and some "yarn" with short/long factors).
_ROPE_ALIASES = {"su": "longrope"}
MAX_TOKEN_ID = MAX_VOCAB - 1


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
    # longrope: per-frequency divisors for contexts within / beyond
    # original_max_position_embeddings.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # The leading fraction of each head that is rotated (Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ExpertRouting:
    """How a router's logits become each token's experts and weights beyond the plain softmax top-k
    (DeepSeek): ``scoring`` "softmax" or "sigmoid"; the experts fall into ``groups`` equal groups
    of which a token keeps its best ``top_groups`` before the top-k (a group scored by its best
    expert, ``group_score`` "max", or by the sum of its best two, "top2"); ``score_bias``: the router
    has a per-expert bias (``e_score_correction_bias``) added to the scores to choose, not to
    weigh; ``scale``: a factor on the final weights (``routed_scaling_factor``)."""

    scoring: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    group_score: str = "max"
    score_bias: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"config.json: scoring_func must be softmax or sigmoid, got {self.scoring!r}")
        if self.group_score not in ("max", "top2"):
            raise ValueError(f"the router's group_score must be max or top2, got {self.group_score!r}")
        if not 1 <= self.top_groups <= self.groups:
            raise ValueError(f"config.json: topk_group ({self.top_groups}) must be between 1 and n_group "
                             f"({self.groups})")


@dataclass(frozen=True)
class ExpertsConfig:
    """A mixture-of-experts feed-forward block: ``num_experts`` gated MLPs of ``intermediate_size``,
    ``top_k`` of them per token by a router (softmax unless ``routing`` says otherwise; weights
    renormalised over the chosen ones when ``renormalize``), and optionally one shared expert every
    token goes through, scaled by a sigmoid gate where ``shared_expert_gate`` (Qwen2-MoE; DeepSeek's
    is ungated). ``dense_layers``: layers that keep a dense MLP instead."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    routing: ExpertRouting = ExpertRouting()
    shared_expert_gate: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) must be between 1 and the number "
                             f"of experts ({self.num_experts})")
        if self.intermediate_size < 1:
            raise ValueError(f"config.json: the experts' intermediate size must be positive, got "
                             f"{self.intermediate_size}")
        groups = self.routing.groups
        if self.num_experts % groups:
            raise ValueError(f"config.json: n_group ({groups}) must divide the number of experts "
                             f"({self.num_experts})")
        if self.top_k > self.routing.top_groups * (self.num_experts // groups):
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds the experts of the "
                             f"topk_group ({self.routing.top_groups}) groups a token keeps")


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token's keys and values are one latent
    vector of ``kv_lora_rank`` plus a shared rotary key of ``qk_rope_head_dim``; per head, keys have
    ``qk_nope_head_dim`` unrotated dims decompressed from the latent, values ``v_head_dim``.
    ``q_lora_rank``: queries through a low-rank projection and its norm (None: one projection);
    ``rope_interleave``: the rotary dims pair up as (0, 1), (2, 3) ... rather than by halves."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]
    rope_interleave: bool


@dataclass(frozen=True)
class ConfigReading:
    """Where families read config.json differently (each model class's ``config_reading``)."""

    sliding_window: bool = False  # config.json's sliding_window applies (many checkpoints carry one unused)
    # Every sliding_pattern-th layer is global, the others slide, where
    # config.json has no layer_types (Gemma 2: 2; Gemma 3: 6); 0: no pattern.
    sliding_pattern: int = 0
    local_rope: bool = False  # sliding layers have a rotary embedding of their own (Gemma 3)
    partial_rotary: bool = False  # partial_rotary_factor may rotate a leading part of each head only
    query_pre_attn_scalar: bool = False  # the softmax scale is query_pre_attn_scalar ** -0.5 (Gemma)
    experts: Optional[ExpertsConfig] = None  # the family's feed-forward blocks are mixtures of experts
    latent_attention: Optional[LatentAttentionConfig] = None  # the family's attention is latent (DeepSeek)
    # The rotated head size where config.json's head_dim does not give it (DeepSeek: qk_rope_head_dim).
    head_dim: Optional[int] = None


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
    # Per layer: the sliding window (tokens a query may look back, itself
    # included) or None for full attention.
    layer_windows: tuple[Optional[int], ...]
    dtype: Optional[str]  # the checkpoint's dtype as written in config.json
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    # How the checkpoint's linear layers are stored (config.json's
    # quantization_config); None: unquantized.
    quantization: Optional[CheckpointQuantization] = None
    # Softmax scale of q.k (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5.
    attention_scale: Optional[float] = None
    # cap * tanh(x / cap) on attention scores / final logits (Gemma 2); None: off.
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    # The rotary embedding of sliding-window layers where it differs from
    # ``rope`` (Gemma 3: rope_local_base_freq, unscaled); None: ``rope`` everywhere.
    local_rope: Optional[RopeConfig] = None
    # config.json's attention_bias / mlp_bias (families decide whether they apply).
    attention_bias: bool = False
    mlp_bias: bool = False
    experts: Optional[ExpertsConfig] = None
    latent_attention: Optional[LatentAttentionConfig] = None

    def layer_rope(self, layer_idx: int) -> RopeConfig:
        """The rotary embedding layer ``layer_idx`` uses."""
        if self.local_rope is not None and self.layer_windows[layer_idx] is not None:
            return self.local_rope
        return self.rope

    @property
    def context_limit(self) -> int:
        """The longest context the checkpoint's positions are meant for: max_position_embeddings, or
        with YaRN the trained context times the factor where that is longer. YaRN's factor is that
        ratio by definition, and Qwen2.5 documents its 128k context as the 32k config plus
        ``rope_scaling`` yarn, factor 4, max_position_embeddings left at 32k."""
        rope = self.rope
        if rope.rope_type == "yarn" and rope.original_max_position_embeddings is not None:
            stretched = int(rope.original_max_position_embeddings * rope.factor)
            return max(self.max_position_embeddings, min(stretched, MAX_CONTEXT))
        return self.max_position_embeddings

    def max_model_len(self, cap: Optional[int] = None) -> int:
        """The checkpoint's context length (``context_limit``), lowered to ``cap`` when given."""
        return min(self.context_limit, cap or self.context_limit)


def load_arch_config(folder: str | Path) -> ArchConfig:
    """The config of a checkpoint folder (config.json) or a GGUF file (its
    metadata); a ValueError naming the file, the field and its value for one
    out of bounds."""
    if is_gguf(folder):
        where, raw = Path(folder), gguf_config_json(open_gguf(folder))
    else:
        where = Path(folder) / "config.json"
        if not where.is_file():
            raise ValueError(f"no config.json in {folder}")
        raw = read_json_file(where)
    try:
        return parse_arch_config(raw)
    except ValueError as exc:
        raise ValueError(f"{where}: {str(exc).removeprefix('config.json: ')}") from None


def parse_arch_config(raw: dict[str, Any]) -> ArchConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError(f"config.json: architectures must be a list of class names, got {short_repr(archs)}")
    architecture = archs[0]
    # Bounded before the family reads the config: some build per-layer tables from it.
    num_layers = positive_int(raw, "num_hidden_layers", MAX_LAYERS)
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ValueError(f"config.json: {key} must be an object or null, got {short_repr(raw[key])}")
    reading = model_class_for(architecture).config_reading(raw)  # ValueError for unknown archs

    hidden = positive_int(raw, "hidden_size")
    heads = positive_int(raw, "num_attention_heads")
    kv_heads = positive_int(raw, "num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = reading.head_dim or (positive_int(raw, "head_dim") if raw.get("head_dim") is not None
                                    else hidden // heads)
    if head_dim < 1:
        raise ValueError(f"config.json: hidden_size ({hidden}) is less than num_attention_heads ({heads})")
    max_positions = (positive_int(raw, "max_position_embeddings", MAX_CONTEXT)
                     if raw.get("max_position_embeddings") is not None else 2048)
    window = (positive_int(raw, "sliding_window", MAX_CONTEXT)
              if reading.sliding_window and raw.get("sliding_window") is not None else None)
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder layout) is not supported by a causal LM")
    rope, local_rope = _ropes(raw, reading)
    scalar = raw.get("query_pre_attn_scalar") if reading.query_pre_attn_scalar else None
    return ArchConfig(
        architecture=architecture,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=positive_int(raw, "intermediate_size"),
        vocab_size=positive_int(raw, "vocab_size"),
        max_position_embeddings=max_positions,
        rms_norm_eps=bounded_float(raw.get("rms_norm_eps", 1e-6), "config.json: rms_norm_eps"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Gemma names it hidden_activation (its hidden_act, where present, is stale).
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
        rope=rope,
        layer_windows=_layer_windows(raw, num_layers, window, reading.sliding_pattern),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        bos_token_id=None if raw.get("bos_token_id") is None else bounded_int(
            raw["bos_token_id"], "config.json: bos_token_id", 0, MAX_TOKEN_ID),
        eos_token_ids=token_id_list(raw.get("eos_token_id")),
        quantization=parse_quantization_config(raw),
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attn_logit_softcap=positive_or_none(raw, "attn_logit_softcapping"),
        final_logit_softcap=positive_or_none(raw, "final_logit_softcapping"),
        local_rope=local_rope,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        experts=reading.experts,
        latent_attention=reading.latent_attention,
    )


def _ropes(raw: dict[str, Any], reading: ConfigReading) -> tuple[RopeConfig, Optional[RopeConfig]]:
    """(the rope of full-attention layers, that of sliding layers if it
    differs). Gemma 3 gives sliding layers their own: transformers v5 writes
    ``rope_parameters`` per layer type, older files ``rope_local_base_freq``
    beside ``rope_theta`` / ``rope_scaling`` (which then apply to global layers only)."""
    if not reading.local_rope:
        return parse_rope(raw, partial_ok=reading.partial_rotary), None
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return (parse_rope(raw, full, default_theta=1_000_000.0),
                parse_rope(raw, local, default_theta=10_000.0))
    local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10_000.0)))
    return parse_rope(raw, default_theta=1_000_000.0), local


def positive_or_none(raw: dict[str, Any], key: str) -> Optional[float]:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive number or null, got {value!r}")
    return float(value)


def parse_rope(
    raw: dict[str, Any],
    section: Optional[dict[str, Any]] = None,
    default_theta: float = 10000.0,
    partial_ok: bool = False,
) -> RopeConfig:
    """transformers v5 writes ``rope_parameters`` (theta inside); older files
    write ``rope_theta`` and an optional ``rope_scaling`` (type under "type"
    or "rope_type"). Both are merged, the v5 keys winning. ``section``: the
    parameters to read instead (one layer type's); ``partial_ok``: whether
    the architecture rotates only part of each head. Every number is checked
    finite and positive (a zero or NaN factor would turn every position's
    rotation into NaN), lengths from 1 to ``MAX_CONTEXT``."""
    if section is None:
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    else:
        if not isinstance(section, dict):
            raise ValueError(f"config.json: a layer type's rope_parameters must be an object, "
                             f"got {short_repr(section)}")
        params = section
        theta = params.get("rope_theta", default_theta)
    theta = bounded_float(theta, "config.json: rope_theta")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type) if isinstance(rope_type, str) else rope_type
    if rope_type == "yarn" and "short_factor" in params:  # Phi-3's older spelling of LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {short_repr(rope_type)} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    partial = bounded_float(partial, "config.json: partial_rotary_factor", 1.0)
    if partial != 1.0 and not partial_ok:
        raise ValueError(f"partial_rotary_factor {partial} is not supported for {raw['architectures'][0]}")
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    original = _trained_length(raw, params)
    if rope_type in ("llama3", "yarn", "longrope") and not original:
        raise ValueError(f"rope scaling {rope_type!r} needs original_max_position_embeddings")
    if rope_type == "longrope":
        return _longrope(raw, params, theta, partial, original)
    if "factor" not in params and rope_type != "yarn":
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    factor = params.get("factor")
    if factor is None:  # yarn may leave it implicit in the two lengths
        if not (original and raw.get("max_position_embeddings")):
            raise ValueError("rope scaling 'yarn' needs a 'factor' or both context lengths")
        factor = raw["max_position_embeddings"] / original
    low, high = (_rope_number(params, key, default) for key, default in
                 (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
    if rope_type == "llama3" and high <= low:  # the two wavelengths between which llama3 blends
        raise ValueError(f"config.json: rope high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=bounded_float(factor, "config.json: rope factor", MAX_ROPE_FACTOR),
        original_max_position_embeddings=original,
        low_freq_factor=low,
        high_freq_factor=high,
        beta_fast=_rope_number(params, "beta_fast", 32.0),
        beta_slow=_rope_number(params, "beta_slow", 1.0),
        mscale=_rope_number(params, "mscale", None, zero_ok=True),
        mscale_all_dim=_rope_number(params, "mscale_all_dim", None, zero_ok=True),
        attention_factor=_rope_number(params, "attention_factor", None),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
    )


def _trained_length(raw: dict[str, Any], params: dict[str, Any]) -> Optional[int]:
    """original_max_position_embeddings (top level or in the rope's
    parameters), else max_position_embeddings, else None; each where given
    an integer from 1 to ``MAX_CONTEXT``."""
    for where, key in ((raw, "original_max_position_embeddings"), (params, "original_max_position_embeddings"),
                       (raw, "max_position_embeddings")):
        if where.get(key) is not None:
            return positive_int(where, key, MAX_CONTEXT)
    return None


def _rope_number(params: dict[str, Any], key: str, default: Optional[float], zero_ok: bool = False) -> Optional[float]:
    """A rope parameter (``default`` when absent or null): a finite positive number (or zero when ``zero_ok``)."""
    value = params.get(key)
    if value is None:
        return default
    return bounded_float(value, f"config.json: rope {key}", zero_ok=zero_ok)


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float, partial: float,
              original: int) -> RopeConfig:
    """Phi-3.5 / Phi-4-mini's LongRoPE: a divisor per frequency, one list for
    contexts within the trained length and one beyond; the attention factor
    defaults to sqrt(1 + ln(factor) / ln(original)) with factor = the two
    lengths' ratio, as transformers computes it."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or not values:
            raise ValueError(f"rope scaling 'longrope' needs a list {key}")
        if len(values) > MAX_CONTEXT:
            raise ValueError(f"config.json: rope {key} has {len(values)} entries")
        factors[key] = tuple(bounded_float(v, f"config.json: rope {key}[{i}]") for i, v in enumerate(values))
    factor = params.get("factor") or (raw.get("max_position_embeddings") or original) / original
    factor = bounded_float(factor, "config.json: rope factor", MAX_ROPE_FACTOR)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        rope_type="longrope",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=bounded_float(attention_factor, "config.json: rope attention_factor"),
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        partial_rotary_factor=partial,
    )


def token_id_list(value: Any, where: str = "config.json: eos_token_id") -> tuple[int, ...]:
    """eos_token_id is an int, a list of ints, or absent; ``where``: the file and field, for errors."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(bounded_int(v, where, 0, MAX_TOKEN_ID) for v in values)


def _layer_windows(
    raw: dict[str, Any], num_layers: int, window: Optional[int], pattern: int
) -> tuple[Optional[int], ...]:
    if not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None and pattern:
        # Gemma without layer_types: every pattern-th layer is global.
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if layer_types is None:
        # Qwen2/3 without layer_types: sliding from max_window_layers on;
        # Mistral has no such key and slides everywhere.
        first = int(raw.get("max_window_layers", 0) or 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ValueError(f"config.json: layer_types must be a list of layer type names, got {short_repr(layer_types)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def positive_int(raw: dict[str, Any], key: str, high: Optional[int] = None) -> int:
    """config.json's ``key``: an integer from 1 to ``high`` (no bound when None)."""
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high is not None and value > high):
        bound = "" if high is None else f" at most {high}"
        raise ValueError(f"config.json: {key} must be a positive integer{bound}, got {short_repr(value)}")
    return value
