"""Draft models for the draft-proposer tests: tiny checkpoints that share a
target's tokenizer and vocabulary, agreeing with it more or less often."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import make_tiny_model

# Smaller than tests.model_factory's defaults: a draft is the cheaper model.
SMALL_DRAFT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "head_dim": 8}


def small_draft(root: Path, arch: str = "llama") -> Path:
    """A different random model of the same vocabulary: proposals mostly rejected."""
    return make_tiny_model(root, arch, seed=7, **SMALL_DRAFT)


def noisy_copy(target: Path, root: Path, scale: float = 0.5, seed: int = 0) -> Path:
    """The target's weights plus Gaussian noise (``scale`` x each tensor's
    std): a draft that agrees with the target often but not always, so
    proposals are partly accepted."""
    folder = root / f"{target.name}-noisy-{scale}-{seed}"
    if (folder / "model.safetensors").is_file():
        return folder
    shutil.copytree(target, folder, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(target / "model.safetensors"))
    noisy = {
        name: (w + scale * w.float().std() * torch.randn(w.shape, generator=gen)).to(w.dtype) if w.ndim == 2 else w
        for name, w in weights.items()
    }
    save_file(noisy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
