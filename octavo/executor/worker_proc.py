"""The process of one rank under the multi-process executor.

Started by ``MultiprocExecutor`` as ``python -m octavo.executor.worker_proc
RANK STEP_ADDR RESULT_ADDR`` (a plain subprocess, not multiprocessing: the
engine process is itself a daemon process, which multiprocessing forbids to
have children). It connects its PULL socket to the executor's PUSH socket
for this rank and its PUSH socket to the executor's results socket, then
serves messages, each a pickled tuple:

- ``("init", InitArgs)``: pin threads and cores, join torch.distributed,
  set the parallel state, build the Worker; reply ``ready``.
- ``("step", SchedulerOutput)``: run it; the driver (tensor rank 0 of the
  last pipeline stage) replies with the ModelRunnerOutput, the other ranks
  reply only if they fail.
- ``("rpc", method, args)``: every rank replies with ``Worker.method(*args)``.
- ``("shutdown",)``: leave.

Replies are pickled ``(rank, kind, payload)`` with kind ``ready``, ``ok`` or
``error`` (payload: the exception's type name, message and traceback). A rank
that cannot start sends its error, then exits with status 1 once the error is
delivered (or after the socket's 2 s linger). The process exits by itself
when the engine process is gone.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import zmq

from octavo.config import EngineConfig
from octavo.executor.placement import RankPlacement
from octavo.log import configure_from_env

_POLL_MS = 1000  # how often an idle worker checks that its engine still lives


@dataclass
class InitArgs:
    config: EngineConfig
    dist_init_method: str  # tcp://host:port of rank 0's rendezvous
    placements: list[RankPlacement]


@dataclass
class WorkerFailure:
    type_name: str
    message: str
    traceback: str


def init_rank_worker(rank: int, args: InitArgs) -> Any:
    """This process becomes ``rank``: its threads and cores, its place in
    torch.distributed and the parallel groups, its Worker (returned)."""
    import torch
    import torch.distributed as dist

    from octavo.distributed.parallel_state import init_model_parallel
    from octavo.worker.worker import Worker

    placement = args.placements[rank]
    if placement.cpus is not None:
        os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(placement.threads)
    parallel = args.config.parallel
    config = args.config
    backend = "gloo"
    if config.model.device.startswith("cuda"):
        # One GPU per rank, NCCL between them: the ranks of one machine take
        # its GPUs in order (a Ray actor sees only its own GPU, index 0).
        backend = "nccl"
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=f"cuda:{local}"))
    dist.init_process_group(
        backend, init_method=args.dist_init_method, rank=rank, world_size=parallel.world_size,
        timeout=timedelta(minutes=10),
    )
    init_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.enable_expert_parallel)
    return Worker(config, rank)


def serve(rank: int, step_addr: str, result_addr: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when ranks stop
    parent = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(step_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(result_addr)
    worker = None

    def reply(kind: str, payload: Any) -> None:
        out.send(pickle.dumps((rank, kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        while True:
            if not inp.poll(_POLL_MS):
                if os.getppid() != parent:
                    return  # the engine is gone
                continue
            try:
                message = pickle.loads(inp.recv(copy=False).buffer)
                kind = message[0]
                if kind == "shutdown":
                    return
                if kind == "step":
                    result = worker.execute_model(message[1])
                    if worker.is_driver:
                        reply("ok", result)
                elif kind == "init":
                    worker = init_rank_worker(rank, message[1])
                    reply("ready", None)
                else:  # rpc
                    reply("ok", getattr(worker, message[1])(*message[2]))
            except Exception as exc:
                reply("error", WorkerFailure(type(exc).__name__, str(exc), traceback.format_exc()))
                if worker is None:
                    # Could not start: nothing to serve. A non-zero status, so that whoever sees the exit
                    # before the report (which the socket's linger still delivers) does not read success.
                    raise SystemExit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        inp.close(linger=0)
        out.close()
        ctx.term()


def main(argv: Optional[list[str]] = None) -> None:
    rank, step_addr, result_addr = (argv or sys.argv[1:])[:3]
    configure_from_env()
    serve(int(rank), step_addr, result_addr)


if __name__ == "__main__":
    # Run from the module's importable name, so that what it pickles
    # (WorkerFailure) names octavo.executor.worker_proc, not __main__.
    from octavo.executor.worker_proc import main as _main

    _main()
