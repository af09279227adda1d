from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import model_dir  # noqa: F401  (the tiny checkpoints, built once)


# These tests run the engine on a GPU (benchmarks/gpu_check.sh runs them there); CPU-side checks of the same code
# (Triton kernels in the interpreter, the decode-graph buffers) live with the CPU tests.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/cuda/" in str(item.fspath):
            item.add_marker(skip)
