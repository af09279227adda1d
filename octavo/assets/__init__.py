"""Models shipped inside the package: octavo-mini and its draft, small test models trained by
tools/train_default_model.py (see MODEL_CARD.md), served when the default model
(default_model.py: SmolLM2-135M-Instruct, fetched on first use) cannot be had.

Paths are resolved from this file, so an editable install and a wheel both find them.
"""
from __future__ import annotations

from pathlib import Path

ASSETS_DIR: Path = Path(__file__).resolve().parent
MINI_MODEL_PATH: Path = ASSETS_DIR / "octavo-mini"
MINI_DRAFT_MODEL_PATH: Path = ASSETS_DIR / "octavo-mini-draft"
HELDOUT_SAMPLE_PATH: Path = ASSETS_DIR / "heldout_sample.txt"
MODEL_CARD_PATH: Path = ASSETS_DIR / "MODEL_CARD.md"
