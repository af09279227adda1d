"""config.json's ``quantization_config`` -> which format each linear layer's
checkpoint tensors are in (None: unquantized, ``weight`` as usual).

Every setting that changes what the tensors mean is checked here, before
the model is built; one this loader does not read is a ValueError naming
the key and what is supported, never a silently wrong model. Keys that only
record how the checkpoint was made (damp_percent, true_sequential, the
calibration dataset, observer ...) are ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from octavo.quant.formats.awq import AwqFormat
from octavo.quant.formats.base import PackedFormat
from octavo.quant.formats.compressed_tensors import IntQuantizedFormat, PackQuantizedFormat
from octavo.quant.formats.gguf import GGUF_TYPES, GgufBlockFormat
from octavo.quant.formats.gptq import CHECKPOINT_FORMATS, GptqFormat
from octavo.quant.formats.packing import SUPPORTED_BITS

METHODS = ("gptq", "awq", "compressed-tensors", "gguf")
_KEY = "quantization_config"


@dataclass(frozen=True)
class CheckpointQuantization:
    """The checkpoint's quantization: ``rules`` in order, the first whose
    matcher takes a module's checkpoint name gives its format; a module
    ``skip`` takes stays unquantized."""

    method: str
    rules: tuple[tuple[Callable[[str], bool], PackedFormat], ...]
    skip: Callable[[str], bool]

    def format_for(self, module: str) -> Optional[PackedFormat]:
        """The format of checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``), None: unquantized."""
        if self.skip(module):
            return None
        return next((fmt for matches, fmt in self.rules if matches(module)), None)


def parse_quantization_config(raw_config: dict[str, Any]) -> Optional[CheckpointQuantization]:
    """None for a checkpoint without ``quantization_config``."""
    qc = raw_config.get(_KEY)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{_KEY} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gguf":
        return _gguf(qc)
    raise ValueError(f"{_KEY}.quant_method {method!r} is not supported; supported: {', '.join(METHODS)}")


def _field(qc: dict[str, Any], key: str, default: Any, allowed: tuple[Any, ...], what: str = _KEY) -> Any:
    value = qc.get(key, default)
    if value not in allowed:
        raise ValueError(f"{what}.{key} {value!r} is not supported; supported: {', '.join(map(repr, allowed))}")
    return value


def _group_size(qc: dict[str, Any], key: str = "group_size", what: str = _KEY) -> int:
    value = qc.get(key, -1)
    value = -1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{what}.{key} must be a positive integer or -1 (per channel), got {value!r}")
    return value


# Module matchers are small dataclasses, not closures, so that an ArchConfig
# holding them pickles (it may travel to rank processes).
@dataclass(frozen=True)
class _NotConvert:
    """``modules_to_not_convert`` as transformers reads it: a name matches
    when it holds an entry as whole dotted components ("lm_head", "mlp.gate")."""

    entries: tuple[str, ...]

    def __call__(self, name: str) -> bool:
        return any(f".{entry}." in f".{name}." for entry in self.entries)


@dataclass(frozen=True)
class _InDecoderBlocks:
    """GPTQ and AWQ tools quantize the linear layers inside the decoder blocks
    (``model.layers.N.*``), never lm_head (GPTQModel's ``lm_head: true`` aside)."""

    def __call__(self, name: str) -> bool:
        return ".layers." in f".{name}"


@dataclass(frozen=True)
class _CtTargets:
    """compressed-tensors' matching: "re:<regex>" matched from the name's
    start, a class name ("Linear": every linear layer here), or the exact name."""

    targets: tuple[str, ...]

    def __call__(self, name: str) -> bool:
        return any(re.match(t[3:], name) is not None if t.startswith("re:") else t in ("Linear", name)
                   for t in self.targets)


@dataclass(frozen=True)
class _Named:
    """Exactly the modules named (a GGUF file says each tensor's type)."""

    names: frozenset[str]

    def __call__(self, name: str) -> bool:
        return name in self.names


def _not_convert(qc: dict[str, Any]) -> _NotConvert:
    return _NotConvert(tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict[str, Any]) -> CheckpointQuantization:
    bits = _field(qc, "bits", None, SUPPORTED_BITS)
    # Some AutoGPTQ versions wrote the layout under "format"; older Marlin
    # repacks said is_marlin_format; GPTQModel can pack into other int widths.
    checkpoint_format = _field(qc, "checkpoint_format", qc.get("format", "gptq"), CHECKPOINT_FORMATS)
    _field(qc, "is_marlin_format", False, (False,))
    _field(qc, "pack_dtype", "int32", ("int32",))
    # GPTQModel's per-module overrides and optimum's partial quantization
    # change which tensors exist; lm_head quantization needs a vocab-split loader.
    for key in ("dynamic", "modules_in_block_to_quantize"):
        if qc.get(key):
            raise ValueError(f"{_KEY}.{key} is not supported (every linear layer of the decoder blocks "
                             "is read as quantized with the same settings)")
    _field(qc, "lm_head", False, (False,))
    fmt = GptqFormat(bits, _group_size(qc), checkpoint_format)
    return CheckpointQuantization("gptq", ((_InDecoderBlocks(), fmt),), _not_convert(qc))


def _awq(qc: dict[str, Any]) -> CheckpointQuantization:
    bits = _field(qc, "bits", qc.get("w_bit"), (4,))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{_KEY}.version {qc.get('version')!r} is not supported; supported: 'gemm'")
    _field(qc, "zero_point", True, (True,))
    fmt = AwqFormat(bits, _group_size(qc, "group_size" if "group_size" in qc else "q_group_size"))
    return CheckpointQuantization("awq", ((_InDecoderBlocks(), fmt),), _not_convert(qc))


def _gguf(qc: dict[str, Any]) -> CheckpointQuantization:
    """Written by the GGUF reader (octavo/model/gguf/config.py), not read
    from a file: ``modules`` maps each linear layer kept quantized to its
    block type; every other layer is stored (or dequantized) as float."""
    modules = qc.get("modules") or {}
    by_type: dict[str, set[str]] = {}
    for module, type_name in modules.items():
        _field({"type": type_name}, "type", None, tuple(GGUF_TYPES), f"{_KEY}.modules.{module}")
        by_type.setdefault(type_name, set()).add(module)
    rules = tuple((_Named(frozenset(names)), GgufBlockFormat(t)) for t, names in sorted(by_type.items()))
    return CheckpointQuantization("gguf", rules, _Named(frozenset()))


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuantization:
    top_format = qc.get("format")
    _field(qc, "quantization_status", "compressed", ("compressed",))
    if qc.get("sparsity_config"):
        raise ValueError(f"{_KEY}.sparsity_config is not supported (dense weights only)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{_KEY}.config_groups must name at least one quantization scheme")
    rules = tuple(_ct_rule(name, scheme, top_format) for name, scheme in groups.items())
    return CheckpointQuantization("compressed-tensors", rules, _CtTargets(tuple(qc.get("ignore") or ())))


def _int8_token_activations(activations: Any, where: str) -> bool:
    """Whether a scheme's ``input_activations`` asks for W8A8's activations
    (int8, symmetric, rounded per token at run time); False for none.
    Anything else (static scales, asymmetric, per tensor, other widths) is a
    ValueError naming the field."""
    if not activations:
        return False
    if not isinstance(activations, dict):
        raise ValueError(f"{where} must be an object or null")
    _field(activations, "num_bits", None, (8,), where)
    _field(activations, "type", "int", ("int",), where)
    _field(activations, "symmetric", True, (True,), where)
    _field(activations, "dynamic", False, (True,), where)
    _field(activations, "strategy", None, ("token",), where)
    return True


def _ct_rule(name: str, scheme: dict[str, Any], top_format: Any) -> tuple[Callable[[str], bool], PackedFormat]:
    where = f"{_KEY}.config_groups.{name}"
    fmt_name = _field({"format": scheme.get("format") or top_format}, "format", None,
                      ("pack-quantized", "int-quantized"), where)
    if scheme.get("output_activations"):
        raise ValueError(f"{where}.output_activations is not supported (W4A16, W8A16 and W8A8 int8 schemes only)")
    w8a8 = _int8_token_activations(scheme.get("input_activations"), f"{where}.input_activations")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights must describe the weight quantization")
    where = f"{where}.weights"
    # int8 activations multiply int8 per-channel symmetric weights (and the
    # unpacked int-quantized layout is read that way only).
    int8_channel = w8a8 or fmt_name == "int-quantized"
    bits = _field(weights, "num_bits", None, (8,) if int8_channel else SUPPORTED_BITS, where)
    _field(weights, "type", "int", ("int",), where)
    _field(weights, "dynamic", False, (False,), where)
    strategy = _field(weights, "strategy", None, ("channel",) if int8_channel else ("group", "channel"), where)
    actorder = _field(weights, "actorder", None, (None,) if int8_channel else (None, "static", "weight", "group"),
                      where)
    group_size = _group_size(weights, what=where) if strategy == "group" else -1
    if strategy == "group" and group_size == -1:
        raise ValueError(f"{where}.group_size must be set for strategy 'group'")
    symmetric = bool(_field(weights, "symmetric", True, (True,), where) if int8_channel
                     else weights.get("symmetric", True))
    targets = _CtTargets(tuple(scheme.get("targets") or ()))
    if fmt_name == "int-quantized":
        return targets, IntQuantizedFormat(int8_activations=w8a8)
    # Only actorder "group" stores a g_idx; "weight"/"static" keep groups contiguous.
    return targets, PackQuantizedFormat(bits, group_size, symmetric, group_index=actorder == "group",
                                        int8_activations=w8a8)
