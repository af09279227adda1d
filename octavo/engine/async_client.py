"""The front's handle on the engine process (see core_process.py for the design)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import zmq
import zmq.asyncio

from octavo.config import EngineConfig
from octavo.engine import messages as msg
from octavo.engine.core_process import run_engine_core
from octavo.engine.stats import EngineStats
from octavo.outputs import RequestOutput
from octavo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can complete."""


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request (the engine itself is fine)."""


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)


class AsyncEngineClient:
    """Starts the engine process and multiplexes requests over its sockets.

    Use ``await AsyncEngineClient.start(config)``; then ``generate`` yields the
    cumulative ``RequestOutput`` of one request (the same object, updated in
    place, each time it progresses). Leaving the iterator early (client gone,
    task cancelled) aborts the request in the engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: Optional[EngineInfo] = None
        self.stats = EngineStats()
        self.dead_reason: Optional[str] = None
        self._queues: dict[str, asyncio.Queue[msg.OutputDelta | BaseException]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="octavo-ipc-")
        self._ctx = zmq.asyncio.Context()
        in_addr = f"ipc://{Path(self._tmp.name) / 'in'}"
        out_addr = f"ipc://{Path(self._tmp.name) / 'out'}"
        # A plain (sync) socket for sending: PUSH with an unlimited HWM never
        # blocks, so sends stay synchronous, which lets ``finally`` blocks and
        # cancelled tasks abort without awaiting.
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(
            target=run_engine_core, args=(config, in_addr, out_addr), name="octavo-engine", daemon=True
        )
        self._reader: Optional[asyncio.Task[None]] = None

    @classmethod
    async def start(cls, config: EngineConfig, timeout_s: float = 600.0) -> AsyncEngineClient:
        client = cls(config)
        client._proc.start()
        try:
            await client._wait_ready(timeout_s)
        except BaseException:
            client._close_process(grace_s=0.0)
            client._close_sockets()
            raise
        loop = asyncio.get_running_loop()
        loop.add_reader(client._proc.sentinel, client._on_process_exit)
        client._reader = asyncio.create_task(client._read_loop())
        return client

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            # Messages first: a failing engine sends its reason, then exits.
            if await self._pull.poll(200):
                m = msg.from_engine_decoder.decode(await self._pull.recv())
                if isinstance(m, msg.EngineFailed):
                    raise EngineDeadError(f"engine failed to start:\n{m.message}")
                if isinstance(m, msg.EngineReady):
                    self.info = EngineInfo(m.model_name, m.max_model_len, m.vocab_size, m.generation_defaults)
                    logger.info("engine process %d ready: model %s, context %d", m.pid, m.model_name, m.max_model_len)
                    return
                continue
            if not self._proc.is_alive():
                raise EngineDeadError(f"engine process exited during start-up (code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine did not start within {timeout_s:.0f} s")

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        queue: asyncio.Queue[msg.OutputDelta | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        out = RequestOutput(request_id, None, list(prompt_token_ids), [], finished=False)
        finished = False
        try:
            self._send(msg.AddRequest(request_id, list(prompt_token_ids), params, priority, arrival_time))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                msg.apply_delta(out, item)
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.dead_reason is None:
                self._send(msg.AbortRequests([request_id]))

    def _send(self, m: msg.ToEngine) -> None:
        self._push.send(msg.encoder.encode(m), copy=False)

    async def _read_loop(self) -> None:
        while True:
            try:
                raw = await self._pull.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            m = msg.from_engine_decoder.decode(raw)
            if isinstance(m, msg.StepOutputs):
                for delta in m.outputs:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(m, msg.StatsUpdate):
                self.stats = m.stats
            elif isinstance(m, msg.RequestRejected):
                queue = self._queues.get(m.request_id)
                if queue is not None:
                    queue.put_nowait(EngineRequestError(m.message))
            elif isinstance(m, msg.EngineFailed):
                logger.error("engine process failed:\n%s", m.message)
                self._mark_dead(f"engine failed: {m.message.strip().splitlines()[-1]}")

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._proc.join(timeout=0)
        self._mark_dead(f"engine process exited (code {self._proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the engine process (in-flight requests are the caller's to drain first)."""
        if self._proc.is_alive() and self.dead_reason is None:
            self._send(msg.Shutdown())
        try:
            asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        except (ValueError, OSError):
            pass
        self.dead_reason = self.dead_reason or "engine shut down"
        await asyncio.to_thread(self._close_process, grace_s)
        if self._reader is not None:
            self._reader.cancel()
        self._close_sockets()

    def _close_process(self, grace_s: float) -> None:
        self._proc.join(timeout=grace_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def _close_sockets(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()
