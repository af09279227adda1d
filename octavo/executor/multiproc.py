"""The multi-process executor: one worker process per rank on this machine.

Ranks join one torch.distributed world (gloo on CPU, NCCL on CUDA) for the
model's collectives; the engine is not a rank. Each step is pickled ONCE and
the same bytes are pushed to every rank over ZMQ ``ipc://`` sockets (a PUSH
socket per rank: no subscription handshake to lose the first message to, and
still one serialization). The driver (tensor rank 0 of the last pipeline
stage, which has the logits) samples and sends the step's result back; the
others reply only when they fail.

Pipeline parallelism: up to ``pipeline_parallel_size`` steps are in flight
(``submit`` without waiting, ``collect`` in order), so that while the last
stage works on step N the first already works on step N + 1; every stage
sees the steps in the same order, which keeps each rank's KV writes and
per-request state in step order.

Failure: while it waits, the executor checks every 200 ms that each rank's
process lives, so the engine fails within seconds instead of hanging in a
collective. A rank that raises sends its error, which is raised here with the
rank's traceback (a ValueError stays one). A failure's cause is picked once
the ranks have had a moment to report: a rank that exits after a failed start
may be seen dead before its report is read, so a death waits up to 3 s for
that report; a rank that died without one (killed, OOM) is the cause, named
with its exit status, over the errors its peers' collectives then raise.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import zmq

import octavo
from octavo.config import EngineConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.executor.base import Executor, ExecutorError
from octavo.executor.placement import place_ranks
from octavo.executor.worker_proc import InitArgs, WorkerFailure
from octavo.log import LOG_LEVEL_ENV, current_level

logger = logging.getLogger(__name__)

_POLL_MS = 200
_DEATH_GRACE_S = 1.0  # how long a rank's error waits for news of a dead peer or of other errors
_REPORT_GRACE_S = 3.0  # how long a dead rank's error report may still be on its way
STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint per rank takes a while


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        world = config.parallel.world_size
        self._driver = world - config.parallel.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="octavo-ranks-")
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        result_addr = f"ipc://{self._dir.name}/results"
        self._results.bind(result_addr)
        self._to_rank: list[zmq.Socket] = []
        self._procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        # The ranks import this very octavo, wherever it was imported from.
        root = str(Path(octavo.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env[LOG_LEVEL_ENV] = str(current_level())
        for rank in range(world):
            sock = self._ctx.socket(zmq.PUSH)
            addr = f"ipc://{self._dir.name}/rank{rank}"
            sock.bind(addr)
            self._to_rank.append(sock)
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "octavo.executor.worker_proc", str(rank), addr, result_addr], env=env
            ))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._to_rank, self._results, self._ctx, self._dir)
        try:
            init = InitArgs(config, f"tcp://127.0.0.1:{_free_port()}", place_ranks(world, config.parallel.threads_per_worker))
            self._broadcast(("init", init))
            self._collect(set(range(world)), "ready", STARTUP_TIMEOUT_S)
            (self.model_info,) = self.collective_rpc("model_info", ranks=[0])
        except BaseException:
            self.shutdown()
            raise

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("num_kv_blocks"))

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast(("step", scheduler_output))

    def collect(self) -> ModelRunnerOutput:
        return self._collect({self._driver}, "ok")[self._driver]

    def collective_rpc(self, method: str, args: tuple = (), ranks: Optional[list[int]] = None) -> list[Any]:
        ranks = list(range(len(self._procs))) if ranks is None else ranks
        self._broadcast(("rpc", method, tuple(args)), ranks)
        results = self._collect(set(ranks), "ok")
        return [results[r] for r in ranks]

    def check_health(self) -> None:
        if any(proc.poll() is not None for proc in self._procs):
            raise self._failure({})

    def shutdown(self) -> None:
        self._finalizer()

    def _failure(self, errors: dict[int, WorkerFailure]) -> Exception:
        """The exception naming a failure's cause, given the errors already
        received (rank -> failure, in arrival order), once the failed ranks
        have had their grace to report."""
        start = time.monotonic()
        while True:
            dead = {r for r, proc in enumerate(self._procs) if proc.poll() is not None}
            silent = dead - errors.keys()
            if len(dead) == len(self._procs) and not silent:
                break  # every rank exited and reported: no more news can come
            if time.monotonic() - start >= (_REPORT_GRACE_S if silent or not errors else _DEATH_GRACE_S):
                break
            if self._results.poll(50):
                rank, got, payload = pickle.loads(self._results.recv(copy=False).buffer)
                if got == "error":
                    errors.setdefault(rank, payload)
        if silent:
            # Its peers' errors follow from its death (a collective that lost a member).
            rank = min(silent)
            code = self._procs[rank].returncode
            how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return ExecutorError(f"worker rank {rank} (pid {self._procs[rank].pid}) died: {how}")
        # A rank that refused its input (ValueError) is the cause of the collective errors of peers it left.
        rank = next((r for r, f in errors.items() if f.type_name == "ValueError"), next(iter(errors)))
        return _rank_error(rank, errors[rank])

    def _broadcast(self, message: tuple, ranks: Optional[list[int]] = None) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank
        for rank in range(len(self._to_rank)) if ranks is None else ranks:
            sock = self._to_rank[rank]
            # A PUSH socket whose peer is gone blocks on send: never block
            # without checking that the ranks live.
            while True:
                try:
                    sock.send(payload, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self.check_health()
                    sock.poll(_POLL_MS, zmq.POLLOUT)

    def _collect(self, ranks: set[int], kind: str, timeout_s: Optional[float] = None) -> dict[int, Any]:
        """Wait for one ``kind`` reply from each of ``ranks``; raise on any
        rank's error or death."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while len(results) < len(ranks):
            if not self._results.poll(_POLL_MS):
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise ExecutorError(f"worker ranks {sorted(ranks - set(results))} did not answer in {timeout_s:.0f} s")
                continue
            rank, got, payload = pickle.loads(self._results.recv(copy=False).buffer)
            if got == "error":
                raise self._failure({rank: payload})
            if got == kind and rank in ranks:
                results[rank] = payload
        return results


def _rank_error(rank: int, failure: WorkerFailure) -> Exception:
    logger.error("worker rank %d failed:\n%s", rank, failure.traceback)
    message = f"worker rank {rank}: {failure.type_name}: {failure.message}"
    # Bad input (a missing model, a size that does not fit) stays a ValueError.
    return ValueError(message) if failure.type_name == "ValueError" else ExecutorError(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], socks: list[zmq.Socket], results: zmq.Socket,
          ctx: zmq.Context, folder: tempfile.TemporaryDirectory) -> None:
    """Ask every rank to leave, then end those that do not within 5 s."""
    payload = pickle.dumps(("shutdown",))
    for sock, proc in zip(socks, procs):
        if proc.poll() is None:
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sock in socks:
        sock.close(linger=0)
    results.close(linger=0)
    ctx.term()
    folder.cleanup()
