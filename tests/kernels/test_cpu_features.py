"""CPU-feature dispatch: detection from /proc/cpuinfo text, the choice of a
target (best, or forced by OCTAVO_CPU_TARGET), refusals naming what the CPU
lacks, and the compiler flags per target as pure functions (aarch64 builds
get no x86 flag)."""
from __future__ import annotations

import os

import pytest

from octavo.kernels import cpu_features
from octavo.kernels.cpu_features import (
    BY_NAME,
    TARGETS,
    CpuInfo,
    CpuTargetError,
    choose_target,
    compile_flags,
    read_features,
)

SAPPHIRE_RAPIDS = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm popcnt "
                   "movbe avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi avx512_vbmi2 gfni "
                   "avx512_fp16 amx_tile amx_bf16 amx_int8\n")
ZEN4 = "flags\t\t: sse2 avx avx2 fma f16c bmi1 bmi2 abm popcnt movbe avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
SKYLAKE_X = "flags\t\t: sse2 avx avx2 fma f16c bmi1 bmi2 abm popcnt movbe avx512f avx512dq avx512bw avx512vl avx512cd\n"
HASWELL = "flags\t\t: sse2 avx avx2 fma f16c bmi1 bmi2 abm popcnt movbe\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve bf16\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize("cpuinfo, arch, best", [
    (SAPPHIRE_RAPIDS, "x86_64", "amx"),
    (ZEN4, "x86_64", "avx512_bf16"),
    (SKYLAKE_X, "x86_64", "avx512"),
    (HASWELL, "x86_64", "avx2"),
    ("flags\t\t: sse2\n", "x86_64", "portable"),
    (GRAVITON3, "aarch64", "sve"),
    (GRAVITON2, "aarch64", "neon"),
    ("", "riscv64", "portable"),
])
def test_best_target_from_cpuinfo(cpuinfo, arch, best):
    assert choose_target(CpuInfo(arch, read_features(cpuinfo))).name == best


def test_forcing_a_lesser_target_is_allowed():
    info = CpuInfo("x86_64", read_features(SAPPHIRE_RAPIDS))
    assert [choose_target(info, name).name for name in ("avx512_bf16", "avx512", "avx2", "portable")] == [
        "avx512_bf16", "avx512", "avx2", "portable"]


def test_forcing_a_target_the_cpu_cannot_run_names_what_it_lacks():
    with pytest.raises(CpuTargetError, match="lacks amx_bf16, amx_tile"):
        choose_target(CpuInfo("x86_64", read_features(ZEN4)), "amx")
    with pytest.raises(CpuTargetError, match="lacks avx512_bf16, avx512_vnni"):
        choose_target(CpuInfo("x86_64", read_features(SKYLAKE_X)), "avx512_bf16")
    with pytest.raises(CpuTargetError, match="an x86_64 CPU"):
        choose_target(CpuInfo("aarch64", read_features(GRAVITON3)), "avx2")


def test_unknown_target_is_refused_with_the_choices():
    with pytest.raises(CpuTargetError, match="OCTAVO_CPU_TARGET must be one of amx, avx512_bf16"):
        choose_target(CpuInfo("x86_64", frozenset()), "avx1024")


@pytest.mark.parametrize("name", ["sve", "neon", "portable"])
def test_aarch64_flags_carry_no_x86_flag(name):
    flags = compile_flags(BY_NAME[name], "aarch64")
    assert not [f for f in flags if f.startswith(("-mavx", "-mamx", "-mfma", "-mf16c", "-mprefer-vector-width"))]
    assert "-march=native" not in flags and {"-O3", "-fopenmp", "-fPIC", "-shared"} <= set(flags)
    assert compile_flags(BY_NAME[name], "arm64") == flags  # macOS's name for the same machine


def test_x86_flags_enable_exactly_the_target_features():
    assert "-march=sapphirerapids" in compile_flags(BY_NAME["amx"], "x86_64")
    bf16 = compile_flags(BY_NAME["avx512_bf16"], "x86_64")
    assert "-mavx512bf16" in bf16 and not [f for f in bf16 if "amx" in f or f.startswith("-march")]
    avx2 = compile_flags(BY_NAME["avx2"], "x86_64")
    assert {"-mavx2", "-mfma"} <= set(avx2) and not [f for f in avx2 if f.startswith("-mavx512")]
    assert compile_flags(BY_NAME["portable"], "x86_64") == ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    with pytest.raises(CpuTargetError, match="is for x86_64, not aarch64"):
        compile_flags(BY_NAME["avx2"], "aarch64")


def test_targets_are_ordered_best_first_per_architecture():
    x86 = [t.name for t in TARGETS if t.arch == "x86_64"]
    assert x86 == ["amx", "avx512_bf16", "avx512", "avx2"]
    for better, worse in zip(TARGETS, TARGETS[1:]):
        if better.arch == worse.arch:
            assert worse.needs < better.needs


def test_process_target_honours_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("OCTAVO_CPU_TARGET", "portable")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # restored afterwards: the target sets it only when unset
    cpu_features.cpu_target.cache_clear()
    try:
        with caplog.at_level("INFO", logger="octavo.kernels.cpu_features"):
            assert cpu_features.cpu_target().name == "portable"
        assert "CPU kernels target portable (forced by OCTAVO_CPU_TARGET" in caplog.text
        monkeypatch.setenv("OCTAVO_CPU_TARGET", "no-such-target")
        cpu_features.cpu_target.cache_clear()
        with pytest.raises(CpuTargetError, match="no-such-target"):
            cpu_features.cpu_target()
    finally:
        cpu_features.cpu_target.cache_clear()


def test_forcing_a_lesser_target_caps_onednn_when_unset(monkeypatch):
    best = choose_target(cpu_features.cpu_info())
    lesser = next((t for t in TARGETS[TARGETS.index(best) + 1:] if t.onednn_isa), None)
    if lesser is None:
        pytest.skip(f"this CPU's best target ({best.name}) has no lesser x86 target")
    monkeypatch.setenv("OCTAVO_CPU_TARGET", lesser.name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "placeholder")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")  # unset, and restored (to unset or as it was) afterwards
    cpu_features.cpu_target.cache_clear()
    try:
        assert cpu_features.cpu_target() == lesser
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == lesser.onednn_isa
    finally:
        cpu_features.cpu_target.cache_clear()
