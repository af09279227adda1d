"""Build a kernel's C source with the machine's compiler on first use, and load it.

Each kernel is compiled for one CPU target (octavo/kernels/cpu_features.py:
the process's chosen one unless a caller names another) with that target's
explicit ISA flags, so one source yields an AMX, AVX-512 BF16, AVX-512F, AVX2,
NEON or portable library; the C code picks its paths by the compiler's
feature macros (``__AVX512BF16__``, ``__AMX_TILE__``...). The shared library
is cached under ``$OCTAVO_CACHE_DIR`` (default ``~/.cache/octavo``) in a folder
named by a hash of the source (and the shared headers), the compiler, the
flags, the target and this CPU, so a change of any of them rebuilds.
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
import threading
import time
from functools import cache
from pathlib import Path
from typing import Iterable, Optional

import torch  # noqa: F401  (loads torch's libgomp.so.1 first, which the kernels then share)

from octavo.kernels.cpu_features import CpuTarget, compile_flags, cpu_target

logger = logging.getLogger(__name__)
_BUILD_LOCKS: dict[tuple[str, str], threading.Lock] = {}


class KernelBuildError(RuntimeError):
    pass


def cpu_signature() -> str:
    """The CPU model and feature flags (a cache shared between machines never
    hands one a library another's compiler tuned for)."""
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


def cache_root() -> Path:
    return Path(os.environ.get("OCTAVO_CACHE_DIR") or Path.home() / ".cache" / "octavo") / "kernels"


def load_kernel(name: str, target: Optional[CpuTarget] = None) -> ctypes.CDLL:
    """Compile ``octavo/kernels/<name>.c`` for ``target`` (default: the
    process's, see cpu_features) once per source/compiler/flags/CPU, and load
    it. Raises KernelBuildError when it cannot be built."""
    return _load(name, target or cpu_target())


def clear_loaded() -> None:
    """Forget the libraries loaded so far (tests that change the compiler or cache folder)."""
    _load.cache_clear()
    _compiler_version.cache_clear()


def prebuild(names: Iterable[str], target: Optional[CpuTarget] = None) -> None:
    """Start compiling the named kernels for ``target`` on background threads, each its own compiler
    process, so a cold start compiles them side by side and while the model loads; ``load_kernel``
    then waits for the build in flight instead of starting its own. Failures surface when loaded."""
    target = target or cpu_target()
    try:
        missing = [name for name in names if not _planned(name, target)[3].exists()]
    except KernelBuildError:
        return  # no compiler: the torch paths, as the loads will say
    if missing:
        logger.info("compiling %d native kernels for this CPU (%s): %s; once, then cached in %s",
                    len(missing), target.name, ", ".join(missing), cache_root())
    for name in missing:
        thread = threading.Thread(target=_build_quietly, args=(name, target), name=f"build {name}", daemon=True)
        thread.start()


def default_kernels(target: Optional[CpuTarget] = None) -> tuple[str, ...]:
    """The kernels a CPU engine loads on ``target`` for a float or int8/int4 model."""
    linear = ("amx_linear",) if "amx" in (target or cpu_target()).name else ("bf16_linear", "bf16_gemm")
    return ("paged_decode", "fused_ops", "quant_linear", "qdot_linear", *linear)


def _build_quietly(name: str, target: CpuTarget) -> None:
    try:
        _build(name, target)
    except KernelBuildError:
        pass  # reported by the load that needs it


@cache
def _load(name: str, target: CpuTarget) -> ctypes.CDLL:
    return ctypes.CDLL(str(_build(name, target)))


def _build(name: str, target: CpuTarget) -> Path:
    """The library of ``name`` for ``target``, compiled unless cached; one build at a time per kernel."""
    with _BUILD_LOCKS.setdefault((name, target.name), threading.Lock()):
        return _build_locked(name, target)


def _build_locked(name: str, target: CpuTarget) -> Path:
    cc, flags, source, library = _planned(name, target)
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the library and rename: concurrent engines never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        started = time.monotonic()
        try:
            _compile(cc, flags, source, Path(tmp), target)
        except KernelBuildError:
            os.unlink(tmp)
            raise
        os.replace(tmp, library)
        logger.info("built %s kernel for %s in %.1f s", name, target.name, time.monotonic() - started)
    return library


def _planned(name: str, target: CpuTarget) -> tuple[str, list[str], Path, Path]:
    """(compiler, flags, source, library path) of ``name`` for ``target``: the path names a hash of all the rest."""
    source = Path(__file__).with_name(f"{name}.c")
    flags = compile_flags(target, platform.machine())
    cc = _compiler()
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, cc, _compiler_version(cc), " ".join(flags), target.name,
                   cpu_signature()]).encode()
    ).hexdigest()[:16]
    return cc, flags, source, cache_root() / f"{name}-{target.name}-{key}" / f"lib{name}.so"


@cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"C compiler {cc!r} does not run: {exc}") from exc


def _compile(cc: str, flags: list[str], source: Path, library: Path, target: CpuTarget) -> None:
    result = subprocess.run([cc, *flags, str(source), "-o", str(library), "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelBuildError(f"building {source.name} for {target.name} failed:\n{result.stderr.strip()}")


def load_other_source(source: Path) -> ctypes.CDLL:
    """Another copy of a kernel source (an older version, for a benchmark's
    A/B) compiled as ``load_kernel`` compiles it for the process's target, into
    a fresh temporary folder, uncached; its headers are the ones beside it."""
    target = cpu_target()
    library = Path(tempfile.mkdtemp()) / f"lib{source.stem}.so"
    _compile(_compiler(), compile_flags(target, platform.machine()), source, library, target)
    return ctypes.CDLL(str(library))


def kernel_library(name: str, target: Optional[CpuTarget] = None, required: bool = False) -> Optional[ctypes.CDLL]:
    """What every kernel's accessor loads: ``load_kernel`` when the caller ``required`` it (a build error is
    raised), else ``try_load_kernel`` (None, and the torch path, where it cannot be built)."""
    return load_kernel(name, target) if required else try_load_kernel(name, target)


def try_load_kernel(name: str, target: Optional[CpuTarget] = None) -> Optional[ctypes.CDLL]:
    """``load_kernel``, or None (logged once) when the machine cannot build it."""
    try:
        return load_kernel(name, target)
    except KernelBuildError as exc:
        _warn_once(name, str(exc))
        return None


@cache
def _warn_once(name: str, reason: str) -> None:
    logger.warning("native %s kernel unavailable, using the torch path: %s", name, reason)
