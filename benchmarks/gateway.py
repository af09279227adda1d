"""`octavo gateway`: routing policies on a multi-tenant workload, and the gateway's own overhead.

    python -m benchmarks.gateway --model benchmarks/models/llama-100m --replicas 2

Part 1 (routing): ``--replicas`` `octavo serve` replicas (each publishing KV
events) and one `octavo gateway` per policy, all started once; ``--tenants``
system prompts of ``--system-len`` tokens (uniform in the range), each
request one tenant's system prompt plus a short unique question, Poisson
arrivals at ``--rate`` requests/s, streamed through the gateway. The policies
run in turns, ``--rounds`` rounds (the order reversed every other round), so
a machine whose load changes hits them alike. Every run has the same shape
(the round's prompt lengths, tenants and arrival gaps) but tokens of its own,
so nothing an earlier run left in the replicas' caches hits. Reported per
policy, as the median and min-max over rounds: TTFT p50/p99, their ratio to
round-robin's in the same round, and the replicas' prefix-cache hits as a
share of all prompt tokens looked up and of the shared-prefix tokens a cache
could hold (a tenant's system prompt, in whole blocks, from its second
request on).

Part 2 (overhead): a trivial upstream that answers every request with the same
small completion at once; the same client sends non-streaming /v1/completions
to it directly, through `octavo gateway`, through nginx (plain reverse proxy,
keep-alive upstream) and through LiteLLM's proxy. Added latency = p50/p99 at
concurrency 1 minus the direct one; max request rate at ``--concurrency``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from benchmarks.online import running_server
from benchmarks.report import load_avg, machine_info, print_table, write_json
from benchmarks.serve import latency_summary, one_request
from benchmarks.turns import fmt_spread, ratios, spread
from benchmarks.workload import ordinary_token_ids

POLICIES = ("round-robin", "least-load", "kv-aware")
_KEY = "sk-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- part 1: routing ---------------------------------------------------------------------------------------


BLOCK_SIZE = 16  # the replicas' KV cache block, which the kv-aware gateway hashes too


@dataclass
class Workload:
    """One run's requests: ``gaps[i]`` seconds after request i is sent comes request i + 1; ``reusable[i]``:
    the tokens of prompt i a cache could hold from earlier requests (its tenant's system prompt in whole blocks,
    0 for a tenant's first request)."""

    prompts: list[list[int]]
    gaps: list[float]
    reusable: list[int]


def tenant_workload(args: argparse.Namespace, vocab: list[int], round_: int, tokens_seed: int) -> Workload:
    """The round's shape (system prompt lengths, each request's tenant and question length, the gaps), with
    tokens drawn from ``tokens_seed``."""
    shape = random.Random(f"{args.seed}/{round_}")
    tokens = random.Random(f"{args.seed}/{round_}/{tokens_seed}")
    low, high = (int(x) for x in args.system_len.split(","))
    systems = [[tokens.choice(vocab) for _ in range(shape.randint(low, high))] for _ in range(args.tenants)]
    prompts, gaps, reusable, seen = [], [], [], set()
    for _ in range(args.num_requests):
        tenant = shape.randrange(args.tenants)
        prompts.append(systems[tenant] + [tokens.choice(vocab) for _ in range(shape.randint(16, 48))])
        gaps.append(shape.expovariate(args.rate))
        reusable.append(len(systems[tenant]) // BLOCK_SIZE * BLOCK_SIZE if tenant in seen else 0)
        seen.add(tenant)
    return Workload(prompts, gaps, reusable)


async def drive(url: str, work: Workload, args: argparse.Namespace) -> list:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks = []
        for prompt, gap in zip(work.prompts, work.gaps):
            body = {"model": args.model.name, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            tasks.append(asyncio.create_task(one_request(client, "/v1/completions", body)))
            await asyncio.sleep(gap)
        return await asyncio.gather(*tasks)


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("octavo:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("octavo:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def start_fleet(args: argparse.Namespace, policies: list[str], stack: contextlib.ExitStack,
                logs: Path) -> tuple[list[str], dict[str, str]]:
    """The replicas' URLs, and each policy's gateway URL."""
    urls, events = [], []
    for i in range(args.replicas):
        port, ev = free_port(), f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(args.model), "--port", str(port),
               "--dtype", "bfloat16", "--kv-cache-memory", args.kv_cache_memory, "--kv-events-endpoint", ev,
               "--block-size", str(BLOCK_SIZE), "--log-level", "warning"]
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(running_server(cmd, url, logs / f"replica{i}.log", 300, args.threads))
        urls.append(url)
        events.append(f"{url}={ev}")
    gateways = {}
    for policy in policies:
        port = free_port()
        cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "gateway", "--port", str(port), "--routing", policy,
               "--tokenizer", str(args.model), "--block-size", str(BLOCK_SIZE), "--no-cache", "--log-level",
               "warning"]
        cmd += [a for e in events for a in ("--kv-events", e)]
        gateways[policy] = f"http://127.0.0.1:{port}"
        stack.enter_context(running_server(cmd, gateways[policy], logs / f"{policy}-gateway.log", 120, 1))
    time.sleep(2)  # ZMQ subscriptions settle
    return urls, gateways


def run_once(args: argparse.Namespace, urls: list[str], gateway: str, work: Workload) -> dict:
    before = prefix_counters(urls)
    results = asyncio.run(drive(gateway, work, args))
    after = prefix_counters(urls)
    ok = [r for r in results if r.ok]
    ttft = latency_summary([r.ttft for r in ok])
    hits, queries = after[0] - before[0], after[1] - before[1]
    return {"ok": len(ok), "requests": len(results), "ttft_p50_ms": ttft["p50"] * 1000,
            "ttft_p99_ms": ttft["p99"] * 1000, "prefix_hit_rate": hits / queries if queries else 0.0,
            "shared_prefix_hit_rate": hits / max(1, sum(work.reusable))}


ROUTING_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "prefix_hit_rate", "shared_prefix_hit_rate")


def routing(args: argparse.Namespace, logs: Path) -> list[dict]:
    policies = args.policies.split(",")
    vocab = ordinary_token_ids(args.model)
    runs: dict[str, dict[str, list[float]]] = {p: {k: [] for k in (*ROUTING_FIGURES, "ok")} for p in policies}
    with contextlib.ExitStack() as stack:
        urls, gateways = start_fleet(args, policies, stack, logs)
        for round_ in range(args.rounds):
            for i, policy in sorted(enumerate(policies), key=lambda x: x[0] if round_ % 2 == 0 else -x[0]):
                row = run_once(args, urls, gateways[policy], tenant_workload(args, vocab, round_, i))
                print(json.dumps({"round": round_, "policy": policy, "load": load_avg(), **row}), flush=True)
                for k in ROUTING_FIGURES:
                    runs[policy][k].append(row[k])
                runs[policy]["ok"].append(row["ok"] / row["requests"])
    rows = []
    for policy in policies:
        row = {"policy": policy, "ok": min(runs[policy]["ok"]), **{k: spread(runs[policy][k]) for k in ROUTING_FIGURES}}
        if "round-robin" in runs:  # within each round
            for figure, name in (("ttft_p50_ms", "ttft_p50_vs_rr"), ("ttft_p99_ms", "ttft_p99_vs_rr")):
                row[name] = ratios(runs, figure, [policy], ["round-robin"])[0]["ratio"]
        rows.append(row)
    return rows


# ---- part 2: overhead ---------------------------------------------------------------------------------------

_BODY = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "tiny",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


async def _trivial_upstream(port: int) -> None:
    """HTTP/1.1 keep-alive, every request answered at once (/metrics: empty)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                body = b"" if head.startswith(b"GET /metrics") else _BODY
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _serve_trivial_upstream(port: int) -> None:
    asyncio.run(_trivial_upstream(port))


async def _load(url: str, n: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {_KEY}"}  # LiteLLM insists on a key; the others ignore it
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, headers=headers) as client:
        for _ in range(20):  # warm connections and caches
            (await client.post("/v1/completions", json=body)).raise_for_status()
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                start = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                latencies.append(time.perf_counter() - start)
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def _nginx_cmd(upstream: int, port: int, tmp: Path) -> list[str]:
    conf = tmp / "nginx.conf"
    conf.write_text(f"""daemon off; worker_processes 1; pid {tmp}/nginx.pid; error_log {tmp}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{ access_log off; client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream up {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{ listen 127.0.0.1:{port};
    location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}
""")
    return [shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf), "-p", str(tmp)]


def _litellm_cmd(upstream: int, port: int, tmp: Path) -> list[str]:
    conf = tmp / "litellm.yaml"
    conf.write_text(f"""model_list:
  - model_name: tiny
    litellm_params: {{model: openai/tiny, api_base: "http://127.0.0.1:{upstream}/v1", api_key: none}}
general_settings: {{master_key: {_KEY}}}
""")
    return [shutil.which("litellm") or "litellm", "--config", str(conf), "--port", str(port), "--num_workers", "1"]


def overhead(args: argparse.Namespace, logs: Path) -> list[dict]:
    up_port = free_port()
    upstream = multiprocessing.Process(target=_serve_trivial_upstream, args=(up_port,), daemon=True)
    upstream.start()
    time.sleep(0.5)
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the bundled price list
    fronts: list[tuple[str, Optional[list[str]], str]] = [("direct", None, f"http://127.0.0.1:{up_port}")]
    for name, make in (("octavo gateway", None), ("nginx", _nginx_cmd), ("litellm proxy", _litellm_cmd)):
        port = free_port()
        if make is None:
            cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "gateway", "--replica",
                   f"http://127.0.0.1:{up_port}", "--port", str(port), "--no-cache", "--routing", "round-robin",
                   "--log-level", "warning"]
        else:
            cmd = make(up_port, port, tmp)
        fronts.append((name, cmd, f"http://127.0.0.1:{port}"))
    rows = []
    try:
        for name, cmd, url in fronts:
            if cmd is None:
                rows.append(_measure(name, url, args))
                continue
            try:
                # LiteLLM's /v1/models wants the key: its liveness route says when it is up.
                ready = "/health/liveliness" if name.startswith("litellm") else "/v1/models"
                with running_server(cmd, url, logs / f"overhead-{name.split()[0]}.log", 240, 1, ready):
                    rows.append(_measure(name, url, args))
            except (RuntimeError, OSError, httpx.HTTPError) as exc:  # one peer failing must not lose the others
                print(f"{name}: {exc} (log in {logs})")
    finally:
        upstream.terminate()
    base = rows[0]
    for row in rows:
        row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
    return rows


def _measure(name: str, url: str, args: argparse.Namespace) -> dict:
    serial, _ = asyncio.run(_load(url, args.latency_requests, 1))
    _, duration = asyncio.run(_load(url, args.rate_requests, args.concurrency))
    q = statistics.quantiles(serial, n=100, method="inclusive")
    return {"front": name, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
            "max_rps": args.rate_requests / duration}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(__file__).resolve().parent / "models" / "llama-100m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-len", default="500,1000", help="LOW,HIGH tokens of each tenant's system prompt")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rounds", type=int, default=3, help="rounds of the policies in turns")
    p.add_argument("--latency-requests", type=int, default=500)
    p.add_argument("--rate-requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--skip", choices=["routing", "overhead"], default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/gateway.json"))
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="gw-bench-logs-"))
    out: dict = {"machine": machine_info(), "load_avg_before": load_avg(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.skip != "routing":
        rows = routing(args, logs)
        columns = ["policy", "ok", *ROUTING_FIGURES, "ttft_p50_vs_rr", "ttft_p99_vs_rr"]
        print_table([{c: fmt_spread(r[c]) if isinstance(r.get(c), dict) else r.get(c) for c in columns}
                     for r in rows], columns, f"routing: median (min-max) of {args.rounds} rounds")
        out["routing"] = rows
    if args.skip != "overhead":
        rows = overhead(args, logs)
        gw = next(r for r in rows if r["front"] == "octavo gateway")  # octavo's own front must run
        for row in rows:
            row["gateway_rps_ratio"] = gw["max_rps"] / row["max_rps"]
        print_table(rows, ["front", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "max_rps",
                           "gateway_rps_ratio"], "overhead")
        out["overhead"] = rows
    out["load_avg_after"] = load_avg()
    print(f"logs: {logs}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
