"""Which instruction set the CPU kernels are built for: detected once, chosen
once, logged once.

Targets, best first: ``amx`` (AMX bf16 tiles + AVX-512 BF16), ``avx512_bf16``
(AVX-512 with vdpbf16ps and VNNI: Zen 4, Cooper Lake, most AVX-512 cloud VMs
of the last years), ``avx512`` (AVX-512F/BW/VL/DQ: Skylake-X, Ice Lake without
BF16), ``avx2`` (AVX2 + FMA), ``sve`` / ``neon`` (aarch64) and ``portable``
(plain C; the compiler vectorises what it can). ``OCTAVO_CPU_TARGET`` forces
one (to test a path, or to measure what a lesser CPU would get); a target the
CPU cannot execute is refused with the features it lacks.

Forcing a target below ``amx`` also caps oneDNN (``ONEDNN_MAX_CPU_ISA``,
unless set already) so torch's own bf16 matmuls stop using AMX too: the
process then behaves like the lesser CPU throughout. oneDNN reads that
variable once, at its first use, so it only takes effect when the target is
chosen before any oneDNN matmul ran (the engine chooses it at start-up).
"""
from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "OCTAVO_CPU_TARGET"


@dataclass(frozen=True)
class CpuTarget:
    name: str
    arch: str  # "x86_64" or "aarch64" (portable: "any")
    needs: frozenset[str]  # /proc/cpuinfo flags (x86) or Features (aarch64) it requires
    flags: tuple[str, ...]  # compiler flags that enable exactly those features
    onednn_isa: str = ""  # the ONEDNN_MAX_CPU_ISA that caps oneDNN to the same features


# Every AVX2 CPU also has these scalar extensions (what -march=native would
# add on such a CPU).
_AVX2 = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt", "-mmovbe", "-mtune=native")
_AVX2_FEATURES = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "popcnt", "movbe"})
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *_AVX2, "-mprefer-vector-width=512")
_AVX512_FEATURES = _AVX2_FEATURES | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_BF16 = _AVX512_FEATURES | {"avx512_bf16", "avx512_vnni"}

# Best first: the default is the first the CPU can run.
TARGETS: tuple[CpuTarget, ...] = (
    # Every AMX CPU is a Sapphire Rapids or a successor: its whole ISA, named.
    # On the AMX Xeon this project measures on, the kernels' machine code is
    # then identical to the former -march=native build's (objdump), so AMX
    # machines keep their speed.
    CpuTarget("amx", "x86_64", _BF16 | {"amx_tile", "amx_bf16", "avx512_fp16", "avx512vbmi", "avx512_vbmi2", "gfni"},
              ("-march=sapphirerapids", "-mtune=native", "-mprefer-vector-width=512"), "AVX512_CORE_AMX"),
    CpuTarget("avx512_bf16", "x86_64", _BF16, _AVX512 + ("-mavx512bf16", "-mavx512vnni"), "AVX512_CORE_BF16"),
    CpuTarget("avx512", "x86_64", _AVX512_FEATURES, _AVX512, "AVX512_CORE"),
    CpuTarget("avx2", "x86_64", _AVX2_FEATURES, _AVX2, "AVX2"),
    CpuTarget("sve", "aarch64", frozenset({"asimd", "sve"}), ("-march=armv8.2-a+sve",)),
    CpuTarget("neon", "aarch64", frozenset({"asimd"}), ("-march=armv8-a+simd",)),
    CpuTarget("portable", "any", frozenset(), ()),
)
BY_NAME = {t.name: t for t in TARGETS}


class CpuTargetError(ValueError):
    """A forced target this CPU cannot execute, or an unknown name."""


def normalize_arch(machine: str) -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())


def read_features(cpuinfo: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo text: x86 ``flags`` or aarch64 ``Features``."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class CpuInfo:
    arch: str
    features: frozenset[str]

    def can_run(self, target: CpuTarget) -> bool:
        return target.arch in ("any", self.arch) and target.needs <= self.features

    def missing(self, target: CpuTarget) -> list[str]:
        if target.arch not in ("any", self.arch):
            return [f"an {target.arch} CPU (this one is {self.arch})"]
        return sorted(target.needs - self.features)


@cache
def cpu_info() -> CpuInfo:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, only the portable target
        text = ""
    return CpuInfo(normalize_arch(platform.machine()), read_features(text))


def choose_target(info: CpuInfo, forced: str = "") -> CpuTarget:
    """The best target ``info`` can run, or ``forced`` (CpuTargetError when
    unknown or not executable here, naming the missing features)."""
    if forced:
        target = BY_NAME.get(forced)
        if target is None:
            raise CpuTargetError(f"{ENV_VAR} must be one of {', '.join(BY_NAME)}; got {forced!r}")
        if not info.can_run(target):
            raise CpuTargetError(f"{ENV_VAR}={forced}: this CPU cannot run it; it lacks "
                                 f"{', '.join(info.missing(target))}")
        return target
    return next(t for t in TARGETS if info.can_run(t))


@cache
def cpu_target() -> CpuTarget:
    """The process's target (``OCTAVO_CPU_TARGET`` or the best), chosen and logged once."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    info = cpu_info()
    target = choose_target(info, forced)
    if forced and target.onednn_isa and target.name != TARGETS[0].name:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", target.onednn_isa)
    best = choose_target(info)
    logger.info("CPU kernels target %s (%s%s)", target.name,
                f"forced by {ENV_VAR}" if forced else "best this CPU runs",
                f"; the CPU could run {best.name}" if best != target else "")
    return target


def target_has(feature: str) -> bool:
    """Whether the chosen target compiles for ``feature`` (a cpuinfo flag name)."""
    return feature in cpu_target().needs


def compile_flags(target: CpuTarget, machine: str) -> list[str]:
    """Compiler flags for the kernels on ``machine`` (platform.machine()):
    optimisation, OpenMP and shared-library flags, plus the target's own ISA
    flags, never another architecture's."""
    arch = normalize_arch(machine)
    if target.arch not in ("any", arch):
        raise CpuTargetError(f"target {target.name} is for {target.arch}, not {arch}")
    return ["-O3", *target.flags, "-fopenmp", "-fPIC", "-shared", "-std=c11"]
