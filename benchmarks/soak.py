"""Soak: steady mixed traffic for N minutes while the server's memory and KV pool are sampled.

    python -m benchmarks.soak --minutes 10 --json benchmarks/results/soak.json    # starts `octavo serve`
    python -m benchmarks.soak --url http://127.0.0.1:8000 --server-pid 1234 --api-key KEY --minutes 30

Requests arrive as a Poisson process at --rate (at most --max-in-flight at a
time): completions and chat, streamed or not, a few clients that hang up
mid-stream and a few bad requests (each must be a 400). Every --sample-every
seconds it records the resident memory (VmRSS) of the HTTP front and of the
engine process, and from /metrics the free KV blocks and the running and
waiting requests. A leak shows as RSS that keeps growing after the warm-up
(reported as a least-squares drift in MiB per minute) or as KV blocks still
taken once the traffic has stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.online import running_server
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.serve import WORDS, latency_summary

# (kind, weight): what the traffic is made of.
MIX = (
    ("completion", 25),
    ("completion-stream", 25),
    ("chat", 20),
    ("chat-stream", 20),
    ("disconnect", 5),  # streams, then hangs up after a few events
    ("bad", 5),  # must be answered 400
)
BAD_BODIES = (
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
)
METRICS = ("octavo:kv_free_blocks", "octavo:kv_total_blocks", "octavo:num_requests_running",
           "octavo:num_requests_waiting")


@dataclass
class Record:
    kind: str
    outcome: str  # "ok", "disconnected", "400" for a bad request answered right, else what went wrong
    latency_s: float
    at_s: float


@dataclass
class Sample:
    at_s: float
    front_rss_mib: Optional[float]
    engine_rss_mib: Optional[float]
    kv_free_blocks: float
    kv_total_blocks: float
    running: float
    waiting: float
    requests_done: int


def rss_mib(pid: Optional[int]) -> Optional[float]:
    """VmRSS from /proc (psutil is not a dependency); None once the process is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def engine_pid(server_pid: int) -> Optional[int]:
    """The engine is the server's child started by multiprocessing's spawn."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    return None


async def read_metrics(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in METRICS}


def make_request(rng: random.Random, model: str, max_tokens: int) -> tuple[str, str, dict]:
    kind = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]
    if kind == "bad":
        path, body = rng.choice(BAD_BODIES)
        return kind, path, body
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
    body: dict = {"model": model, "max_tokens": rng.randint(8, max_tokens), "temperature": 0.8,
                  "seed": rng.randrange(2**31)}
    if kind.endswith("stream") or kind == "disconnect":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind.startswith("chat"):
        return kind, "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return kind, "/v1/completions", body | {"prompt": prompt}


async def send(http: httpx.AsyncClient, kind: str, path: str, body: dict) -> str:
    """The outcome of one request (see Record.outcome)."""
    if not body.get("stream"):
        r = await http.post(path, json=body)
        if kind == "bad":
            return "400" if r.status_code == 400 else f"bad answered {r.status_code}"
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        return "ok" if r.json()["choices"][0]["finish_reason"] in ("stop", "length") else "incomplete"
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        events, finish, done = 0, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return "in-band error"
            events += 1
            if kind == "disconnect" and events >= 3:
                return "disconnected"  # leaving the block closes the connection mid-stream
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
        return "ok" if done and finish in ("stop", "length") else "incomplete"


async def traffic(args: argparse.Namespace, http: httpx.AsyncClient, model: str, t0: float,
                  records: list[Record]) -> None:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.max_in_flight)
    tasks: set[asyncio.Task] = set()

    async def one(kind: str, path: str, body: dict) -> None:
        start = time.perf_counter()
        try:
            outcome = await send(http, kind, path, body)
        except httpx.TimeoutException:
            outcome = "client timeout"
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        finally:
            gate.release()
        records.append(Record(kind, outcome, time.perf_counter() - start, start - t0))

    deadline = t0 + args.minutes * 60
    while time.perf_counter() < deadline:
        await gate.acquire()
        task = asyncio.create_task(one(*make_request(rng, model, args.max_tokens)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)


async def sampler(args: argparse.Namespace, http: httpx.AsyncClient, pids: tuple[Optional[int], Optional[int]],
                  t0: float, records: list[Record], samples: list[Sample], stop: asyncio.Event) -> None:
    while True:
        m = await read_metrics(http)
        samples.append(Sample(time.perf_counter() - t0, rss_mib(pids[0]), rss_mib(pids[1]),
                              m["octavo:kv_free_blocks"], m["octavo:kv_total_blocks"],
                              m["octavo:num_requests_running"], m["octavo:num_requests_waiting"], len(records)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), args.sample_every)
            return


async def wait_idle(http: httpx.AsyncClient, timeout_s: float) -> dict[str, float]:
    """Metrics once nothing runs; the last reading if that never happens."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await read_metrics(http)
        idle = m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
        if (idle and m["octavo:kv_free_blocks"] == m["octavo:kv_total_blocks"]) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


def drift_mib_per_min(samples: list[Sample], attr: str, from_s: float) -> Optional[float]:
    """Least-squares slope of one RSS series from `from_s` on, in MiB per minute."""
    points = [(s.at_s / 60, getattr(s, attr)) for s in samples if s.at_s >= from_s and getattr(s, attr) is not None]
    if len(points) < 3:
        return None
    return statistics.linear_regression([p[0] for p in points], [p[1] for p in points]).slope


def summarize(args: argparse.Namespace, records: list[Record], samples: list[Sample], final: dict) -> dict:
    processes = {}
    for name, attr in (("front", "front_rss_mib"), ("engine", "engine_rss_mib")):
        series = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        after_warmup = [getattr(s, attr) for s in samples if s.at_s >= args.warmup_s and getattr(s, attr) is not None]
        if series:
            processes[name] = {"rss_start_mib": series[0], "rss_after_warmup_mib": after_warmup[0] if after_warmup else None,
                               "rss_end_mib": series[-1], "rss_max_mib": max(series),
                               "drift_mib_per_min": drift_mib_per_min(samples, attr, args.warmup_s),
                               # Warm-up growth slows down, a leak does not: compare with the whole fit.
                               "drift_second_half_mib_per_min": drift_mib_per_min(samples, attr, samples[-1].at_s / 2)}
    outcomes = Counter((r.kind, r.outcome) for r in records)
    expected = {"ok", "disconnected", "400"}
    by_kind = {}
    for kind, _ in MIX:
        mine = [r for r in records if r.kind == kind]
        good = [r.latency_s for r in mine if r.outcome in expected]
        by_kind[kind] = {"requests": len(mine), "expected": len(good), "latency_s": latency_summary(good)}
    return {
        "requests": len(records),
        "unexpected": {f"{k}: {o}": n for (k, o), n in sorted(outcomes.items()) if o not in expected},
        "by_kind": by_kind,
        "processes": processes,
        "kv_free_min": min(s.kv_free_blocks for s in samples),
        "kv_total": samples[-1].kv_total_blocks,
        "after_idle": final,
        "kv_leaked_blocks": final["octavo:kv_total_blocks"] - final["octavo:kv_free_blocks"],
    }


def print_summary(summary: dict, args: argparse.Namespace, load: str) -> None:
    print_table([{"process": name, **p} for name, p in summary["processes"].items()],
                ["process", "rss_start_mib", "rss_after_warmup_mib", "rss_end_mib", "rss_max_mib", "drift_mib_per_min",
                 "drift_second_half_mib_per_min"],
                title=f"memory over {args.minutes:g} min (drift: least squares after the first {args.warmup_s:g} s, "
                      "and over the second half)")
    rows = [{"kind": k, "requests": v["requests"], "as_expected": v["expected"],
             "p50_s": v["latency_s"].get("p50"), "p99_s": v["latency_s"].get("p99")}
            for k, v in summary["by_kind"].items()]
    print_table(rows, ["kind", "requests", "as_expected", "p50_s", "p99_s"], title="requests")
    print(f"unexpected outcomes: {summary['unexpected'] or 'none'}")
    print(f"KV blocks: min free {summary['kv_free_min']:.0f} of {summary['kv_total']:.0f}; "
          f"taken after the traffic stopped: {summary['kv_leaked_blocks']:.0f}")
    print(f"load (1/5/15 min) before -> after: {load}")


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[tuple[str, Optional[int]]]:
    """(base URL, server PID): the given server, or one started here and stopped after."""
    if args.url:
        yield args.url.rstrip("/"), args.server_pid
        return
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", *([str(args.model)] if args.model else []),
           "--port", str(args.port), "--log-level", "warning", *shlex.split(args.serve_args)]
    print(f"starting: {' '.join(cmd)}", flush=True)
    base_url = f"http://127.0.0.1:{args.port}"
    with running_server(cmd, base_url, args.log, args.ready_timeout, args.threads) as proc:
        yield base_url, proc.pid


async def soak(args: argparse.Namespace, base_url: str, server_pid: Optional[int]) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pids = (server_pid, engine_pid(server_pid) if server_pid else None)
    limits = httpx.Limits(max_connections=args.max_in_flight + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        records: list[Record] = []
        samples: list[Sample] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampling = asyncio.create_task(sampler(args, http, pids, t0, records, samples, stop))
        await traffic(args, http, model, t0, records)
        final = await wait_idle(http, 60)
        stop.set()
        await sampling
        samples.append(Sample(time.perf_counter() - t0, rss_mib(pids[0]), rss_mib(pids[1]),
                              final["octavo:kv_free_blocks"], final["octavo:kv_total_blocks"],
                              final["octavo:num_requests_running"], final["octavo:num_requests_waiting"], len(records)))
    return {"summary": summarize(args, records, samples, final), "samples": [asdict(s) for s in samples],
            "pids": {"front": pids[0], "engine": pids[1]}}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start `octavo serve` here)")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's PID, for the RSS samples")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", type=Path, default=None, help="model folder to serve (default: the built-in one)")
    parser.add_argument("--serve-args", default="", help="extra `octavo serve` options, one string")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of a server started here")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--log", type=Path, default=Path(__file__).resolve().parent / "results" / "soak-server.log")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--max-in-flight", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="each request asks for 8..this many tokens")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="left out of the drift fit")
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load = load_avg()
    with target(args) as (base_url, server_pid):
        result = asyncio.run(soak(args, base_url, server_pid))
    load = f"{load} -> {load_avg()}"
    print_summary(result["summary"], args, load)
    write_json(args.json, {"benchmark": "soak", "args": vars(args), "load_before_after": load, **result})
    return result


if __name__ == "__main__":
    main()
