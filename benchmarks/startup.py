"""Time from `octavo serve` to its first answered request, cold and warm, in turns in one run.

Cold: an empty Octavo cache (kernels compiled, the linear table measured), the default model
copied in beforehand so that the download (network-bound) is timed on its own, once. Warm: the same
cache again. Each round runs one cold and one warm start; the median and spread of each are printed.

    python benchmarks/startup.py [--rounds 3] [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from octavo.assets.default_model import SMOLLM2, cache_dir, fetch

CHAT = {"model": SMOLLM2.name, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as response:
        return json.loads(response.read())


def time_start(cache: Path, model: str) -> tuple[float, float]:
    """(seconds until /health answers, seconds until the first chat answer), from the process start."""
    port = _free_port()
    env = {**os.environ, "OCTAVO_CACHE_DIR": str(cache)}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "octavo.entrypoints.cli", "serve", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"octavo serve exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        healthy = time.monotonic() - started
        _post(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT)
        return healthy, time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=SMOLLM2.name)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        fetched = time.monotonic()
        model_file = fetch(SMOLLM2, Path(scratch) / "download")
        print(f"default model download + check: {time.monotonic() - fetched:.1f} s (once)")
        times: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
        for round_ in range(args.rounds):
            cache = Path(scratch) / f"cache-{round_}"
            shutil.copytree(model_file.parent, cache / "models" / SMOLLM2.name)
            times["cold"].append(time_start(cache, args.model))
            times["warm"].append(time_start(cache, args.model))
            print(f"round {round_ + 1}: cold {times['cold'][-1][1]:.1f} s, warm {times['warm'][-1][1]:.1f} s")
    load = os.getloadavg()[0]
    for kind, runs in times.items():
        healthy = [h for h, _ in runs]
        answered = [a for _, a in runs]
        print(f"{kind}: healthy {statistics.median(healthy):.1f} s (range {min(healthy):.1f}-{max(healthy):.1f}), "
              f"first answer {statistics.median(answered):.1f} s (range {min(answered):.1f}-{max(answered):.1f})")
    print(f"load average at the end: {load:.2f}; cache root in use by default: {cache_dir()}")


if __name__ == "__main__":
    main()
