"""Expert parallelism at tensor-parallel size 2 on CPU gloo: which way to hand tokens to the
ranks holding their experts.

Both ways run the same expert products on each rank (every (token, choice) pair routed to the
rank's experts), so only what moves between the ranks is timed, on two processes:

- all-reduce (what octavo does): the hidden states are already whole on every rank after
  attention's all-reduce, so each rank runs its pairs for all tokens and one all-reduce of
  [tokens, hidden] sums the block;
- all-to-all: each rank takes half the tokens, sends the rows routed to the other rank's experts
  there (an all-to-all of the counts, then of the rows), gets their results back (a second
  all-to-all of rows) and the halves are all-gathered (the next attention needs every token).

Shapes are those of the routed layers of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8) and
Mixtral-8x7B (hidden 4096, 8 experts, top-2), routes drawn uniformly at random.

    python -m benchmarks.ep_dispatch                      # batches 1, 16, 128
    python -m benchmarks.ep_dispatch --tokens 1 256 --iters 200 --json out.json
"""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.report import load_avg, print_table, write_json

# (name, hidden size, experts, experts per token)
SHAPES = (("Qwen3-30B-A3B", 2048, 128, 8), ("Mixtral-8x7B", 4096, 8, 2))
WORLD = 2


def _all_reduce(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> Callable[[], None]:
    out = x.clone()
    return lambda: dist.all_reduce(out)


def _all_to_all(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> Callable[[], None]:
    rank, per_rank = dist.get_rank(), num_experts // WORLD
    mine = torch.arange(x.shape[0])[rank::WORLD]  # this rank's half of the tokens

    def step() -> None:
        # Each (token, choice) pair of this rank's tokens, sorted by the rank holding its expert.
        owner = (ids.index_select(0, mine) // per_rank).flatten()
        order = owner.argsort(stable=True)
        rows = x.index_select(0, mine.repeat_interleave(ids.shape[1]).index_select(0, order))
        send_counts = torch.bincount(owner, minlength=WORLD)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        received = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(received, rows, recv, send)  # dispatch
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, received, send, recv)  # combine (the experts' outputs, same shape)
        half = x.new_zeros(mine.numel(), x.shape[1]).index_add_(
            0, order.div(ids.shape[1], rounding_mode="floor"), back)
        parts = [torch.empty(len(range(r, x.shape[0], WORLD)), x.shape[1], dtype=x.dtype) for r in range(WORLD)]
        if any(p.shape != half.shape for p in parts):  # odd batch: all_gather needs equal parts
            parts = [half.new_empty(parts[0].shape) for _ in range(WORLD)]
            half = torch.cat([half, half.new_zeros(parts[0].shape[0] - half.shape[0], x.shape[1])])
        dist.all_gather(parts, half)

    return step


WAYS = {"all-reduce": _all_reduce, "all-to-all": _all_to_all}


def _rank(rank: int, port: int, tokens: list[int], iters: int, dtype: torch.dtype, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for name, hidden, experts, top_k in SHAPES:
            for n in tokens:
                gen = torch.Generator().manual_seed(n)  # the same routes on both ranks, as the router gives
                x = torch.randn(n, hidden, generator=gen).to(dtype)
                ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(n)])
                for way, make in WAYS.items():
                    step = make(x, ids, experts)
                    for _ in range(5):
                        step()
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        step()
                    if rank == 0:
                        out[(name, n, way)] = (time.perf_counter() - start) / iters * 1e6
    finally:
        dist.destroy_process_group()


def measure(tokens: list[int], iters: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_rank, args=(port, tokens, iters, dtype, out), nprocs=WORLD, start_method="spawn")
    return [{"shape": name, "tokens": n, **{f"{way} us": out[(name, n, way)] for way in WAYS}}
            for name, *_ in SHAPES for n in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128], help="batch sizes (tokens per step)")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per row")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = measure(args.tokens, args.iters, getattr(torch, args.dtype))
    print_table(rows, ["shape", "tokens", *(f"{way} us" for way in WAYS)],
                f"one MoE block's exchange at EP=2, gloo, {args.dtype}; load {load_avg()}")
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
