"""Does the capacity simulator predict one real, loaded replica? Calibrate
against a running `octavo serve`, then replay Poisson traces below, at and
above its saturation against the server and through `octavo simulate`.

    python -m benchmarks.simulator_validation [--model octavo/assets/octavo-mini]

Steps, back to back (the machine may be shared: the load average is recorded
around each one):
1. one `octavo serve` of the model (its engine options: --max-num-seqs,
   --kv-cache-memory, --dtype, --threads as OMP_NUM_THREADS);
2. `octavo simulate calibrate --clock cpu --served URL --served-steps FILE`
   with the same options: the bare engine's steps on the CPU clock, then
   probes of the server and Poisson arrivals around its saturation (other
   lengths and seeds than the validation's traces), whose steps, read from
   the server's --step-record FILE, set what serving adds
   (octavo/simulate/served.py); or --cost-model to reuse one;
3. the rates: --rates, or the cost model's saturation rate (below) times
   0.5, 1 and 1.5;
4. per rate: a seeded Poisson trace (octavo/simulate/traces.py), saved as
   JSONL, replayed against the server at its arrival times (streaming
   /v1/completions, the prompt as token ids, ``ignore_eos``), and simulated;
5. a table of predicted vs measured TTFT, TPOT and e2e p50/p99 and output
   throughput, with the load average, and the figures outside their band
   (15% below saturation, 25% at and above it): one table for each way of
   drawing the served steps' stalls (``--stalls`` of `octavo simulate run`:
   independent per step, or the calibration's steps replayed in the runs
   they came in), both against the same measurement.

Each rate's requests, measured and simulated side by side, go to
``requests-RATE-STALLS.jsonl`` (their send times on the clock of the
server's step record, ``served-steps.jsonl``), to read the tails from.

The saturation rate is where a full batch (``max_num_seqs`` sequences)
just keeps up (``CostModel.saturation_rate``).
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

import httpx

from benchmarks.online import running_server
from benchmarks.report import load_avg
from benchmarks.workload import ordinary_token_ids
from octavo.entrypoints.calibrate_served import sse_events
from octavo.simulate.cost_model import CostModel
from octavo.simulate.replica import ReplicaShape, RequestRecord
from octavo.simulate.report import SLO, percentile, summarize
from octavo.simulate.simulator import STALL_MODELS, FleetConfig, Simulator
from octavo.simulate.traces import LengthDist, TraceRequest, TraceSpec, generate, save_jsonl

RESULTS = Path(__file__).resolve().parent / "results" / "simulator"
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "octavo" / "assets" / "octavo-mini"
FIGURES = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99", "output_tokens_per_s")
# How far a prediction may be from the measured figure: below saturation, and at or above it (where a few percent
# of capacity is the difference between a queue and none).
BAND_BELOW, BAND_ABOVE = 0.15, 0.25


# ---- the real replica --------------------------------------------------


@dataclass
class Measured:
    ttft: float
    e2e: float
    tokens: int
    sent: float  # time.monotonic(), the clock of the server's --step-record
    done: float


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Measured:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for event in sse_events(r):
            # The first event with a choice carries the first token (its text may be empty: a partial character).
            if event.get("choices") and ttft is None:
                ttft = time.monotonic() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.monotonic()
    return Measured(ttft if ttft is not None else end - start, end - start, tokens, start, end)


async def replay(base_url: str, model: str, trace: list[TraceRequest], vocab: list[int], seed: int) -> list[Measured]:
    import random

    rng = random.Random(seed)
    prompts = [[rng.choice(vocab) for _ in range(t.prompt_tokens)] for t in trace]
    # A fresh connection per request (as the served calibration): a kept-alive one can meet the server closing it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        t0 = time.monotonic()
        tasks = []
        for t, prompt in zip(trace, prompts):
            delay = t0 + t.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, model, prompt, t.output_tokens)))
        return list(await asyncio.gather(*tasks))


def measured_summary(results: list[Measured]) -> dict:
    """The figures of FIGURES, as the simulator's summary computes them (TPOT over requests with two tokens)."""
    ttfts, e2es = [m.ttft for m in results], [m.e2e for m in results]
    tpots = [(m.e2e - m.ttft) / (m.tokens - 1) for m in results if m.tokens > 1]
    span = max(m.done for m in results) - min(m.sent for m in results)
    out = {f"{name}_p{q}": percentile(values, q) for name, values in (("ttft", ttfts), ("tpot", tpots),
                                                                        ("e2e", e2es)) for q in (50, 99)}
    return {**out, "output_tokens_per_s": sum(m.tokens for m in results) / span}


# ---- the simulated replica ---------------------------------------------


def simulate(cost: CostModel, trace: list[TraceRequest], seed: int,
             stalls: str = "independent") -> tuple[dict, list[RequestRecord]]:
    """The simulated figures of FIGURES, and the simulated requests."""
    result = Simulator(cost, ReplicaShape.of_engine(cost.engine), FleetConfig(stalls=stalls), seed=seed).run(trace)
    s = summarize(result, SLO())
    out = {f"{name}_p{q}": s[f"{name}_s"][f"p{q}"] for name in ("ttft", "tpot", "e2e") for q in (50, 99)}
    return ({**out, "output_tokens_per_s": s["throughput"]["output_tokens_per_s"], "preemptions": s["preemptions"]},
            result.records)


def save_requests(path: Path, trace: list[TraceRequest], measured: list[Measured],
                  simulated: list[RequestRecord]) -> None:
    """Each request of one rate, measured and simulated side by side (JSON Lines), to read the tails from: when
    each was sent (``sent``, on the step record's clock), its TTFT and e2e at the client and in the simulator."""
    by_arrival = sorted(simulated, key=lambda r: r.arrival_s)
    with path.open("w") as f:
        for t, m, s in zip(trace, measured, by_arrival):
            f.write(json.dumps({"arrival_s": t.arrival_s, "sent": m.sent, "ttft": m.ttft, "e2e": m.e2e,
                                "tokens": m.tokens, "sim_ttft": s.ttft, "sim_e2e": s.e2e}) + "\n")


def calibrate(args: argparse.Namespace, engine_flags: list[str], base_url: str, served_steps: Path) -> Path:
    path = args.out_dir / "cost.json"
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "simulate", "calibrate", str(args.model), *engine_flags,
           "-o", str(path), "--repeats", str(args.calibration_repeats), "--max-batch", str(args.max_num_seqs),
           "--clock", "cpu", "--served", base_url, "--served-steps", str(served_steps),
           "--steps-out", str(args.out_dir / "steps.jsonl")]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--cost-model", type=Path, default=None, help="reuse this calibration instead of running one")
    p.add_argument("--calibration-repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the calibrated engine and the server (OMP_NUM_THREADS); one thread "
                        "degrades more gracefully than a spinning pool when other work shares the cores")
    p.add_argument("--rates", default=None, help="comma-separated requests/s (default: 0.5, 1 and 1.5 times the "
                                                 "cost model's saturation rate)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8571)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    engine_flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                    "--kv-cache-memory", args.kv_cache_memory]
    cli = [sys.executable, "-m", "octavo.entrypoints.cli"]
    loads = {"start": load_avg()}
    vocab = ordinary_token_ids(args.model)
    rows = []
    base_url = f"http://127.0.0.1:{args.port}"
    served_steps = args.out_dir / "served-steps.jsonl"
    served_steps.unlink(missing_ok=True)
    cmd = cli + ["serve", str(args.model), *engine_flags, "--port", str(args.port), "--log-level", "warning",
                 "--step-record", str(served_steps)]
    with running_server(cmd, base_url, args.out_dir / "serve.log", 600, args.threads):
        cost_path = args.cost_model or calibrate(args, engine_flags, base_url, served_steps)
        loads["after_calibration"] = load_avg()
        cost = CostModel.load(cost_path)
        if cost.served is None:
            raise SystemExit(f"{cost_path}: no served calibration (`octavo simulate calibrate --served URL`)")
        saturation = cost.saturation_rate(args.prompt_len, args.output_len)
        # A cost model fitted without the server's steps has no recorded stalls to replay.
        stall_models = [m for m in STALL_MODELS if m == "independent" or cost.served.speed_tape is not None]
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [f * saturation for f in (0.5, 1, 1.5)]
        print(f"predicted saturation: {saturation:.2f} req/s; rates {', '.join(f'{r:.2f}' for r in rates)}")
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        lengths = {"prompt": LengthDist.parse(f"fixed:{args.prompt_len}"),
                   "output": LengthDist.parse(f"fixed:{args.output_len}")}
        for i, rate in enumerate(rates):
            trace = generate(TraceSpec("poisson", args.duration, rate, **lengths), args.seed)
            save_jsonl(trace, args.out_dir / f"poisson-{rate:.2f}.jsonl")
            before = load_avg()
            # Each rate's prompts of their own: with one seed for all, every prompt of a rate repeated one of the
            # rate before it and was served from the prefix cache (192 of its 200 tokens), which the simulated
            # replica, whose prompts are its own random ids, does not do.
            requests = asyncio.run(replay(base_url, model, trace, vocab, args.seed + 1000 * (i + 1)))
            measured = measured_summary(requests)
            band = band_of(rate / saturation)
            row = {"rate": rate, "of_saturation": rate / saturation, "requests": len(trace),
                   "load": f"{before} -> {load_avg()}", "measured": measured, "band": band}
            # Both ways of drawing the served steps' stalls (FleetConfig.stalls), against the same measurement.
            for stalls in stall_models:
                predicted, simulated = simulate(cost, trace, args.seed, stalls)
                error = {k: predicted[k] / measured[k] - 1 for k in FIGURES}
                row[stalls] = {"predicted": predicted, "error": error,
                               "outside": [k for k in FIGURES if abs(error[k]) > band]}
                save_requests(args.out_dir / f"requests-{rate:.2f}-{stalls}.jsonl", trace, requests, simulated)
            rows.append(row)
            print(json.dumps(row))
    loads["end"] = load_avg()
    report = {"model": str(args.model), "cost_model": cost.to_json(), "saturation_rate": saturation,
              "loads": loads, "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out_dir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    for stalls in stall_models:
        print_table(rows, stalls)


def print_table(rows: list[dict], stalls: str) -> None:
    """Measured / simulated (error), the stalls drawn ``stalls``: latencies in ms, throughput in output tokens/s."""
    print(f"\nstalls {stalls}:")
    head = " | ".join(f"{k.replace('_', ' ')} meas / sim" for k in FIGURES)
    print(f"| rate (x saturation) | requests | {head} | load 1/5/15 |")
    print("|---" * (len(FIGURES) + 3) + "|")
    for r in rows:
        m, s, e = r["measured"], r[stalls]["predicted"], r[stalls]["error"]
        scale = {k: 1.0 if k == "output_tokens_per_s" else 1e3 for k in FIGURES}
        cells = " | ".join(f"{m[k] * scale[k]:.0f} / {s[k] * scale[k]:.0f} ({e[k]:+.0%})" for k in FIGURES)
        print(f"| {r['rate']:.2f} ({r['of_saturation']:.1f}x) | {r['requests']} | {cells} | {r['load']} |")
    for r in rows:
        outside = ", ".join(f"{k} {r[stalls]['error'][k]:+.0%}" for k in r[stalls]["outside"]) or "none"
        print(f"{r['of_saturation']:.1f}x: outside +-{r['band']:.0%}: {outside}")
    within = sum(len(FIGURES) - len(r[stalls]["outside"]) for r in rows)
    print(f"{within} of {len(FIGURES) * len(rows)} figures within their band (stalls {stalls})")


def band_of(of_saturation: float) -> float:
    """The band a rate's figures are held to: BAND_BELOW below saturation (a rate 1% under it counts as at it)."""
    return BAND_BELOW if of_saturation < 0.99 else BAND_ABOVE


if __name__ == "__main__":
    main()
