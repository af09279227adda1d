from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.model_factory import make_variant


@pytest.fixture(scope="session")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """variant(name) -> checkpoint folder of tests.model_factory.VARIANTS[name], built once per session."""
    root = tmp_path_factory.mktemp("models")
    return lambda name: make_variant(root, name)
