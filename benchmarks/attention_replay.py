"""The decode-attention calls of one real engine step, replayed alone: what
the memory under the KV cache costs the kernel.

    python -m benchmarks.attention_replay --model benchmarks/models/llama-100m --batch 256 --threads 2

The engine decodes ``--batch`` prompts of 32 tokens for 16 steps (contexts
~50, blocks wherever its allocator put them in its 2 GiB pool), one step's
calls of the native kernel are recorded, and then replayed in turn over the
engine's caches copied onto 4 KiB pages and onto 2 MiB pages
(octavo/kernels/huge_pages.py), and with q copied out of its fused-QKV view
per call (what the wrapper did before it read q in place). Reported: ms per
step (all layers), median and fastest of ``--repeats``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.options import DEFAULT_MODEL
from benchmarks.report import load_avg, print_table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before the engine starts (its threads share the pool)

    from benchmarks.peers.octavo_peer import OctavoPeer
    from octavo.kernels import huge_pages
    from octavo.kernels.paged_decode import PagedDecodeKernel

    peer = OctavoPeer(args.model, "bfloat16", max_num_seqs=max(args.batch, 256), enable_prefix_caching=False,
                      kv_cache_memory_bytes=2 * 2**30)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(args.batch)]
    peer.steady_decode_rate(prompts, 4)  # warm-up
    ids = peer.start_decoding(prompts, 40)
    for _ in range(16):
        peer.llm.engine.step()
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    original = PagedDecodeKernel.__call__

    def record(self: PagedDecodeKernel, *a: Any, **k: Any) -> torch.Tensor:
        calls.append((self, a, k))
        return original(self, *a, **k)

    PagedDecodeKernel.__call__ = record
    try:
        peer.llm.engine.step()
    finally:
        PagedDecodeKernel.__call__ = original

    def copied(huge: bool) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
        """The calls over copies of each layer's [2, blocks, ...] cache (K and V are its two halves)."""
        out = []
        for kernel, a, k in calls:
            k_cache = a[1]
            whole = torch.empty(0, dtype=k_cache.dtype).set_(k_cache.untyped_storage()).view(2, *k_cache.shape)
            copy = huge_pages.zeros(whole.shape, whole.dtype, whole.device) if huge else torch.empty_like(whole)
            copy.copy_(whole)
            out.append((kernel, (a[0], copy[0], copy[1], *a[3:]), k))
        return out

    def replay(layers: list[tuple[Any, tuple[Any, ...], dict[str, Any]]], copy_q: bool = False) -> Callable[[], None]:
        def run() -> None:
            for kernel, a, k in layers:
                original(kernel, a[0].contiguous() if copy_q else a[0], *a[1:], **k)
        return run

    small, huge = copied(False), copied(True)
    runs = {"4 KiB pages, q copied (before)": replay(small, True), "4 KiB pages": replay(small),
            "2 MiB pages": replay(huge)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    load_start = load_avg()
    for repeat in range(args.repeats + 1):  # in turn, so the machine's load falls on all alike
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:
                times[name].append(time.perf_counter() - start)
    peer.stop_decoding(ids)  # not before: the replays read the engine's live tables and queries
    rows = [{"variant": name, "ms_median": statistics.median(ts) * 1e3, "ms_fastest": min(ts) * 1e3}
            for name, ts in times.items()]
    lens = calls[0][1][4]
    print_table(rows, ["variant", "ms_median", "ms_fastest"],
                title=f"decode attention of one {args.model.name} step replayed: batch {args.batch}, contexts "
                      f"{lens.min().item()}-{lens.max().item()}, {len(calls)} layers ({args.threads} threads, "
                      f"{args.repeats} repeats)")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "attention_replay", "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
