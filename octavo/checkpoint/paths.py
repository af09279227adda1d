"""Where a model's checkpoint is: the path checks the engine makes before it
starts anything, torch-free so that it needs no model code to make them."""
from __future__ import annotations

from pathlib import Path

from octavo.checkpoint.gguf_file import is_gguf


def model_path(model: str | Path) -> Path:
    """The model's checkpoint folder or GGUF file; ValueError when it is neither."""
    path = Path(model)
    if path.is_file() and not is_gguf(path):
        raise ValueError(f"model {str(model)!r} is a file but not a GGUF file (expected a checkpoint folder "
                         "or a .gguf file)")
    if not (path.is_dir() or path.is_file()):
        raise ValueError(f"model {str(model)!r} does not exist (expected a checkpoint folder or a .gguf file)")
    return path
