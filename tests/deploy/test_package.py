"""A non-editable install (what the container image does: `pip install .`) carries every file the package needs:
the built-in model's weights, the kernels' C sources, chat templates."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.deploy.monitoring import REPO as ROOT


def test_wheel_holds_every_file_of_the_package(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("octavo-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    sources = {path.relative_to(ROOT).as_posix() for path in (ROOT / "octavo").rglob("*")
               if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}
    assert sources - packaged == set()
    assert any(name.startswith("octavo/assets/octavo-mini/") and name.endswith(".safetensors") for name in packaged)
