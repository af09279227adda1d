"""Online serving benchmark against any OpenAI-compatible server (Octavo, vLLM, llama.cpp's llama-server).

Requests arrive as a Poisson process at --request-rate (inf: all at once), each
streamed over SSE; per request we record time to first token (TTFT), the gaps
between streamed chunks (ITL), time per output token after the first (TPOT)
and end-to-end latency, then report mean/P50/P90/P99 and throughputs.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    python benchmarks/serve.py --base-url http://127.0.0.1:8080 --endpoint chat --json out.json   # llama-server

Prompts are synthetic (seeded random words, about --input-len words each) or
lines of --prompts-file. --ignore-eos asks for exactly --output-len tokens
(an extension Octavo, vLLM and llama.cpp all accept).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you "
    "were her she there one all we their has been if more when will would who so no time can out up about into "
    "model token cache block request server engine batch memory attention layer value key query stream latency"
).split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    sent: float = 0.0  # perf_counter() when the request went out

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        with open(args.prompts_file) as f:
            lines = [line.strip() for line in f if line.strip()]
        return [lines[i % len(lines)] for i in range(args.num_prompts)]
    rng = random.Random(args.seed)
    return [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]


def request_body(args: argparse.Namespace, prompt: str) -> dict:
    body: dict = {
        "model": args.model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c["delta"] or {}).get("content") or ""
    return c.get("text") or ""


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    last = start
    result = Result(ok=False, sent=start)
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens") or 0
                    result.prompt_tokens = event["usage"].get("prompt_tokens") or 0
                if _chunk_text(event):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks  # servers without usage: one token per chunk
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        prompts = make_prompts(args)
        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def limited(body: dict) -> Result:
            async with gate:
                return await one_request(client, path, body)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(request_body(args, prompt))))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def write_trace(results: list[Result], path: str) -> None:
    """The successful requests as a recorded trace for `octavo simulate run --trace FILE.jsonl`
    (docs/SIMULATOR.md): send time from the first request, token counts from the server's usage."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.sent)
    t0 = min((r.sent for r in results), default=0.0)
    with open(path, "w") as f:
        for r in ok:
            f.write(json.dumps({"arrival_s": round(r.sent - t0, 6), "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens}) + "\n")


def latency_summary(values: list[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 of `values` (empty: {})."""
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), "p50": q[49], "p90": q[89], "p99": q[98]}


def report(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "successful": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": latency_summary([r.ttft for r in ok]),
        "tpot_s": latency_summary([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": latency_summary([x for r in ok for x in r.itl]),
        "e2e_s": latency_summary([r.e2e for r in ok]),
    }


def print_report(rep: dict) -> None:
    print(f"requests: {rep['successful']}/{rep['num_requests']} ok in {rep['duration_s']:.2f} s")
    for err in rep["errors"]:
        print(f"  error: {err}")
    print(f"request throughput:      {rep['request_throughput']:.2f} req/s")
    print(f"output token throughput: {rep['output_token_throughput']:.1f} tok/s")
    print(f"total token throughput:  {rep['total_token_throughput']:.1f} tok/s")
    print(f"{'ms':>8} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = rep[key]
        if s:
            print(f"{key[:-2].upper():>8} " + " ".join(f"{s[k] * 1000:9.2f}" for k in ("mean", "p50", "p90", "p99")))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OCTAVO_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=64, help="words per synthetic prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the report to this file")
    p.add_argument("--trace-out", default=None,
                   help="write the requests sent as a JSONL trace for `octavo simulate run --trace`")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    results, duration = asyncio.run(run(args))
    rep = report(results, duration)
    rep["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2, default=str)
    if args.trace_out:
        write_trace(results, args.trace_out)
    return rep


if __name__ == "__main__":
    main()
