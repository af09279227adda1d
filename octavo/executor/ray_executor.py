"""The Ray executor: one Ray actor per rank, on any machine of a Ray cluster.

Chosen with ``distributed_executor_backend="ray"``; Ray is the optional
extra ``octavo[ray]`` and is imported only here. The engine joins the
cluster named by ``RAY_ADDRESS`` (``ray.init()``), or starts a local one.

Each step is put in Ray's object store ONCE (``ray.put``) and every actor
gets the same reference; each actor builds its rank exactly as a process of
the multi-process executor does (``init_rank_worker``: torch.distributed on
gloo or NCCL, rendezvous at rank 0's node). The driver rank returns the
step's output, the others None. An actor that dies raises ExecutorError
naming its rank.
"""
from __future__ import annotations

import os
import socket
from collections import deque
from pathlib import Path
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError, RayError

import octavo
from octavo.config import EngineConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.executor.base import Executor, ExecutorError
from octavo.executor.placement import RankPlacement, place_ranks
from octavo.executor.worker_proc import InitArgs, init_rank_worker

_ERROR_GRACE_S = 5.0  # after one rank fails, how long to wait to learn whether a peer died


class _RankActor:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Any = None

    def rendezvous(self) -> str:
        """A tcp:// address on this actor's node for torch.distributed."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def init(self, args: InitArgs) -> None:
        self.worker = init_rank_worker(self.rank, args)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        out = self.worker.execute_model(scheduler_output)
        return out if self.worker.is_driver else None

    def rpc(self, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel
        world = parallel.world_size
        if not ray.is_initialized():
            ray.init()
        # Ray places the actors; threads only (no pinning: cores are Ray's to share).
        threads = place_ranks(world, parallel.threads_per_worker)[0].threads
        root = str(Path(octavo.__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        actor = ray.remote(_RankActor).options(
            num_cpus=threads,
            num_gpus=1 if config.model.device.startswith("cuda") else 0,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        self._actors = [actor.remote(rank) for rank in range(world)]
        self._driver = world - parallel.tensor_parallel_size
        self._in_flight: deque[list[ray.ObjectRef]] = deque()
        try:
            address = self._get([self._actors[0].rendezvous.remote()])[0]
            args = InitArgs(config, address, [RankPlacement(threads, None)] * world)
            self._get([a.init.remote(args) for a in self._actors])
            (self.model_info,) = self.collective_rpc("model_info", ranks=[0])
        except BaseException:
            self.shutdown()
            raise

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("num_kv_blocks"))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        step = ray.put(scheduler_output)  # serialized once, read by every actor
        self._in_flight.append([a.execute_model.remote(step) for a in self._actors])

    def collect(self) -> ModelRunnerOutput:
        return self._get(self._in_flight.popleft())[self._driver]

    def collective_rpc(self, method: str, args: tuple = (), ranks: Optional[list[int]] = None) -> list[Any]:
        ranks = list(range(len(self._actors))) if ranks is None else ranks
        return self._get([self._actors[r].rpc.remote(method, tuple(args)) for r in ranks], ranks)

    def shutdown(self) -> None:
        for a in getattr(self, "_actors", ()):
            ray.kill(a)
        self._actors = []

    def _get(self, refs: list[ray.ObjectRef], ranks: Optional[list[int]] = None) -> list[Any]:
        """The refs' values; a rank's failure as ExecutorError naming it (a
        dead actor rather than the peer whose collective it broke)."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        try:
            return ray.get(refs)
        except RayError:
            pass
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_ERROR_GRACE_S)
        failures: list[tuple[int, RayError]] = []
        for rank, ref in zip(ranks, refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except RayError as exc:
                    failures.append((rank, exc))
        dead = [(r, e) for r, e in failures if isinstance(e, RayActorError)]
        rank, exc = (dead or failures)[0]
        what = "died" if dead else "failed"
        raise ExecutorError(f"worker rank {rank} {what}: {exc}") from exc
