"""Every kernel source compiles for the aarch64 targets (neon, sve) with the
flags build.py would use there, by a cross compiler: an x86 CI machine
cannot run those libraries, but it keeps them building (.ci/run installs
gcc-aarch64-linux-gnu)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from octavo import kernels
from octavo.kernels.cpu_features import BY_NAME, compile_flags

CROSS = shutil.which("aarch64-linux-gnu-gcc")
SOURCES = sorted(Path(kernels.__file__).parent.glob("*.c"))


def test_there_are_kernel_sources():
    assert {"bf16_linear.c", "quant_linear.c"} <= {s.name for s in SOURCES}


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (.ci/run installs gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("target_name", ["neon", "sve"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles_for_aarch64(source, target_name, tmp_path):
    flags = compile_flags(BY_NAME[target_name], "aarch64")
    result = subprocess.run([CROSS, *flags, "-c", str(source), "-o", str(tmp_path / "kernel.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
