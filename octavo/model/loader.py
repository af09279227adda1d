"""Load a Hugging Face safetensors checkpoint folder into the decoder."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from octavo.model.config import ArchConfig, load_arch_config
from octavo.model.layers.linear import FusedLinear
from octavo.model.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# Checkpoints may carry tensors that are recomputed rather than loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(requested: str, checkpoint: Optional[str]) -> torch.dtype:
    """"auto" means the checkpoint's dtype, float32 when config.json has none."""
    name = (checkpoint or "float32") if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(_DTYPES))}; got {name!r}")
    return _DTYPES[name]


def model_folder(model: str | Path) -> Path:
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(model)!r} does not exist (only local folders are supported)")
    return folder


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {missing}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"no safetensors weights in {folder}: expected model.safetensors or model.safetensors.index.json"
    )


def _fused_parts(net: torch.nn.Module) -> dict[str, dict[str, torch.Size]]:
    """Fused parameter name -> its checkpoint parts' names and shapes, in stacking order."""
    stacks: dict[str, dict[str, torch.Size]] = {}
    for module_name, module in net.named_modules():
        if not isinstance(module, FusedLinear):
            continue
        parent = module_name.rsplit(".", 1)[0]
        for param_name, param in module.named_parameters(recurse=False):
            stacks[f"{module_name}.{param_name}"] = {
                f"{parent}.{part}.{param_name}": torch.Size([size, *param.shape[1:]])
                for part, size in zip(module.parts, module.sizes)
            }
    return stacks


def load_model(
    model: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_model_len: Optional[int] = None,
) -> tuple[DecoderForCausalLM, ArchConfig]:
    """Build the model for ``model``'s config.json and fill it from its safetensors.

    The module is built on the meta device, then every parameter is assigned the
    loaded tensor itself (converted only when the dtype differs), so weights are
    not allocated twice. Missing or unexpected tensors raise ValueError naming them.
    """
    folder = model_folder(model)
    arch = load_arch_config(folder)
    torch_dtype = resolve_dtype(dtype, arch.dtype)
    files = safetensors_files(folder)
    with torch.device("meta"):
        net = DecoderForCausalLM(arch, max_len=arch.max_model_len(max_model_len))
    expected = {name: p.shape for name, p in net.state_dict().items()}
    if arch.tie_word_embeddings:
        del expected["lm_head.weight"]
    stacks = _fused_parts(net)
    for fused, parts in stacks.items():
        del expected[fused]
        expected.update(parts)

    tensors: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (arch.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                t = f.get_tensor(name)
                tensors[name] = t if t.dtype == torch_dtype else t.to(torch_dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match {arch.architecture}: "
            f"missing tensors {missing[:10]}, unexpected tensors {sorted(unexpected)[:10]}"
        )
    wrong = [f"{n}: {tuple(t.shape)} != {tuple(expected[n])}" for n, t in tensors.items() if t.shape != expected[n]]
    if wrong:
        raise ValueError(f"checkpoint in {folder} has tensors of the wrong shape: {wrong[:10]}")

    for fused, parts in stacks.items():
        tensors[fused] = torch.cat([tensors.pop(part) for part in parts])
    net.load_state_dict(tensors, strict=False, assign=True)
    net.tie_weights()
    net.requires_grad_(False)
    net.eval()
    logger.info(
        "loaded %s from %s: %d tensors, dtype %s, device %s",
        arch.architecture, folder, len(tensors), torch_dtype, device,
    )
    return net, arch
