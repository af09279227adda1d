"""bf16 linear layers on CPUs without AMX: which way to multiply, per weight
shape and number of rows, chosen by measuring the ways on this CPU.

Few rows (decode at small batch) read every weight once: bf16_linear.c does
that at the read rate, so up to ``ALWAYS_ROWS_KERNEL`` rows only its builds
compete (where the target has vdpbf16ps, the widening build too). Beyond,
arithmetic starts to matter and the best way depends
on the CPU (on a Xeon with AVX-512 BF16 but no AMX, oneDNN's bf16 matmul ran
at 85-139 GFLOP/s where torch's float32 one ran at 221-256, measured by
benchmarks/linear_kernels.py). The
ways measured:

- ``rows``: bf16_linear.c (up to 64 rows); ``rows_widen``: the same built to
  widen bf16 to float32 for FMAs (only where the target's own build uses
  vdpbf16ps: faster or slower depending on the CPU);
- ``gemm``: bf16_gemm.c, a register-blocked GEMM on the plain weight with
  float32 products (every target); ``gemm_dot``: the same with AVX-512 BF16
  dot products (only where the target has them: faster or slower than
  ``gemm`` depending on the CPU's vdpbf16ps rate);
- ``onednn``: torch's bf16 ``F.linear`` on the plain weight;
- ``fp32_tiles``: float32 products on bf16 weights converted a tile of output
  rows at a time into an L2-sized float32 buffer (no copy of the model);
- ``fp32_convert``: float32 products on the whole weight converted for the
  call (a transient float32 copy, up to ``CONVERT_MAX_BYTES``): at a
  prefill chunk's rows the product costs ~100x the conversion, and torch's
  float32 GEMM then runs at its full rate (on an Emerald Rapids VM without
  AMX 1.1-1.5x the GEMM's at 1024-2048 rows, where ``fp32_tiles`` lost to the
  transposed copy of its output);
- with ``copies`` allowed (memory for a second copy of every weight):
  ``onednn_packed`` (oneDNN's prepacked bf16 weight) and ``fp32_copy`` (a
  float32 copy of the weight, twice the bytes).

``LinearTable`` times each way for a weight shape at ``BUCKETS`` rows (a
product of m rows uses the first bucket >= m, the last beyond) on random
data (up to 64 rows on copies of the weight read in turn, as decode streams
them: ``STREAMED_BYTES``; the ways in turns), once per CPU/target/torch/threads/kernel build
(cached as JSON next to the built kernels), so a start-up pays for it only
the first time.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.kernels.bf16_linear import bf16_gemm_kernel, bf16_linear_kernel, bf16_linear_widening_kernel
from octavo.kernels.build import cache_root, cpu_signature
from octavo.kernels.cpu_features import CpuTarget, cpu_target

logger = logging.getLogger(__name__)

ALWAYS_ROWS_KERNEL = 4
# Small-batch decode crosses over between ways within a few rows (forced avx512_bf16, llama-100m: the
# few-row kernel best at 8 rows, oneDNN at 16-24, the GEMM at 32), hence the finer buckets there; 1 and 4
# choose between the few-row kernel's builds.
# 1024 stands for prefill chunks (up to max_num_batched_tokens rows).
BUCKETS = (1, 4, 8, 16, 32, 64, 256, 1024)
ROWS_KERNEL_MAX = 64
# Float32 tile of the weight converted at a time: a few hundred KiB, so it
# stays in L2 while the float32 product reads it.
TILE_BYTES = 512 * 1024
MEASURED_ROWS_MAX = 2048
# Up to ROWS_KERNEL_MAX rows the ways are timed on copies of the weight taken
# in turn, this many bytes of them: decode reads each weight from L3 or
# memory, never from the L2 where one weight timed over and over sits, and
# at few rows the ways differ most in how they stream (Emerald Rapids VM
# without AMX, llama-100m at 16 rows: the few-row kernel fastest in L2, the
# GEMM ~10% faster streaming all 49 matrices).
STREAMED_BYTES = 16 << 20
STREAMED_COPIES_MAX = 64  # small weights: all of them sit in L2 anyway
# Largest transient float32 weight ``fp32_convert`` may make (a 7B model's fused gate/up is 360 MB).
CONVERT_MAX_BYTES = 512 << 20


def bucket(rows: int) -> int:
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


@dataclass
class PlannedWeight:
    """One weight and the way chosen for each bucket; call it like
    ``F.linear(x, weight, bias)`` with bf16 x."""

    weight: torch.Tensor  # plain [N, K] bf16, contiguous
    ways: dict[int, str]  # bucket -> way
    packed: Optional[torch.Tensor] = None  # oneDNN's packed copy, when a way uses it
    weight_f32: Optional[torch.Tensor] = None  # float32 copy, when a way uses it

    def way_for(self, rows: int) -> str:
        return self.ways[bucket(rows)]

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return WAYS[self.way_for(rows)](self, x, bias)


def _rows(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.call(ops.bf16_linear, torch.ops.octavo.bf16_linear, x, pw.weight, bias)


def _rows_widen(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.call(ops.bf16_linear, torch.ops.octavo.bf16_linear, x, pw.weight, bias, True)


def _gemm(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.call(ops.bf16_gemm, torch.ops.octavo.bf16_gemm, x, pw.weight, bias, False)


def _gemm_dot(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.call(ops.bf16_gemm, torch.ops.octavo.bf16_gemm, x, pw.weight, bias, True)


def _onednn(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, pw.weight, bias)


def _onednn_packed(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, pw.packed, bias, "none", [], "")


def _fp32_convert(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = F.linear(x.float(), pw.weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def _fp32_copy(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = F.linear(x.float(), pw.weight_f32, None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def fp32_tiles(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in float32, the bf16 weight
    converted a tile of output rows at a time: out^T[tile] = W32[tile] @ x^T,
    each tile's result a contiguous run of out^T, transposed into bf16 once."""
    n, k = weight.shape
    x32 = x.reshape(-1, k).float()
    tile = max(16, TILE_BYTES // (4 * max(k, 1)) // 16 * 16)
    out_t = torch.empty(n, x32.shape[0], dtype=torch.float32)
    buffer = torch.empty(min(tile, n), k, dtype=torch.float32)
    for n0 in range(0, n, tile):
        part = weight[n0:n0 + tile]
        converted = buffer[:part.shape[0]]
        converted.copy_(part)
        torch.mm(converted, x32.t(), out=out_t[n0:n0 + tile])
    out32 = out_t.t()
    if bias is not None:
        out32 = out32 + bias.float()
    out = torch.empty(x32.shape[0], n, dtype=torch.bfloat16)
    out.copy_(out32)
    return out.view(*x.shape[:-1], n)


def _fp32_tiles(pw: PlannedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return fp32_tiles(pw.weight, x, bias)


def _kernel_builds() -> list[str]:
    """The builds of the native kernels the table's ways call."""
    kernels = (bf16_linear_kernel(), bf16_linear_widening_kernel(), bf16_gemm_kernel(), bf16_gemm_kernel(dot=True))
    return sorted(k.build for k in kernels if k is not None)


WAYS: dict[str, Callable[[PlannedWeight, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = {
    "rows": _rows, "rows_widen": _rows_widen, "gemm": _gemm, "gemm_dot": _gemm_dot, "onednn": _onednn,
    "fp32_tiles": _fp32_tiles, "fp32_convert": _fp32_convert, "onednn_packed": _onednn_packed, "fp32_copy": _fp32_copy,
}


def can_pack_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def make_copies(weight: torch.Tensor, ways: dict[int, str]) -> PlannedWeight:
    """The weight with the copies its ways need."""
    used = set(ways.values())
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 128) if "onednn_packed" in used else None
    weight_f32 = weight.float() if "fp32_copy" in used else None
    return PlannedWeight(weight, ways, packed, weight_f32)


def _best_seconds_in_turns(ways: dict[str, Callable[[], object]], repeats: int = 3) -> dict[str, float]:
    """Each way's fastest of ``repeats`` runs after a warm one (first-call
    set-up such as oneDNN's primitive creation is not what a step costs),
    the ways taking turns run by run: a VM's speed drifts by a third within
    minutes (Emerald Rapids VM: float32 matmuls at 286-423 GFLOP/s), and timing
    one way's runs and then the next's would rank the moments, not the ways.
    The fastest, not the median: on a shared machine the others measure the
    neighbours."""
    for fn in ways.values():
        fn()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for way, fn in ways.items():
            start = time.perf_counter()
            fn()
            best[way] = min(best[way], time.perf_counter() - start)
    return best


def shared_table() -> LinearTable:
    """The table without weight copies for the process's target and threads
    (for callers with no method of their own to hold one: quantized weights)."""
    return _shared_table(cpu_target(), torch.get_num_threads(), cache_root())


@cache
def _shared_table(target: CpuTarget, threads: int, root: Path) -> LinearTable:
    return LinearTable()


class LinearTable:
    """Measured best way per (N, K, bucket); ``copies`` allows the ways that
    keep a second copy of the weight."""

    def __init__(self, copies: bool = False, path: Optional[Path] = None) -> None:
        self.copies = copies
        self.path = path or self._default_path()
        self._entries: dict[str, str] = {}
        try:
            self._entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            pass

    def _default_path(self) -> Path:
        # The ways measured and the native builds that run them are part of
        # the key: a table chosen among fewer ways (an older Octavo, a target
        # without some kernel) or timed on other kernel code is not reused.
        key = "\0".join([cpu_signature(), cpu_target().name, torch.__version__, str(torch.get_num_threads()),
                         str(self.copies), ",".join(map(str, BUCKETS)),
                         ",".join(sorted({way for b in BUCKETS for way in self.candidates(b)})), *_kernel_builds()])
        return cache_root() / f"linear-table-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def candidates(self, rows: int) -> list[str]:
        rows_ways = ["rows"] + (["rows_widen"] if bf16_linear_widening_kernel() is not None else [])
        if rows <= ALWAYS_ROWS_KERNEL:
            return rows_ways
        ways = ["onednn", "fp32_tiles", "fp32_convert"]
        ways[:0] = [w for w, dot in (("gemm", False), ("gemm_dot", True)) if bf16_gemm_kernel(dot=dot) is not None]
        if rows <= ROWS_KERNEL_MAX:
            ways[:0] = rows_ways
        if self.copies:
            ways += ["fp32_copy"] + (["onednn_packed"] if can_pack_onednn() else [])
        return ways

    def ways(self, n: int, k: int) -> dict[int, str]:
        """The best way for each bucket (measured now if not in the table)."""
        weights: list[torch.Tensor] = []

        def ways_at(rows: int) -> dict[str, Callable[[], object]]:
            # Every way's time grows with N alike: a slice of a tall weight (an
            # output layer) ranks them as well, at a fraction of the start-up time.
            if not weights:
                weights.append(torch.randn(min(n, MEASURED_ROWS_MAX), k).to(torch.bfloat16))
                copies = min(STREAMED_COPIES_MAX, -(-STREAMED_BYTES // weights[0].nbytes))
                weights.extend(weights[0].clone() for _ in range(copies - 1))
            x = torch.randn(rows, k).to(torch.bfloat16)
            ways = [w for w in self.candidates(rows) if w != "fp32_convert" or n * k * 4 <= CONVERT_MAX_BYTES]
            used = weights if rows <= ROWS_KERNEL_MAX else weights[:1]
            # One turn for all ways: each call reads the copy least recently read.
            turn = itertools.count()

            def product(way: str) -> Callable[[], object]:
                planned = [make_copies(w, {b: way for b in BUCKETS}) for w in used]
                return lambda: WAYS[way](planned[next(turn) % len(planned)], x, None)

            return {way: product(way) for way in ways}

        return self.choose(f"{n}x{k}", BUCKETS, ways_at)

    def choose(self, key: str, buckets: Sequence[int],
               ways_at: Callable[[int], dict[str, Callable[[], object]]]) -> dict[int, str]:
        """For each bucket, the fastest of the ways ``ways_at(bucket)`` offers
        (each a product of that many rows, timed as it is called), from the
        table, else measured now and saved under ``key``."""
        found = {b: self._entries.get(f"{key}@{b}") for b in buckets}
        if all(way is not None for way in found.values()):
            return found
        started = time.perf_counter()
        chosen = {}
        for b in buckets:
            times = _best_seconds_in_turns(ways_at(b))
            chosen[b] = min(times, key=times.__getitem__)
            for way, seconds in times.items():
                self._entries[f"{key}@{b}:{way}_ms"] = round(seconds * 1e3, 4)
            self._entries[f"{key}@{b}"] = chosen[b]
        self._save()
        logger.info("linear table: measured %s in %.2f s: %s", key, time.perf_counter() - started,
                    ", ".join(f"{b} rows {w}" for b, w in chosen.items()))
        return chosen

    def _save(self) -> None:
        # Written beside and renamed: concurrent engines never read half a file.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._entries, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:  # an unwritable cache costs a re-measure next start, nothing else
            logger.warning("linear table not saved to %s: %s", self.path, exc)
