from __future__ import annotations

import subprocess
import sys


def test_the_core_imports_no_torch():
    code = (
        "import sys, pkgutil, importlib, octavo.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('octavo.core.' + m.name)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
