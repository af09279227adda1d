"""The README's first command, run as a newcomer runs it, then each optional extra's own command.

Each check gets a fresh venv with nothing but what its install line brings (no test extras) and an
empty Octavo cache, so a missing dependency, a broken default-model fetch or a cold start that never
opens the port fails here. Servers listen on free ports of 127.0.0.1 and are stopped by PID.

    python .ci/newcomer.py [--only base|gateway|simulate|autoscale|ray ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
CHECKS = ("base", "gateway", "simulate", "autoscale", "ray")


def readme_first_command() -> tuple[str, str]:
    """(install, serve) of the README's first command line, ``pip install ... && octavo serve``."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    if block is None:
        raise SystemExit("README.md has no bash block")
    line = block.group(1).splitlines()[0].split(" # ")[0].strip()
    install, _, serve = line.rpartition("&&")
    if serve.strip() != "octavo serve" or "pip install" not in install:
        raise SystemExit(f"README's first command is not 'pip install ... && octavo serve': {line!r}")
    return install.strip(), serve.strip()


class Venv:
    def __init__(self, where: Path, cache: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        self.bin = where / "bin"
        self.env = {**os.environ, "VIRTUAL_ENV": str(where), "PATH": f"{self.bin}:{os.environ['PATH']}",
                    "OCTAVO_CACHE_DIR": str(cache)}
        for name in ("PYTHONPATH", "OCTAVO_OFFLINE", "HF_HUB_OFFLINE"):
            self.env.pop(name, None)

    def sh(self, command: str, timeout: float = 1200) -> None:
        """Run ``command``; an installer's output is shown only when it fails."""
        print(f"$ {command}", flush=True)
        started = time.monotonic()
        quiet = "pip install" in command
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=self.env, timeout=timeout, text=True,
                                capture_output=quiet)
        if result.returncode != 0:
            raise SystemExit(f"failed ({result.returncode}): {command}\n{(result.stdout or '')[-3000:]}"
                             f"{(result.stderr or '')[-3000:]}")
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)

    def start(self, command: str, log: Path) -> subprocess.Popen:
        print(f"$ {command} &  (log: {log})", flush=True)
        return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=self.env, start_new_session=True,
                                stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: Optional[dict[str, Any]] = None, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: exited with {proc.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            if request(f"{url}/health", timeout=2)[0] == 200:
                return time.monotonic() - started
        except (urllib.error.URLError, OSError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_answers(url: str) -> None:
    """One completion and one chat, each checked: the default model itself answers."""
    status, models = request(f"{url}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL], models
    status, done = request(f"{url}/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                      "max_tokens": 8, "temperature": 0})
    assert status == 200 and done["choices"][0]["text"].strip(), done
    status, chat = request(f"{url}/v1/chat/completions", {
        "model": MODEL, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    answer = chat["choices"][0]["message"]["content"] if status == 200 else chat
    assert status == 200 and "Paris" in answer, answer
    print(f"  completion: {done['choices'][0]['text']!r}; chat: {answer!r}", flush=True)


def check_base(work: Path) -> tuple[str, subprocess.Popen]:
    """README's first command in a fresh venv, cold cache; leaves the server running for the gateway check."""
    install, serve = readme_first_command()
    venv = Venv(work / "base", work / "cache")
    port = free_port()
    venv.sh(install)
    log = work / "serve.log"
    proc = venv.start(f"{serve} --port {port}", log)
    url = f"http://127.0.0.1:{port}"
    try:
        seconds = wait_healthy(url, proc, log, timeout_s=900)
        print(f"  cold first start (default model fetched, kernels built): healthy after {seconds:.0f} s")
        check_answers(url)
    except BaseException:
        stop(proc)
        raise
    return url, proc


def check_gateway(work: Path, replica: str) -> None:
    venv = Venv(work / "gateway", work / "cache")
    venv.sh("pip install -e '.[gateway]'")
    port = free_port()
    log = work / "gateway.log"
    proc = venv.start(f"octavo gateway --replica {replica} --port {port}", log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout_s=120)
        check_answers(f"http://127.0.0.1:{port}")
    finally:
        stop(proc)


def check_simulate(work: Path) -> None:
    venv = Venv(work / "simulate", work / "cache")
    venv.sh("pip install -e '.[simulate]'")
    cost, summary, plot = work / "cost.json", work / "summary.json", work / "sim.png"
    venv.sh(f"OMP_NUM_THREADS=1 octavo simulate calibrate octavo-mini --max-batch 4 --repeats 1 -o {cost}")
    venv.sh(f"octavo simulate run --cost-model {cost} --trace poisson --rate 2 --duration 60 "
            f"--summary {summary} --plot {plot}")
    assert json.loads(summary.read_text()) and plot.stat().st_size > 0


def check_autoscale(work: Path) -> None:
    venv = Venv(work / "autoscale", work / "cache")
    venv.sh("pip install -e '.[autoscale]'")
    venv.sh("octavo autoscale --help > /dev/null")
    venv.sh("python -c 'import statsmodels.tsa.holtwinters, kubernetes.client'")


def check_ray(work: Path) -> None:
    venv = Venv(work / "ray", work / "cache")
    venv.sh("pip install -e '.[ray]'")
    venv.sh("octavo generate octavo-mini --distributed-executor-backend ray --prompt 'def add(a, b):' "
            "--max-tokens 8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="octavo-newcomer-") as scratch:
        work = Path(scratch)
        server = None
        try:
            if "base" in args.only or "gateway" in args.only:
                server = check_base(work)
            if "gateway" in args.only:
                check_gateway(work, server[0])
        finally:
            if server is not None:
                stop(server[1])
        for name, check in (("simulate", check_simulate), ("autoscale", check_autoscale), ("ray", check_ray)):
            if name in args.only:
                print(f"== extra: {name}", flush=True)
                check(work)
    print("newcomer checks passed:", ", ".join(args.only))


if __name__ == "__main__":
    main()
