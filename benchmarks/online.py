"""Online serving: `octavo serve` vs llama.cpp's llama-server, same client, same rates.

    python -m benchmarks.online --model benchmarks/models/llama-100m \\
        --llama-server /path/to/llama-server --scenarios c32,r2

Each server is started, measured by benchmarks/serve.py (streaming
/v1/completions, seeded random-word prompts, ignore_eos so every request
produces --output-len tokens) for every scenario, then stopped:
- ``cN``: N requests in flight at all times (closed loop, all queued at t=0);
- ``rX``: Poisson arrivals at X requests/s.
llama-server runs with --parallel slots (continuous batching across them) and
a context of slots * per-request length, the same number of concurrent
sequences Octavo may batch (--max-num-seqs).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks import serve
from benchmarks.options import DEFAULT_MODEL
from benchmarks.peers.llamacpp import gguf_path
from benchmarks.report import load_avg, print_table, write_json


@dataclass(frozen=True)
class Scenario:
    name: str
    rate: float
    concurrency: int | None

    @classmethod
    def parse(cls, text: str) -> Scenario:
        if text.startswith("c") and text[1:].isdigit():
            return cls(text, math.inf, int(text[1:]))
        if text.startswith("r"):
            return cls(text, float(text[1:]), None)
        raise ValueError(f"--scenarios: {text!r} is neither cN (concurrency) nor rX (requests/s)")


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, ready_path: str = "/v1/models") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}{ready_path}", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"server at {base_url} not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def running_server(
    cmd: list[str], base_url: str, log: Path, timeout_s: float, threads: int, ready_path: str = "/v1/models"
) -> Iterator[subprocess.Popen]:
    """Start ``cmd``, wait for ``ready_path`` to answer 200, and always stop it (its whole process group)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    # torch sizes its thread pool from OMP_NUM_THREADS; llama-server gets -t.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            wait_ready(base_url, proc, timeout_s, ready_path)
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def octavo_cmd(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(args.model), "--port", str(port),
            "--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
            "--kv-cache-memory", str(args.kv_cache_memory_bytes), "--log-level", "warning"]


def llamacpp_cmd(args: argparse.Namespace, port: int) -> list[str]:
    per_request = args.input_len * 4 + args.output_len + 64  # generous: words become several tokens
    return [args.llama_server, "-m", str(gguf_path(args.model)), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(args.max_num_seqs),
            "-c", str(args.max_num_seqs * per_request), "--cont-batching", "--alias", args.model.name]


def measure(args: argparse.Namespace, base_url: str, scenario: Scenario, json_out: Path) -> dict:
    argv = ["--base-url", base_url, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(args.seed),
            "--request-rate", str(scenario.rate), "--json", str(json_out)]
    if scenario.concurrency:
        argv += ["--max-concurrency", str(scenario.concurrency)]
    load = load_avg()
    rep = serve.main(argv)
    rep["load_before_after"] = f"{load} -> {load_avg()}"
    return rep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where Octavo runs (llama-server: CPU)")
    parser.add_argument("--servers", default="octavo,llamacpp")
    parser.add_argument("--scenarios", default="c32,r2", help="comma-separated cN / rX")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64, help="words per prompt (serve.py)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="Octavo's batch limit = llama-server's slots")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 2**30)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                        help="llama.cpp's server binary (default: $LLAMA_SERVER or llama-server on PATH)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results" / "online")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    scenarios = [Scenario.parse(s) for s in args.scenarios.split(",") if s]
    servers = [s for s in args.servers.split(",") if s]
    commands = {"octavo": octavo_cmd, "llamacpp": llamacpp_cmd}
    for name in servers:
        if name not in commands:
            raise ValueError(f"--servers: unknown server {name!r}; choose from octavo, llamacpp")
    if "llamacpp" in servers and not args.llama_server:
        raise ValueError("--llama-server is required for the llamacpp server (or set $LLAMA_SERVER)")

    base_url = f"http://127.0.0.1:{args.port}"
    reports: dict[str, dict[str, dict]] = {}
    for name in servers:
        cmd = commands[name](args, args.port)
        print(f"starting {name}: {' '.join(cmd)}", flush=True)
        with running_server(cmd, base_url, args.out_dir / f"{name}.log", args.ready_timeout, args.threads):
            serve.main(["--base-url", base_url, "--num-prompts", "2", "--output-len", "4", "--ignore-eos"])  # warm-up
            reports[name] = {sc.name: measure(args, base_url, sc, args.out_dir / f"{name}-{sc.name}.json")
                             for sc in scenarios}

    rows = []
    for name, by_scenario in reports.items():
        for sc_name, rep in by_scenario.items():
            rows.append({"server": name, "scenario": sc_name, "ok": f"{rep['successful']}/{rep['num_requests']}",
                         "out_tok_s": rep["output_token_throughput"], "req_s": rep["request_throughput"],
                         "ttft_p50_ms": rep["ttft_s"].get("p50", math.nan) * 1000,
                         "tpot_p50_ms": rep["tpot_s"].get("p50", math.nan) * 1000,
                         "e2e_p99_s": rep["e2e_s"].get("p99", math.nan), "load": rep["load_before_after"]})
    print_table(rows, ["server", "scenario", "ok", "out_tok_s", "req_s", "ttft_p50_ms", "tpot_p50_ms", "e2e_p99_s",
                       "load"], title=f"online serving, {args.model.name}")
    ratios = {}
    if {"octavo", "llamacpp"} <= reports.keys():
        for sc in scenarios:
            ratios[f"octavo/llamacpp {sc.name}"] = (reports["octavo"][sc.name]["output_token_throughput"]
                                                   / reports["llamacpp"][sc.name]["output_token_throughput"])
            print(f"octavo/llamacpp output tok/s at {sc.name}: {ratios[f'octavo/llamacpp {sc.name}']:.2f}x")
    write_json(args.json, {"benchmark": "online", "args": vars(args), "reports": reports, "ratios": ratios})


if __name__ == "__main__":
    main()
