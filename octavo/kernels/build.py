"""Build a kernel's C source with the machine's compiler on first use, and load it.

The shared library is cached under ``$OCTAVO_CACHE_DIR`` (default
``~/.cache/octavo``) in a folder named by a hash of the source (and the shared headers), the compiler,
the flags and this CPU, so a change of any of them rebuilds and a cache shared
between different machines never hands one a library built for another's
instruction set (``-march=native``).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Optional

import torch  # noqa: F401  (loads torch's libgomp.so.1 first, which the kernels then share)

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class KernelBuildError(RuntimeError):
    pass


def _cpu_signature() -> str:
    """The CPU model and feature flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _cache_root() -> Path:
    return Path(os.environ.get("OCTAVO_CACHE_DIR") or Path.home() / ".cache" / "octavo") / "kernels"


@cache
def load_kernel(name: str) -> ctypes.CDLL:
    """Compile ``octavo/kernels/<name>.c`` (once per source/compiler/CPU) and
    load it. Raises KernelBuildError when it cannot be built."""
    source = Path(__file__).with_name(f"{name}.c")
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"C compiler {cc!r} does not run: {exc}") from exc
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, cc, version, " ".join(FLAGS), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = _cache_root() / f"{name}-{key}" / f"lib{name}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent engines never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise KernelBuildError(f"building {source.name} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
        logger.info("built %s kernel: %s", name, target)
    return ctypes.CDLL(str(target))


def try_load_kernel(name: str) -> Optional[ctypes.CDLL]:
    """``load_kernel``, or None (logged once) when the machine cannot build it."""
    try:
        return load_kernel(name)
    except KernelBuildError as exc:
        _warn_once(name, str(exc))
        return None


@cache
def _warn_once(name: str, reason: str) -> None:
    logger.warning("native %s kernel unavailable, using the torch path: %s", name, reason)
