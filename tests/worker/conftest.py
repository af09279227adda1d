from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.model_factory import load_hf_model, make_variant


@pytest.fixture(scope="session")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """variant(name) -> checkpoint folder of tests.model_factory.VARIANTS[name], built once per session."""
    root = tmp_path_factory.mktemp("models")
    return lambda name: make_variant(root, name)


@pytest.fixture(scope="session")
def hf_model(variant: Callable[[str], Path]) -> Callable[[str], torch.nn.Module]:
    """hf_model(name) -> the transformers reference for variant(name), loaded once.

    Its EOS is cleared so ``generate`` always runs the asked number of steps
    (min_new_tokens would instead mask EOS out of the logits)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            model = cache[name] = load_hf_model(variant(name))
            model.generation_config.eos_token_id = None
        return cache[name]

    return get
