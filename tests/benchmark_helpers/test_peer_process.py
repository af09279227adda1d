"""A peer in a process of its own (benchmarks/peer_process.py): built in the child with the threads asked,
answering calls with its results and its own timings, its errors raised in the parent under its name, and
ended cleanly."""
from __future__ import annotations

import os
import time
from typing import Optional

import pytest

from benchmarks.peer_process import PeerError, PeerProcess


class Counter:
    """A dummy peer: state kept across calls, a sleep to time, a failure, a death."""

    def __init__(self, start: int) -> None:
        if start < 0:
            raise ValueError(f"start {start} is negative")
        self.count = start

    def add(self, n: int) -> int:
        self.count += n
        return self.count

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def spin(self, seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def settings(self) -> tuple[int, Optional[str], int]:
        import torch

        return torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"), os.getpid()

    def allocate(self, mib: int) -> None:
        self.held = bytearray(mib * 2**20)  # zero pages: resident once written
        self.held[::4096] = b"\1" * len(self.held[::4096])

    def fail(self) -> None:
        raise KeyError("no such token")

    def die(self) -> None:
        os._exit(3)


def test_peer_answers_times_itself_reports_errors_and_closes():
    peer = PeerProcess("counter", Counter, 5, threads=1)
    try:
        assert peer.call("add", 2) == 7
        assert peer.call("add", 3) == 10  # the peer is built once and keeps its state
        threads, policy, pid = peer.call("settings")
        # Its torch threads as asked; the OpenMP wait policy as the environment has it (none forced).
        assert (threads, policy) == (1, os.environ.get("OMP_WAIT_POLICY")) and pid != os.getpid()
        wall, cpu = peer.timed("sleep", 0.2)
        assert wall >= 0.2 and cpu < 0.1  # wall and CPU time of the call, measured in the child
        wall, cpu = peer.timed("spin", 0.2)
        assert cpu >= 0.2
        with pytest.raises(PeerError, match="(?s)counter:.*KeyError: 'no such token'"):
            peer.call("fail")
        assert peer.call("add", 1) == 11  # an error in one call leaves the peer serving
        memory = peer.memory()  # the child's own, read there
        peer.call("allocate", 64)
        assert peer.memory()["peak_rss_mib"] >= memory["rss_mib"] + 60
        peer.close()
        assert not peer._process.is_alive() and peer._process.exitcode == 0
    finally:
        peer.kill()


def test_peer_that_cannot_be_built_or_dies_is_named():
    with pytest.raises(PeerError, match="(?s)broken:.*start -1 is negative"):
        PeerProcess("broken", Counter, -1, threads=1)
    peer = PeerProcess("mortal", Counter, 0, threads=1)
    with pytest.raises(PeerError, match=r"mortal: its process ended \(exit code 3\)"):
        peer.call("die")
    peer.kill()
