"""One benchmark peer in a process of its own, loaded once and driven from the parent.

Peers loaded side by side in one process cost each other: their weights share the caches and the allocator,
and two runtimes' thread pools (torch's and llama.cpp's OpenMP) wait beside each other. A ``PeerProcess``
builds its peer in a spawned process (a fresh interpreter: nothing of the parent's state is inherited) with
``threads`` torch threads; the parent then calls the peer's methods over a pipe, one peer at a time, and the
child times each call itself (wall and CPU seconds around the call alone, the pipe's messages outside). An
idle child blocks reading its pipe. Each runtime keeps the OpenMP wait policy its users run it with: libgomp's
default spins a moment after a parallel region, then sleeps, so an idle child's threads leave the cores within
about a millisecond of its call. Forced to wait passively, every peer of moe.py ran 1.2-1.45x slower at batch 1
on a 2-core Zen 4 VM (Octavo's kernels and llama.cpp's graph alike wake their threads for each parallel region),
their ratios within the same spread: figures no user sees.
"""
from __future__ import annotations

import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

_CLOSE, _MEMORY = "close", "memory"


class PeerError(RuntimeError):
    """A peer failed in its process (or the process died); the message names the peer."""


def rss_mib(field: str) -> float:
    """This process's resident memory now (``VmRSS``) or at its peak (``VmHWM``, the high-water mark of this
    process image alone: ru_maxrss would also count the parent's peak, which Linux carries across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _serve(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...], threads: int) -> None:
    """The child: build the peer, then answer ``(method, args)`` messages until ``close``. Each answer is
    ``("ok", (wall s, CPU s, result))`` or ``("error", traceback)``."""
    import torch

    torch.set_num_threads(threads)
    try:
        peer = factory(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        method, call_args = conn.recv()
        if method == _CLOSE:
            close = getattr(peer, "close", None)
            if close is not None:
                close()
            conn.send(("ok", None))
            return
        if method == _MEMORY:
            conn.send(("ok", (0.0, 0.0, {"rss_mib": rss_mib("VmRSS"), "peak_rss_mib": rss_mib("VmHWM")})))
            continue
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            result = getattr(peer, method)(*call_args)
            reply = (time.perf_counter() - wall, time.process_time() - cpu, result)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", reply))


class PeerProcess:
    """``factory(*args)`` built in a spawned process named ``name``; its methods called with ``call``."""

    def __init__(self, name: str, factory: Callable[..., Any], *args: Any, threads: int) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, factory, args, threads), name=name, daemon=True)
        self._process.start()
        child.close()
        self._answer()  # the peer is loaded, or its error raised here

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._process.join()
            raise PeerError(f"{self.name}: its process ended (exit code {self._process.exitcode})") from None
        if status == "error":
            raise PeerError(f"{self.name}: {value}")
        return value

    def timed(self, method: str, *args: Any) -> tuple[float, float]:
        """Run ``method(*args)`` in the peer: (wall s, CPU s) measured in its process."""
        self._conn.send((method, args))
        wall, cpu, _ = self._answer()
        return wall, cpu

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)``'s result, which must pickle."""
        self._conn.send((method, args))
        return self._answer()[2]

    def memory(self) -> dict[str, float]:
        """The process's resident MiB now (``rss_mib``) and at its peak so far (``peak_rss_mib``)."""
        return self.call(_MEMORY)

    def close(self) -> None:
        """Close the peer (its ``close`` method, if it has one) and end its process."""
        self._conn.send((_CLOSE, ()))
        self._answer()
        self._process.join()
        self._conn.close()

    def kill(self) -> None:
        """End the process without asking (after an error elsewhere)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._conn.close()
