"""`octavo gateway` under hostile requests: what a huge body, a huge header, a
slow upload and deeply nested JSON cost the gateway, and how soon it answers.

    python -m benchmarks.gateway_hostile [--body-mib 200] [--header-mib 64] [--body-timeout-s 3]

One gateway in front of the trivial upstream of benchmarks/gateway.py. For
each case, in this order: the status the client gets (0: none), the seconds
until it gets it, and the growth of the gateway's peak resident memory
(VmHWM, Linux) over the case (a later case shows only growth past the peaks
of the earlier ones).
Bodies are sent chunked (no Content-Length: the gateway cannot refuse up front)
and, for the body case, also with the Content-Length declared.
"""
from __future__ import annotations

import argparse
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from benchmarks.gateway import _serve_trivial_upstream, free_port
from benchmarks.online import running_server
from benchmarks.report import print_table, write_json

_MIB = 2**20


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc: Linux only")


def _exchange(port: int, pieces: Iterator[bytes], pause_s: float = 0.0, wait_s: float = 60.0) -> int:
    """Sends ``pieces`` (``pause_s`` apart) until the gateway answers; returns
    its status, 0 for none within ``wait_s`` after the last piece."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(pause_s or 0.0)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # answered before the request was whole
            except (BlockingIOError, TimeoutError, socket.timeout):
                pass
            finally:
                sock.settimeout(wait_s)
        try:
            answer = sock.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            return 0
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def _chunked(head: bytes, total: int, piece: int = _MIB) -> Iterator[bytes]:
    yield head + b"Transfer-Encoding: chunked\r\n\r\n"
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        yield b"%x\r\n" % n + b"x" * n + b"\r\n"
        sent += n
    yield b"0\r\n\r\n"


def cases(args: argparse.Namespace) -> list[tuple[str, Callable[[], Iterator[bytes]], float]]:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    body = args.body_mib * _MIB
    deep = b'{"prompt": ' + b"[" * args.depth + b"]" * args.depth + b"}"
    return [
        (f"{args.body_mib} MiB body, chunked", lambda: _chunked(head, body), 0.0),
        (f"{args.body_mib} MiB body, Content-Length", lambda: iter([head + b"Content-Length: %d\r\n\r\n" % body]
                                                                    + [b"x" * _MIB] * args.body_mib), 0.0),
        (f"{args.header_mib} MiB header", lambda: iter([head + b"x-big: "] + [b"a" * _MIB] * args.header_mib
                                                        + [b"\r\nContent-Length: 2\r\n\r\n{}"]), 0.0),
        ("slow upload, 1 byte / 2 s", lambda: iter([head + b"Content-Length: 64\r\n\r\n"] + [b" "] * 64), 2.0),
        (f"JSON {args.depth} deep", lambda: iter([head + b"Content-Length: %d\r\n\r\n" % len(deep) + deep]), 0.0),
    ]


def run(args: argparse.Namespace) -> list[dict]:
    up_port, port = free_port(), free_port()
    upstream = multiprocessing.Process(target=_serve_trivial_upstream, args=(up_port,), daemon=True)
    upstream.start()
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "gateway", "--replica", f"http://127.0.0.1:{up_port}",
           "--port", str(port), "--no-cache", "--log-level", "warning", "--body-timeout-s", str(args.body_timeout_s)]
    logs = Path(tempfile.mkdtemp(prefix="gw-hostile-"))
    rows = []
    try:
        with running_server(cmd, f"http://127.0.0.1:{port}", logs / "gateway.log", 60, 1) as proc:
            for name, pieces, pause_s in cases(args):
                before = _peak_rss_mib(proc.pid)
                start = time.perf_counter()
                status = _exchange(port, pieces(), pause_s)
                rows.append({"case": name, "status": status, "answered_s": time.perf_counter() - start,
                             "peak_rss_growth_mib": _peak_rss_mib(proc.pid) - before})
            still = _exchange(port, iter([b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"]))
            rows.append({"case": "/health afterwards", "status": still, "answered_s": None,
                         "peak_rss_growth_mib": None})
    finally:
        upstream.terminate()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--body-mib", type=int, default=200)
    p.add_argument("--header-mib", type=int, default=64)
    p.add_argument("--depth", type=int, default=100_000, help="nesting of the deep JSON body")
    p.add_argument("--body-timeout-s", type=float, default=3.0, help="the gateway's --body-timeout-s")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    rows = run(args)
    print_table(rows, ["case", "status", "answered_s", "peak_rss_growth_mib"], "octavo gateway, hostile requests")
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
