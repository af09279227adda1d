"""Decode attention alone: one decode step's attention over every layer of a
model, for a batch of sequences at one context length, by each attention
backend Octavo has.

    python -m benchmarks.attention_kernel --model benchmarks/models/llama-100m --batch 256 --context 50

``native`` is octavo/kernels/paged_decode.c reading the blocks in place;
``torch`` gathers each sequence's blocks and runs SDPA on them (what
``--attention-backend torch`` does for a decode batch of equal lengths). Each
layer has its own cache and every sequence's blocks lie at shuffled places in
the pool, as in an engine that has run a while. Reported: ms per step (all
layers), the K/V bytes the step must read and their rate next to a
full-buffer sum of as many bytes (the read-bandwidth yardstick of
benchmarks/roofline.py), and ``native, data in cache``: the same call with
every block table pointing into a few blocks, i.e. the kernel's arithmetic
without the memory traffic.

    python -m benchmarks.attention_kernel --sweep --baseline /tmp/old/paged_decode.c

``--cpu-time`` (with ``--threads 1``) times by CPU time instead of wall time: on a
machine other jobs share, wall time swings with their load, CPU time far less.

``--sweep`` times the native kernel alone over a grid of shapes instead (batch
1/32/128/256, contexts 48/512/2048, 12/4 and 32/8 heads of 64 and 128, bf16,
blocks at shuffled places, caches on huge pages as the engine's unless
``--small-pages``), one layer per call with enough layers' caches in
turn that K/V comes from memory, not from the caches. ``--baseline`` (either
mode) also builds another source of paged_decode.c (e.g. ``git show
main:octavo/kernels/paged_decode.c``, with its common.h beside it) for the
same target and times it on the same data, interleaved with the current one
(without ``--sweep``: ``baseline`` rows from memory and in cache, median of
the turns, in place of ``torch``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn import functional as F

from benchmarks.options import DEFAULT_MODEL
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import in_rounds, median_time

if TYPE_CHECKING:
    from octavo.kernels.paged_decode import PagedDecodeKernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="read for its attention shape only")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sweep", action="store_true", help="the native kernel over a grid of shapes")
    parser.add_argument("--baseline", type=Path, help="another paged_decode.c to time beside the current one")
    parser.add_argument("--max-gb", type=float, default=1.1, help="sweep: skip shapes whose K/V for one layer is larger")
    parser.add_argument("--small-pages", action="store_true",
                        help="sweep: caches on 4 KiB pages (the engine asks for 2 MiB ones, see kernels/huge_pages.py)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by CPU time (needs --threads 1): a machine shared with other jobs")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times one thread: use --threads 1")
    torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(args)
        return

    from octavo.kernels.paged_decode import paged_decode_kernel

    cfg = json.loads((args.model / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers, bs, batch, ctx = cfg["num_hidden_layers"], args.block_size, args.batch, args.context
    per_seq = -(-ctx // bs)
    torch.manual_seed(0)
    caches = [torch.randn(2, batch * per_seq, bs, kv_heads, head_dim).to(torch.bfloat16) for _ in range(layers)]
    ids = list(range(batch * per_seq))
    random.Random(0).shuffle(ids)
    tables = torch.tensor(ids, dtype=torch.int64).view(batch, per_seq)
    in_cache = torch.arange(per_seq, dtype=torch.int64).repeat(batch, 1)
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim).to(torch.bfloat16)
    scale = head_dim**-0.5
    kernel = paged_decode_kernel(required=True)

    def native(block_tables: torch.Tensor, kernel: PagedDecodeKernel = kernel) -> None:
        for cache in caches:
            kernel(q, cache[0], cache[1], block_tables, lens, None, scale)

    def gathered() -> None:
        for cache in caches:
            keys = cache[0].index_select(0, tables.view(-1)).view(batch, -1, kv_heads, head_dim)[:, :ctx]
            values = cache[1].index_select(0, tables.view(-1)).view(batch, -1, kv_heads, head_dim)[:, :ctx]
            F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                           enable_gqa=True)

    kv_bytes = layers * batch * ctx * kv_heads * head_dim * 2 * 2
    clock = _clock(args)
    sum_s = median_time(torch.ones(kv_bytes // 4).sum, args.repeats, clock=clock)
    load_start = load_avg()
    runs = {"native": lambda: native(tables), "torch": gathered, "native, data in cache": lambda: native(in_cache)}
    if args.baseline is None:
        times = {name: median_time(run, args.repeats, clock=clock) for name, run in runs.items()}
    else:  # the two builds in turns, so that the machine's drift hits both
        baseline = build_baseline(args.baseline)
        del runs["torch"]
        runs["baseline"] = lambda: native(tables, baseline)
        runs["baseline, data in cache"] = lambda: native(in_cache, baseline)
        times = {name: statistics.median(cpu if args.cpu_time else wall for wall, cpu in rounds)
                 for name, rounds in in_rounds(runs, args.repeats).items()}
    rows = [{"backend": name, "ms": t * 1e3, "kv_gbs": kv_bytes / t / 1e9, "of_sum_rate": sum_s / t}
            for name, t in times.items()]
    print_table(rows, ["backend", "ms", "kv_gbs", "of_sum_rate"],
                title=f"decode attention, {args.model.name} ({layers} layers, {heads}/{kv_heads} heads of "
                      f"{head_dim}), batch {batch}, context {ctx}: {kv_bytes / 1e6:.0f} MB of K/V per step; "
                      f"full-buffer sum of as many bytes {kv_bytes / sum_s / 1e9:.1f} GB/s "
                      f"({args.threads} threads, median of {args.repeats}{', CPU time' if args.cpu_time else ''})")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "attention_kernel", "args": vars(args),
                           "kv_bytes": kv_bytes, "results": rows})


def _clock(args: argparse.Namespace) -> Callable[[], float]:
    return time.thread_time if args.cpu_time else time.perf_counter


def build_baseline(source: Path) -> PagedDecodeKernel:
    """``source`` compiled as build.py compiles the kernel (same target and
    flags), wrapped like the current one. A source from before q's row stride
    argument (an older paged_decode.c) is called without it: the sweep's q is
    contiguous, so that is the same call."""
    from octavo.kernels.build import load_other_source
    from octavo.kernels.paged_decode import _ARGTYPES, PagedDecodeKernel

    lib = load_other_source(source)
    kernel = PagedDecodeKernel(lib)
    if "q_stride" not in source.read_text():
        fn = lib.octavo_paged_decode
        fn.argtypes = [_ARGTYPES[0], *_ARGTYPES[2:]]
        kernel._fn = lambda q, _stride, *rest: fn(q, *rest)
    return kernel


def sweep(args: argparse.Namespace) -> None:
    from octavo.kernels import huge_pages
    from octavo.kernels.paged_decode import paged_decode_kernel

    kernels = {"new": paged_decode_kernel(required=True)}
    if args.baseline is not None:
        kernels = {"old": build_baseline(args.baseline), **kernels}
    bs, rows, clock = args.block_size, [], _clock(args)
    load_start = load_avg()
    grid = itertools.product([(12, 4), (32, 8)], [64, 128], [48, 512, 2048], [1, 32, 128, 256])
    for (heads, kv_heads), head_dim, ctx, batch in grid:
        layer_bytes = batch * ctx * kv_heads * head_dim * 2 * 2
        if layer_bytes > args.max_gb * 1e9:
            continue
        # Layers in turn until ~256 MB: each call's K/V has left the caches by its next turn.
        layers = max(1, min(12, int(256e6 // layer_bytes)))
        per_seq = -(-ctx // bs)
        gen = torch.Generator().manual_seed(0)
        caches = []
        for _ in range(layers):
            shape = (2, batch * per_seq, bs, kv_heads, head_dim)
            cache = torch.empty(shape, dtype=torch.bfloat16) if args.small_pages else \
                huge_pages.zeros(shape, torch.bfloat16, torch.device("cpu"))
            caches.append(cache.copy_(torch.randn(shape, generator=gen)))
        ids = torch.randperm(batch * per_seq, generator=gen)
        tables = ids.view(batch, per_seq).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int64)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16)
        row: dict[str, object] = {"heads": f"{heads}/{kv_heads}", "head_dim": head_dim, "context": ctx,
                                  "batch": batch}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for repeat in range(args.repeats + 1):  # the kernels in turn, so the machine's load falls on both
            for name, kernel in kernels.items():
                start = clock()
                for cache in caches:
                    kernel(q, cache[0], cache[1], tables, lens, None, head_dim**-0.5)
                if repeat:  # the first round warms up
                    times[name].append((clock() - start) / layers)
        for name, ts in times.items():
            t = statistics.median(ts)
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_gbs"] = layer_bytes / t / 1e9
        if args.baseline is not None:
            row["speedup"] = row["old_us"] / row["new_us"]
        rows.append(row)
        del caches
    columns = ["heads", "head_dim", "context", "batch", *[c for c in rows[0] if c.endswith(("_us", "_gbs"))]]
    print_table(rows, columns + (["speedup"] if args.baseline is not None else []),
                title=f"native decode attention per layer, bf16, blocks of {bs} on "
                      f"{'4 KiB' if args.small_pages else '2 MiB'} pages ({args.threads} threads, "
                      f"median of {args.repeats}{', CPU time' if args.cpu_time else ''})")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "attention_kernel_sweep", "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
