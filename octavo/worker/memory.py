"""How much memory a KV pool may take, and the check that an explicit one fits.

An explicit ``num_blocks`` or ``kv_cache_memory_bytes`` larger than the
memory the process can get used to fail late and badly: on CPU the pool is
zero-filled page by page until the kernel's OOM killer ends the process (or
the container's cgroup limit does, with no message at all); on CUDA the
allocation fails with an out-of-memory error naming no option. The pool is
therefore checked against what is available before it is allocated.

On CPU "available" is the smaller of the kernel's MemAvailable and the
headroom (limit minus usage) of every memory cgroup around the process,
because inside a container MemAvailable describes the whole host.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

# Of the memory available once the weights are loaded, the share an explicit
# pool may take: the rest is for activations, the sampler and the runtime.
MAX_POOL_SHARE = 0.9
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge number near 2**63
_CGROUP_FILES = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes"), "v2": ("memory.max", "memory.current")}


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    # psutil is not a dependency; MemAvailable is what the kernel can give
    # without swapping.
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise ValueError("cannot read MemAvailable from /proc/meminfo: set kv_cache_memory_bytes or num_blocks")
    headroom = cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


def cgroup_headroom_bytes(
    proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")
) -> Optional[int]:
    """Limit minus usage of the tightest memory cgroup enclosing this process
    (v1 or v2, each level up to the mount's root); None when none is limited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, kind = mount, "v2"
        elif "memory" in controllers.split(","):
            base, kind = mount / "memory", "v1"
        else:
            continue
        headrooms += _headrooms_up_to(base, base / path.lstrip("/"), *_CGROUP_FILES[kind])
    return min(headrooms) if headrooms else None


def _headrooms_up_to(base: Path, start: Path, limit_file: str, usage_file: str) -> list[int]:
    found = []
    level = start
    while True:
        try:
            limit_text = (level / limit_file).read_text().strip()
            usage = int((level / usage_file).read_text())
        except (OSError, ValueError):
            limit_text = "max"
            usage = 0
        if limit_text != "max" and int(limit_text) < _UNLIMITED:
            found.append(max(int(limit_text) - usage, 0))
        if level == base or base not in level.parents:
            return found
        level = level.parent


def check_pool_fits(pool_bytes: int, device: torch.device, option: str) -> None:
    """ValueError naming ``option`` when a pool of ``pool_bytes`` cannot be had."""
    available = available_memory_bytes(device)
    allowed = int(available * MAX_POOL_SHARE)
    if pool_bytes > allowed:
        where = "free device memory" if device.type == "cuda" else "available memory (RAM, cgroup limit included)"
        raise ValueError(
            f"{option} asks for a KV cache of {pool_bytes / 2**30:.2f} GiB, but only {allowed / 2**30:.2f} GiB "
            f"({MAX_POOL_SHARE:.0%} of {available / 2**30:.2f} GiB {where}) can be had; lower {option}"
        )
