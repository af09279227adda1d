"""Tensor and pipeline parallelism on CPU: one process vs TP=2 vs PP=2.

    python -m benchmarks.parallel                                   # the default model
    python -m benchmarks.parallel --model benchmarks/models/llama-100m --json out.json

Rows: one process with 1 and with 2 intra-op threads, TP=2 and PP=2 with one
thread per rank (each rank pinned to its own core). Measured per row:
batch-1 decode tokens/s (one request, after its prefill) and offline output
tokens/s (``--num-prompts`` random prompts, ``--output-len`` tokens each,
ignore_eos). Then the cost of the collectives a TP=2 decode step pays, timed
alone on two gloo ranks: each step runs 2 all-reduces per layer, one for the
embedding and a gather of the logits on the driver. ``--executor-overhead``
instead times steady greedy decode steps at batch 1 and 64 with the
in-process executor and with the multi-process one at world size 1 (what a
step costs to cross to a rank process and back).
"""
from __future__ import annotations

import argparse
import random
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.report import load_avg, print_table, write_json
from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH
from octavo.model.config import load_arch_config
from octavo.model.dtypes import resolve_dtype

ROWS = [
    ("1 process, 1 thread", dict(), 1),
    ("1 process, 2 threads", dict(), 2),
    ("TP=2, 1 thread/rank", dict(tensor_parallel_size=2, threads_per_worker=1), 1),
    ("PP=2, 1 thread/rank", dict(pipeline_parallel_size=2, threads_per_worker=1), 1),
]


def _decode_tps(llm: LLM, output_len: int) -> float:
    engine = llm.engine
    engine.add_request("b1", list(range(10, 26)), SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    engine.step()  # the prefill (and, with pipeline stages, nothing else in flight)
    start, produced = time.perf_counter(), 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
    return (produced - 1) / (time.perf_counter() - start)


def _offline_tps(llm: LLM, num_prompts: int, prompt_len: int, output_len: int, vocab: int) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return num_prompts * output_len / (time.perf_counter() - start)


def _collective_rank(rank: int, port: int, hidden: int, vocab: int, dtype: torch.dtype, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for rows in (1, 64):
            x = torch.randn(rows, hidden).to(dtype)
            logits = torch.randn(rows, -(-vocab // 2)).to(dtype)
            for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                             ("gather_logits", lambda: dist.gather(logits, [torch.empty_like(logits)] * 2 if rank == 0 else None, dst=0))):
                for _ in range(20):
                    op()
                dist.barrier()
                n, start = 300, time.perf_counter()
                for _ in range(n):
                    op()
                if rank == 0:
                    out[(name, rows)] = (time.perf_counter() - start) / n * 1e6
    finally:
        dist.destroy_process_group()


def collective_costs(model: Path, dtype: torch.dtype) -> dict[tuple[str, int], float]:
    arch = load_arch_config(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    mp.start_processes(_collective_rank, args=(port, arch.hidden_size, arch.vocab_size, dtype, out), nprocs=2,
                       start_method="spawn")
    return dict(out) | {("layers", 0): arch.num_layers}


def _median_step_ms(llm: LLM, batch: int, runs: int = 4) -> float:
    """Best of ``runs``: the median step of 48-token greedy decodes of ``batch`` requests."""
    engine, best = llm.engine, float("inf")
    for run in range(runs):
        for i in range(batch):
            params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            engine.add_request(f"s{run}-{batch}-{i}", [1, 50 + i, 60, 70], params)
        engine.step()
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        best = min(best, sorted(times[:-1])[len(times[:-1]) // 2] * 1e3)
    return best


def executor_overhead(model: Path, dtype: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for backend in ("uni", "mp"):
        llm = LLM(model, dtype=dtype, distributed_executor_backend=backend, threads_per_worker=1)
        try:
            rows.append({"executor": backend, **{f"batch {b} ms/step": _median_step_ms(llm, b) for b in (1, 64)},
                         "load": load_avg()})
        finally:
            llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MINI_MODEL_PATH)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--executor-overhead", action="store_true")
    args = parser.parse_args()
    if args.executor_overhead:
        rows = executor_overhead(args.model, args.dtype)
        print_table(rows, ["executor", "batch 1 ms/step", "batch 64 ms/step", "load"], f"{args.model}, world size 1")
        write_json(args.json, {"executor_overhead": rows})
        return
    vocab = load_arch_config(args.model).vocab_size
    rows = []
    for name, kwargs, threads in ROWS:
        torch.set_num_threads(threads)
        llm = LLM(args.model, dtype=args.dtype, **kwargs)
        try:
            _offline_tps(llm, 4, 8, 8, vocab)  # warm-up
            row = {"setup": name, "load": load_avg()}
            row["batch-1 decode tok/s"] = _decode_tps(llm, args.decode_len)
            row["offline out tok/s"] = _offline_tps(llm, args.num_prompts, args.prompt_len, args.output_len, vocab)
            rows.append(row)
        finally:
            llm.shutdown()
    print_table(rows, ["setup", "batch-1 decode tok/s", "offline out tok/s", "load"], f"{args.model}")
    dtype = resolve_dtype(args.dtype, load_arch_config(args.model).dtype)
    costs = collective_costs(args.model, dtype)
    layers = costs.pop(("layers", 0))
    coll = []
    for rows_ in (1, 64):
        ar, ga = costs[("all_reduce", rows_)], costs[("gather_logits", rows_)]
        coll.append({"batch": rows_, "all-reduce us": ar, "logits gather us": ga,
                     "per TP=2 step us": (2 * layers + 1) * ar + ga})
    print_table(coll, ["batch", "all-reduce us", "logits gather us", "per TP=2 step us"],
                f"collectives on 2 gloo ranks ({dtype}, {layers} layers: {2 * layers + 1} all-reduces a step)")
    write_json(args.json, {"rows": rows, "collectives": coll})


if __name__ == "__main__":
    main()
