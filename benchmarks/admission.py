"""Admission under a burst, and /health while a large body is parsed.

    python -m benchmarks.admission                      # starts `octavo serve` (the built-in model), ~1 minute
    python -m benchmarks.admission --model DIR --burst 500 --json benchmarks/results/admission.json

Starts a server with a small admission limit (--max-num-seqs 2
--max-waiting-requests 4 by default) and sends --burst streaming completions
at once. Each answer is a 200 (admitted) or a 503 with Retry-After
(refused); it reports how many were admitted, the most admitted streams
open at the same moment as the clients saw them (from each 200's headers
to its last event: at most the limit, whatever the engine's speed), and
how fast refusals came back. Then it sends one large body (a 10 MB array
of token ids ending in a string, which the server refuses) while /health
is probed every 20 ms, and reports the probes' latencies beside an idle
baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

from benchmarks.online import running_server
from benchmarks.report import load_avg, print_table, write_json


async def burst(base_url: str, n: int, max_tokens: int) -> dict:
    opened: list[tuple[float, float]] = []  # admitted streams: (headers received, last event)
    refusals: list[float] = []
    other: list[str] = []

    async def one(http: httpx.AsyncClient) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        async with http.stream("POST", "/v1/completions", json=body) as r:
            start = time.perf_counter()
            await r.aread()
            end = time.perf_counter()
        if r.status_code == 200:
            opened.append((start, end))
        elif r.status_code == 503 and r.headers.get("retry-after"):
            refusals.append(end - t0)
        else:
            other.append(f"{r.status_code} {r.text[:100]}")

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as http:
        await asyncio.gather(*(one(http) for _ in range(n)))
    edges = sorted([(s, 1) for s, _ in opened] + [(e, -1) for _, e in opened])
    held = most = 0
    for _, step in edges:
        held += step
        most = max(most, held)
    refusals.sort()
    return {
        "sent": n, "admitted": len(opened), "refused": len(refusals), "other": other[:5],
        "most_open_at_once": most,
        "refusal_p50_ms": 1000 * statistics.median(refusals) if refusals else None,
        "refusal_p99_ms": 1000 * refusals[int(0.99 * (len(refusals) - 1))] if refusals else None,
    }


def health_during_large_body(base_url: str, items: int) -> dict:
    raw = json.dumps({"prompt": list(range(100, 400)) * (items // 300) + ["x"], "max_tokens": 1}).encode()
    with httpx.Client(base_url=base_url, timeout=60.0) as http:
        idle = []
        for _ in range(50):
            t0 = time.perf_counter()
            http.get("/health")
            idle.append(time.perf_counter() - t0)
            time.sleep(0.02)
        result: dict = {}

        def send() -> None:
            t0 = time.perf_counter()
            r = httpx.post(base_url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                           timeout=120.0)
            result.update(status=r.status_code, seconds=time.perf_counter() - t0)

        sender = threading.Thread(target=send)
        probes = []
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            http.get("/health")
            probes.append(time.perf_counter() - t0)
            time.sleep(0.02)
        sender.join()
    return {
        "body_mb": len(raw) / 1e6, "body_status": result["status"], "body_s": result["seconds"],
        "idle_median_ms": 1000 * statistics.median(idle), "probes": len(probes),
        "during_median_ms": 1000 * statistics.median(probes) if probes else None,
        "during_max_ms": 1000 * max(probes) if probes else None,
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model folder to serve (default: the built-in one)")
    parser.add_argument("--port", type=int, default=8125)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--max-waiting-requests", type=int, default=4)
    parser.add_argument("--burst", type=int, default=500, help="requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each admitted request generates")
    parser.add_argument("--body-items", type=int, default=2_100_000, help="token ids in the large body")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--log", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "admission-server.log")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", *([str(args.model)] if args.model else []),
           "--port", str(args.port), "--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting-requests", str(args.max_waiting_requests), "--max-body-size", "16MiB"]
    base_url = f"http://127.0.0.1:{args.port}"
    limit = args.max_num_seqs + args.max_waiting_requests
    with running_server(cmd, base_url, args.log, args.ready_timeout, args.threads):
        load = load_avg()
        admission = asyncio.run(burst(base_url, args.burst, args.max_tokens))
        health = health_during_large_body(base_url, args.body_items)
        load += " -> " + load_avg()
    print_table([{**admission, "limit": limit}],
                ["sent", "limit", "admitted", "most_open_at_once", "refused", "refusal_p50_ms", "refusal_p99_ms"],
                title=f"burst of {args.burst} (load {load})")
    print_table([health], ["body_mb", "body_status", "body_s", "idle_median_ms", "probes", "during_median_ms",
                           "during_max_ms"], title="/health while a large body is parsed")
    if admission["other"]:
        print("unexpected answers:", admission["other"])
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "load": load, "limit": limit,
               "admission": admission, "health": health}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
