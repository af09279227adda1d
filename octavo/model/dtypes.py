"""The torch dtype a model runs in, from its configured name: apart from the
loader so that the runners resolve it (for the weights and the KV cache)
without reaching into checkpoint loading."""
from __future__ import annotations

from typing import Optional

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(requested: str, checkpoint: Optional[str]) -> torch.dtype:
    """"auto" means the checkpoint's dtype, float32 when config.json has none."""
    name = (checkpoint or "float32") if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(_DTYPES))}; got {name!r}")
    return _DTYPES[name]
