"""Does the capacity simulator predict one real replica? Calibrate, then run
the same traces against `octavo serve` and through `octavo simulate`.

    python -m benchmarks.simulator_validation --model benchmarks/models/llama-100m

Steps, back to back (the machine is shared: the load average is recorded
around each one):
1. `octavo simulate calibrate` on the model (or --cost-model to reuse one);
2. one `octavo serve` with the calibrated engine's limits; a few lone
   requests measure what serving adds to the calibrated engine steps: per
   step (the output message, the HTTP front streaming each token on the
   same cores: their TPOT minus the cost model's decode step) and per request
   (HTTP, tokenizing the id list: their TTFT minus the prefill step). The
   simulator adds them as --step-overhead and --request-overhead;
3. per workload: a seeded trace (octavo/simulate/traces.py), saved as JSONL,
   replayed against the server at its arrival times (streaming
   /v1/completions, the prompt as token ids, ``ignore_eos``), and simulated;
4. a table of predicted vs measured TTFT p50/p99 and output throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import httpx

from benchmarks.online import running_server
from benchmarks.report import load_avg
from benchmarks.workload import ordinary_token_ids
from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.replica import ReplicaShape
from octavo.simulate.report import SLO, percentile, summarize
from octavo.simulate.simulator import FleetConfig, Simulator
from octavo.simulate.traces import LengthDist, TraceRequest, TraceSpec, generate, save_jsonl
from octavo.config import CacheConfig, SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results" / "simulator"


@dataclass(frozen=True)
class Workload:
    name: str
    spec: TraceSpec


def workloads(duration: float) -> list[Workload]:
    def lengths(p: str, o: str) -> dict:
        return {"prompt": LengthDist.parse(p), "output": LengthDist.parse(o)}

    return [
        Workload("poisson-light", TraceSpec("poisson", duration, 0.3, **lengths("lognormal:128:0.6:16:512",
                                                                                  "uniform:16:64"))),
        Workload("poisson-busy", TraceSpec("poisson", duration, 1.0, **lengths("lognormal:96:0.5:16:384",
                                                                                 "uniform:32:96"))),
        Workload("long-prompts", TraceSpec("poisson", duration, 0.2, **lengths("uniform:600:1200", "fixed:16"))),
        Workload("bursty", TraceSpec("bursty", duration, 0.2, burst_rate=2.0, on_s=8.0, off_s=20.0,
                                     **lengths("lognormal:128:0.6:16:512", "uniform:16:64"))),
    ]


# ---- the real replica --------------------------------------------------


@dataclass
class Measured:
    ttft: float
    e2e: float
    tokens: int
    sent: float
    done: float


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Measured:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            # The first event with a choice carries the first token (its text may be empty: a partial character).
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return Measured(ttft if ttft is not None else end - start, end - start, tokens, start, end)


async def replay(base_url: str, model: str, trace: list[TraceRequest], vocab: list[int], seed: int) -> list[Measured]:
    import random

    rng = random.Random(seed)
    prompts = [[rng.choice(vocab) for _ in range(t.prompt_tokens)] for t in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for t, prompt in zip(trace, prompts):
            delay = t0 + t.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, model, prompt, t.output_tokens)))
        return list(await asyncio.gather(*tasks))


def measured_summary(results: list[Measured]) -> dict:
    ttfts = [m.ttft for m in results]
    span = max(m.done for m in results) - min(m.sent for m in results)
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "output_tokens_per_s": sum(m.tokens for m in results) / span,
            "tpot_p50": percentile([(m.e2e - m.ttft) / (m.tokens - 1) for m in results if m.tokens > 1], 50)}


def serving_overheads(base_url: str, model: str, cost: CostModel, vocab: list[int], n: int) -> tuple[float, float]:
    """What a served request costs beyond the calibrated engine steps, from lone requests (nothing
    else in flight): per step, the median of (TPOT - the cost model's batch-1 decode step); per
    request, the median of (TTFT - its prefill step - that step overhead)."""
    ttft_gaps, step_gaps = [], []
    out = 16
    for i in range(n):
        length = 64 + 64 * i
        m = asyncio.run(replay(base_url, model, [TraceRequest(0.0, length, out)], vocab, seed=100 + i))[0]
        prefill = cost.predict(StepWork(length, 1, length * (length + 1) / 2, 0, 0))
        decode = sum(cost.predict(StepWork(decode_seqs=1, decode_context_tokens=length + j + 1))
                     for j in range(out - 1)) / (out - 1)
        step_gaps.append((m.e2e - m.ttft) / (m.tokens - 1) - decode)
        ttft_gaps.append(m.ttft - prefill)
        time.sleep(0.2)
    step = max(0.0, median(step_gaps))
    return max(0.0, median(ttft_gaps) - step), step


# ---- the simulated replica ---------------------------------------------


def simulate(cost: CostModel, trace: list[TraceRequest], overhead: float, step_overhead: float, seed: int) -> dict:
    e = cost.engine
    shape = ReplicaShape(SchedulerConfig(e.max_num_seqs, e.max_num_batched_tokens, e.enable_chunked_prefill),
                         CacheConfig(block_size=e.block_size), e.num_kv_blocks, e.max_model_len)
    result = Simulator(cost, shape, FleetConfig(request_overhead_s=overhead, step_overhead_s=step_overhead), seed=seed).run(trace)
    s = summarize(result, SLO())
    return {"ttft_p50": s["ttft_s"]["p50"], "ttft_p99": s["ttft_s"]["p99"],
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"], "tpot_p50": s["tpot_s"]["p50"],
            "preemptions": s["preemptions"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(__file__).resolve().parent / "models" / "llama-100m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--cost-model", type=Path, default=None, help="reuse this calibration instead of running one")
    p.add_argument("--calibration-repeats", type=int, default=1)
    p.add_argument("--calibration-max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the calibrated engine and the server (OMP_NUM_THREADS); one thread "
                        "degrades more gracefully than a spinning pool when other work shares the cores")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per workload")
    p.add_argument("--only", default=None, help="comma-separated workload names")
    p.add_argument("--overhead-probes", type=int, default=5)
    p.add_argument("--port", type=int, default=8571)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    engine_flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                    "--kv-cache-memory", args.kv_cache_memory]
    cli = [sys.executable, "-m", "octavo.entrypoints.cli"]
    loads = {"start": load_avg()}
    cost_path = args.cost_model
    if cost_path is None:
        cost_path = args.out_dir / "cost.json"
        subprocess.run(cli + ["simulate", "calibrate", str(args.model), *engine_flags, "-o", str(cost_path),
                              "--repeats", str(args.calibration_repeats), "--max-batch", str(args.calibration_max_batch),
                              "--steps-out", str(args.out_dir / "steps.jsonl")],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        loads["after_calibration"] = load_avg()
    cost = CostModel.load(cost_path)
    vocab = ordinary_token_ids(args.model)
    chosen = [w for w in workloads(args.duration) if not args.only or w.name in args.only.split(",")]
    rows = []
    base_url = f"http://127.0.0.1:{args.port}"
    cmd = cli + ["serve", str(args.model), *engine_flags, "--port", str(args.port), "--log-level", "warning"]
    with running_server(cmd, base_url, args.out_dir / "serve.log", 600, args.threads):
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        asyncio.run(replay(base_url, model, [TraceRequest(0.0, 256, 8)] * 4, vocab, seed=99))  # warm up
        overhead, step_overhead = serving_overheads(base_url, model, cost, vocab, args.overhead_probes)
        print(f"serving overheads: {overhead * 1e3:.1f} ms per request, {step_overhead * 1e3:.1f} ms per step")
        for w in chosen:
            trace = generate(w.spec, args.seed)
            save_jsonl(trace, args.out_dir / f"{w.name}.jsonl")
            before = load_avg()
            measured = measured_summary(asyncio.run(replay(base_url, model, trace, vocab, args.seed)))
            predicted = simulate(cost, trace, overhead, step_overhead, args.seed)
            row = {"workload": w.name, "requests": len(trace), "load": f"{before} -> {load_avg()}",
                   "measured": measured, "predicted": predicted,
                   "error": {k: predicted[k] / measured[k] - 1 for k in ("ttft_p50", "ttft_p99",
                                                                          "output_tokens_per_s", "tpot_p50")}}
            rows.append(row)
            print(json.dumps(row))
    loads["end"] = load_avg()
    report = {"model": str(args.model), "cost_model": cost.to_json(), "request_overhead_s": overhead,
              "step_overhead_s": step_overhead,
              "loads": loads, "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out_dir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print("| workload | requests | TTFT p50 meas / sim (ms) | TTFT p99 meas / sim (ms) | "
          "output tok/s meas / sim | TPOT p50 meas / sim (ms) | load 1/5/15 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m, s, e = r["measured"], r["predicted"], r["error"]
        print(f"| {r['workload']} | {r['requests']} "
              f"| {m['ttft_p50'] * 1e3:.0f} / {s['ttft_p50'] * 1e3:.0f} ({e['ttft_p50']:+.0%}) "
              f"| {m['ttft_p99'] * 1e3:.0f} / {s['ttft_p99'] * 1e3:.0f} ({e['ttft_p99']:+.0%}) "
              f"| {m['output_tokens_per_s']:.1f} / {s['output_tokens_per_s']:.1f} ({e['output_tokens_per_s']:+.0%}) "
              f"| {m['tpot_p50'] * 1e3:.1f} / {s['tpot_p50'] * 1e3:.1f} ({e['tpot_p50']:+.0%}) | {r['load']} |")


if __name__ == "__main__":
    main()
