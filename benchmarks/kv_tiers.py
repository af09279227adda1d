"""KV tiers: time to first token of chat turns that return after other traffic evicted them from the pool.

    python -m benchmarks.kv_tiers                                   # short: the shipped model
    python -m benchmarks.kv_tiers --model benchmarks/models/llama-100m --first-tokens 1024 --num-blocks 160 \
        --host-bytes 67108864                                       # prefill that costs (tools/make_bench_models.py)

Each chat opens with a long prompt; each later turn is the whole conversation
so far plus a few new tokens. Between two turns of a chat, the other chats
and fresh filler prompts pass through, so a small pool has evicted the chat
by the time it returns. Two engines run the same traffic in turns (each
chat turn on one, then the other, so load on the machine hits both alike):
prefix caching over the pool alone, and the pool with host-memory and disk
tiers (--kv-offload-host-bytes, --kv-offload-dir). Halfway through, the
tiered engine is stopped and a new one started on the same folder.

Reports TTFT p50 and p99 of returning turns for each engine, the speed-up,
and the first returning turn after the restart against the warm p50; and
the same for the CPU time each turn took to its first token, which the
load of other processes on a shared machine swings far less than wall time.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import load_avg, print_table, write_json
from benchmarks.workload import ordinary_token_ids
from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH


def _turn(llm: LLM, request_id: str, prompt: list[int], answer_tokens: int) -> tuple[float, float, list[int]]:
    """Run one request alone: (seconds to its first token, the process's CPU
    seconds until then, its tokens). On a shared machine wall time swings
    with other processes' load; the CPU time (every thread's, the tiers'
    reader included) is the work the turn cost."""
    engine = llm.engine
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True))
    ttft, cpu, tokens = None, None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if out.finished:
                tokens = out.outputs[0].token_ids
    return ttft, cpu, tokens


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MINI_MODEL_PATH)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="turns per chat")
    parser.add_argument("--first-tokens", type=int, default=320, help="a chat's opening prompt")
    parser.add_argument("--turn-tokens", type=int, default=16, help="new tokens of each later turn")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--filler", type=int, default=2, help="fresh prompts after each chat turn")
    parser.add_argument("--num-blocks", type=int, default=48, help="the pool: too small to keep the chats")
    parser.add_argument("--host-bytes", default=str(256 * 2**20))
    parser.add_argument("--dir", type=Path, default=None, help="the disk tier's folder (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: every core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    load_before = load_avg()
    rng = random.Random(args.seed)
    vocab = ordinary_token_ids(args.model)
    chats = [[rng.choice(vocab) for _ in range(args.first_tokens)] for _ in range(args.chats)]
    folder = args.dir or Path(tempfile.mkdtemp(prefix="octavo-kv-tiers-"))
    common: dict[str, Any] = dict(dtype=args.dtype, num_blocks=args.num_blocks, threads_per_worker=args.threads)
    tiered_options = dict(common, kv_offload_host_bytes=int(args.host_bytes), kv_offload_dir=str(folder))
    engines = {"pool only": LLM(args.model, **common), "tiers": LLM(args.model, **tiered_options)}
    returning: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}  # (TTFT, CPU) per turn
    after_restart = None
    contexts = {name: [list(c) for c in chats] for name in engines}
    for rnd in range(args.rounds):
        if rnd == args.rounds // 2 and rnd > 0:
            engines["tiers"].shutdown()  # writes the pool and host tier to the folder
            engines["tiers"] = LLM(args.model, **tiered_options)
            after_restart = "pending"  # the next returning turn of the tiered engine
        for c in range(args.chats):
            new = [rng.choice(vocab) for _ in range(args.turn_tokens)]
            fillers = [[rng.choice(vocab) for _ in range(args.first_tokens)] for _ in range(args.filler)]
            order = list(engines) if (rnd + c) % 2 == 0 else list(engines)[::-1]
            for name in order:
                llm, ctx = engines[name], contexts[name][c]
                if rnd > 0:
                    ctx += new
                ttft, cpu, answer = _turn(llm, f"{name}-{rnd}-{c}", ctx, args.answer_tokens)
                ctx += answer
                if rnd > 0:
                    if name == "tiers" and after_restart == "pending":
                        after_restart = (ttft, cpu)
                    else:
                        returning[name].append((ttft, cpu))
                for i, filler in enumerate(fillers):
                    _turn(llm, f"{name}-{rnd}-{c}-filler{i}", filler, 1)
    hits = {name: llm.engine.get_stats() for name, llm in engines.items()}
    for llm in engines.values():
        llm.shutdown()
    if args.dir is None:
        shutil.rmtree(folder)  # a temporary folder of hundreds of MB of block files

    rows = []
    for name, turns in returning.items():
        stats = hits[name]  # the tiered engine's since the restart
        wall, cpu = [t for t, _ in turns], [c for _, c in turns]
        rows.append({"engine": name, "returning turns": len(turns), "TTFT p50 ms": 1e3 * _p(wall, 50),
                     "TTFT p99 ms": 1e3 * _p(wall, 99), "CPU to 1st token p50 ms": 1e3 * _p(cpu, 50),
                     "prefix hit rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
                     "tier hits host/disk (tokens)":
                     "/".join(str(stats.kv_offload_hits.get(m, 0)) for m in ("cpu", "disk"))})
    print_table(rows, list(rows[0]), "returning chat turns")
    print(f"load average (1/5/15 min): {load_before} before, {load_avg()} after")
    base, tiers = ([t for t, _ in returning[n]] for n in ("pool only", "tiers"))
    base_cpu, tiers_cpu = ([c for _, c in returning[n]] for n in ("pool only", "tiers"))
    speedup = _p(base, 50) / _p(tiers, 50)
    print(f"tiers: {speedup:.2f}x lower TTFT p50 ({_p(base, 99) / _p(tiers, 99):.2f}x at p99), "
          f"{_p(base_cpu, 50) / _p(tiers_cpu, 50):.2f}x less CPU to the first token")
    if after_restart is not None:
        ttft, cpu = after_restart
        print(f"first returning turn after the restart: {1e3 * ttft:.1f} ms, {ttft / _p(tiers, 50):.2f}x the warm "
              f"TTFT p50; {1e3 * cpu:.1f} ms of CPU, {cpu / _p(tiers_cpu, 50):.2f}x the warm p50")
    write_json(args.json, {"args": vars(args), "rows": rows, "speedup_p50": speedup, "after_restart": after_restart,
                           "load_avg": [load_before, load_avg()]})

if __name__ == "__main__":
    main()
