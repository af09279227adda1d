"""The torch-free parts of the design (docs/ARCHITECTURE.md): octavo/core, the fronts
(server/, gateway/ and the OpenAI API they share in openai/), autoscale/,
simulate/, and the package-root modules every layer uses. The server is
torch-free whole because its engine runs in a process of its own. Each module
is imported in a fresh interpreter, since any earlier test may have imported
torch into this one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "octavo"
TORCH_FREE_FOLDERS = ("core", "server", "openai", "gateway", "autoscale", "simulate", "checkpoint")


def _torch_free_modules() -> list[str]:
    modules = ["octavo"]  # the package itself: LLM (and torch) load only when asked for
    modules += [f"octavo.{p.stem}" for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"]
    for folder in TORCH_FREE_FOLDERS:
        if (PACKAGE / folder).is_dir():
            for path in sorted((PACKAGE / folder).rglob("*.py")):
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
                modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def test_the_list_covers_the_core_the_fronts_and_the_root_modules():
    modules = _torch_free_modules()
    assert {"octavo", "octavo.core.scheduler", "octavo.config", "octavo.outputs", "octavo.tokenizer",
            "octavo.server.launcher", "octavo.openai.protocol", "octavo.gateway.app",
            "octavo.autoscale.runner"} <= set(modules)


@pytest.mark.parametrize("module", _torch_free_modules())
def test_imports_no_torch(module: str) -> None:
    code = f"import sys, importlib\nimportlib.import_module({module!r})\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"
