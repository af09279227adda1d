"""Write GPTQ, AWQ and compressed-tensors checkpoints of tiny test models,
and beside each the same model with the dequantized weights for transformers.

Every decoder linear layer's float weight is quantized to known integers
(min-max, per group of input features); those integers, scales and zero
points are packed following each tool's published layout, with the tool's
tensor names, dtypes, shapes and config keys:

- GPTQ: AutoGPTQ ``nn_modules/qlinear`` ``QuantLinear.pack`` (GPTQModel
  ``PackableQuantLinear`` writes the same) and its ``quantize_config``;
- AWQ: AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``
  and the ``quantization_config`` AutoAWQ saves;
- compressed-tensors: ``pack_quantized.py`` ``pack_to_int32`` /
  ``compression_param_info`` and the config llm-compressor saves; W8A8
  (int8 weights, int8 dynamic per-token activations) as its
  ``int-quantized`` format writes it (``naive_quantized.py``: the signed
  int8 ``weight`` unpacked, ``weight_scale`` [N, 1]) or packed.

The packers here are written apart from octavo's unpackers (field by field
over numpy words), so a layout mistake cannot cancel out on a round trip.
"""
from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import make_tiny_model

# Mixtral's experts call their projections w1 (gate), w3 (up), w2 (down); mixtures' routers
# (mlp.gate, Qwen2-MoE's shared_expert_gate) stay float, as the tools leave them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
ROUTERS = ("re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Quant:
    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int = 4
    group_size: int = 32  # -1: one group per row
    sym: bool = True
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder "group"
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zero - 1) or "gptq_v2"
    skip: tuple[str, ...] = ()  # module suffixes left unquantized (modules_to_not_convert / ignore)
    activations: bool = False  # compressed-tensors: int8 dynamic per-token input activations (W8A8)
    ct_format: str = "pack-quantized"  # compressed-tensors: or "int-quantized"
    config_extra: dict[str, Any] = field(default_factory=dict)  # merged into quantization_config


@dataclass
class Quantized:
    """One layer's known integers: W ~ (q - zero[g_idx]) * scale[g_idx]."""

    q: torch.Tensor  # int64 [N, K], unsigned
    scale: torch.Tensor  # [N, G] in the checkpoint's scale dtype
    zero: torch.Tensor  # int64 [N, G], unsigned
    g_idx: torch.Tensor  # int64 [K]

    def dequantized(self) -> torch.Tensor:
        scale = self.scale.float()[:, self.g_idx]
        return (self.q - self.zero[:, self.g_idx]).float() * scale


def quantize(w: torch.Tensor, quant: Quant, scale_dtype: torch.dtype, seed: int) -> Quantized:
    n, k = w.shape
    size = k if quant.group_size == -1 else quant.group_size
    position = torch.arange(k)
    if quant.act_order:  # features quantized in a shuffled order, grouped by that order
        position = torch.argsort(torch.randperm(k, generator=torch.Generator().manual_seed(seed)))
    g_idx = position // size
    groups = k // size
    top = 2**quant.bits - 1
    lo = torch.stack([w[:, g_idx == g].min(1).values for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].max(1).values for g in range(groups)], 1).clamp(min=0)
    if quant.sym:
        scale = (torch.maximum(-lo, hi) / (2 ** (quant.bits - 1) - 1)).to(scale_dtype)
        zero = torch.full((n, groups), 2 ** (quant.bits - 1), dtype=torch.int64)
    else:
        scale = ((hi - lo) / top).to(scale_dtype)
        # GPTQ v1 stores zero - 1: keep it >= 1 so it fits, as the tools' real checkpoints do.
        low = 1 if quant.method == "gptq" and quant.checkpoint_format == "gptq" else 0
        zero = torch.round(-lo / scale.float()).to(torch.int64).clamp(low, top)
    q = torch.round(w / scale.float()[:, g_idx]).to(torch.int64) + zero[:, g_idx]
    return Quantized(q.clamp(0, top), scale, zero, g_idx)


def pack_words(values: torch.Tensor, bits: int, dim: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """int32 words of ``32 // bits`` fields along ``dim``: field f of word w
    holds element ``w * pack + order[f]`` (the written spec, one field at a time)."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    v = np.moveaxis(values.numpy().astype(np.uint32) & ((1 << bits) - 1), dim, -1)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // pack,), dtype=np.uint32)
    for f in range(pack):
        words |= v[..., order[f]::pack] << np.uint32(bits * f)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, dim)).view(np.int32))


def layer_tensors(qz: Quantized, quant: Quant, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized layer, by suffix."""
    bits = quant.bits
    if quant.method == "gptq":
        stored_zero = qz.zero - (1 if quant.checkpoint_format == "gptq" else 0)
        return {
            "qweight": pack_words(qz.q.T, bits, dim=0),
            "qzeros": pack_words(stored_zero.T, bits, dim=1),
            "scales": qz.scale.T.contiguous(),
            "g_idx": qz.g_idx.to(torch.int32),
        }
    if quant.method == "awq":
        return {
            "qweight": pack_words(qz.q.T, bits, dim=1, order=AWQ_ORDER),
            "qzeros": pack_words(qz.zero.T, bits, dim=1, order=AWQ_ORDER),
            "scales": qz.scale.T.contiguous(),
        }
    if quant.ct_format == "int-quantized":  # the signed values themselves
        return {"weight": (qz.q - 2 ** (bits - 1)).to(torch.int8), "weight_scale": qz.scale.contiguous()}
    # compressed-tensors: signed values stored + 2**(bits-1), i.e. our unsigned ones.
    out = {
        "weight_packed": pack_words(qz.q, bits, dim=1),
        "weight_scale": qz.scale.contiguous(),
        "weight_shape": torch.tensor([out_features, in_features]),
    }
    if not quant.sym:
        out["weight_zero_point"] = pack_words(qz.zero, bits, dim=0)
    if quant.act_order:
        out["weight_g_idx"] = qz.g_idx.to(torch.int32)
    return out


def quantization_config(quant: Quant) -> dict[str, Any]:
    if quant.method == "gptq":  # AutoGPTQ's BaseQuantizeConfig.to_dict
        qc = {"bits": quant.bits, "group_size": quant.group_size, "damp_percent": 0.01,
              "desc_act": quant.act_order, "static_groups": False, "sym": quant.sym, "true_sequential": True,
              "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq",
              "checkpoint_format": quant.checkpoint_format}
        if quant.skip:
            qc["modules_to_not_convert"] = list(quant.skip)
    elif quant.method == "awq":  # AutoAWQ's AwqConfig.to_transformers_dict
        qc = {"quant_method": "awq", "zero_point": True, "group_size": quant.group_size,
              "bits": quant.bits, "version": "gemm", "modules_to_not_convert": list(quant.skip) or None}
    else:  # llm-compressor's QuantizationConfig
        weights = {"num_bits": quant.bits, "type": "int", "symmetric": quant.sym,
                   "strategy": "channel" if quant.group_size == -1 else "group",
                   "group_size": None if quant.group_size == -1 else quant.group_size,
                   "block_structure": None, "dynamic": False, "actorder": "group" if quant.act_order else None,
                   "observer": "minmax", "observer_kwargs": {}}
        activations = None
        if quant.activations:  # the W8A8 preset's
            activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
                           "block_structure": None, "dynamic": True, "actorder": None, "observer": None,
                           "observer_kwargs": {}}
        qc = {"quant_method": "compressed-tensors", "format": quant.ct_format,
              "quantization_status": "compressed", "global_compression_ratio": None, "kv_cache_scheme": None,
              "sparsity_config": {}, "version": "0.9.0", "provider": "compressed-tensors",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": activations, "output_activations": None,
                                            "format": quant.ct_format}},
              "ignore": ["lm_head", *ROUTERS, *(f"re:.*{s}$" for s in quant.skip)]}
    qc.update(quant.config_extra)
    return qc


def _shared_input(module: str) -> str:
    """Modules that read the same input share it: the tools derive one
    act-order from it (q/k/v, gate/up), and octavo's fused layers need that."""
    for part, fused in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("gate_proj", "gate_up"),
                        ("up_proj", "gate_up"), ("w1", "gate_up"), ("w3", "gate_up")):
        if module.endswith(part):
            return module[: -len(part)] + fused
    return module


def write_quantized(base: Path, out: Path, quant: Quant, seed: int = 0) -> tuple[Path, Path]:
    """(the quantized checkpoint, the dequantized float32 reference) of the
    float32 checkpoint ``base``; both written under ``out``."""
    qdir, refdir = out / "quantized", out / "reference"
    for folder in (qdir, refdir):
        shutil.copytree(base, folder, dirs_exist_ok=True)
    state = load_file(base / "model.safetensors")
    # GPTQ and AWQ store fp16 scales and biases; llm-compressor the model's dtype (bf16 here).
    scale_dtype = torch.bfloat16 if quant.method == "compressed-tensors" else torch.float16
    stored, reference = {}, {}
    for name, tensor in sorted(state.items()):
        module, _, leaf = name.rpartition(".")
        quantized = module.split(".")[-1] in LINEARS and not any(module.endswith(s) for s in quant.skip)
        if not quantized:
            stored[name] = reference[name] = tensor
        elif leaf == "bias":
            stored[name] = tensor.to(scale_dtype) if quant.method != "compressed-tensors" else tensor
            reference[name] = stored[name].float()
        else:
            qz = quantize(tensor, quant, scale_dtype, seed=seed + zlib.crc32(_shared_input(module).encode()))
            for suffix, value in layer_tensors(qz, quant, *tensor.shape).items():
                stored[f"{module}.{suffix}"] = value
            reference[name] = qz.dequantized()
    save_file(stored, qdir / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, refdir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (refdir / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = quantization_config(quant)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, refdir


def checkpoint_writer(root: Path, cases: dict[str, tuple[str, Quant]]) -> Callable[[str], tuple[Path, Path]]:
    """case -> (quantized folder, dequantized reference folder) of ``cases[case]`` (a tiny model's
    architecture, its quantization), each written once under ``root``."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            arch, quant = cases[case]
            made[case] = write_quantized(make_tiny_model(root / "base", arch), root / case, quant)
        return made[case]

    return get
