"""A KV pool larger than the memory the process can have is refused up front,
naming the option; cgroup limits count, since MemAvailable is the host's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octavo import LLM
from octavo.worker.memory import MAX_POOL_SHARE, available_memory_bytes, cgroup_headroom_bytes
from tests.model_factory import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
GiB = 2**30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_headroom_is_the_tightest_level(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/outer/inner\n")
    mount = tmp_path / "fs"
    write(mount / "outer/memory.max", f"{8 * GiB}\n")
    write(mount / "outer/memory.current", f"{7 * GiB}\n")  # 1 GiB left here
    write(mount / "outer/inner/memory.max", "max\n")
    write(mount / "outer/inner/memory.current", f"{5 * GiB}\n")
    assert cgroup_headroom_bytes(proc, mount) == 1 * GiB


def test_cgroup_v1_headroom_and_no_limit(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "5:cpu,cpuacct:/\n4:memory:/pod/box\n0::/\n")
    mount = tmp_path / "fs"
    write(mount / "memory/pod/box/memory.limit_in_bytes", f"{4 * GiB}\n")
    write(mount / "memory/pod/box/memory.usage_in_bytes", f"{1 * GiB}\n")
    write(mount / "memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    write(mount / "memory/memory.usage_in_bytes", "123\n")
    assert cgroup_headroom_bytes(proc, mount) == 3 * GiB
    write(mount / "memory/pod/box/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_headroom_bytes(proc, mount) is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("memory-model"))


def test_an_oversized_pool_is_refused_naming_the_option(folder):
    too_much = int(available_memory_bytes(CPU) / MAX_POOL_SHARE) + GiB
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes \(--kv-cache-memory\) asks for"):
        LLM(folder, dtype="float32", kv_cache_memory_bytes=too_much)
    with pytest.raises(ValueError, match=r"num_blocks \(--num-blocks\) asks for"):
        LLM(folder, dtype="float32", num_blocks=10**12)


def test_serve_with_an_oversized_pool_exits_with_the_reason(folder):
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(folder), "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "1000TiB"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--kv-cache-memory" in done.stderr and "can be had" in done.stderr
