"""Session-wide test setup."""
from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels (the CUDA attention backend's) run in Triton's interpreter on CPU tensors. The
# switch is read when triton itself is imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
