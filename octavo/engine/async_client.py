"""The front's handle on the engine process (see core_process.py for the design).

Three duties besides moving messages:

- Supervision. When the engine process dies (it sent EngineFailed, or its
  sentinel fired: OOM kill, segfault, ``kill -9``), every in-flight request
  fails at once with ``EngineDeadError`` and a new process is started after
  a back-off (``RestartPolicy``); meanwhile ``is_alive`` is False, which the
  server turns into 503s and an unhealthy ``/health``. When the policy gives
  up, ``on_give_up`` is called (the server exits non-zero then).
- Bounded buffering. The engine sends deltas; the reader adds each to the
  request's ``OutputAccumulator`` and sets an event; the consumer wakes and
  takes everything added since it last looked, as one delta. A consumer
  that falls behind (a client reading its stream slowly) therefore costs
  its own unread output and nothing more: updates coalesce instead of
  queueing one object per step.
- Deadlines. ``generate(..., deadline=t)`` arms one timer; when it fires the
  request is aborted in the engine right away (its KV blocks return even if
  the consumer is stuck writing to a slow socket) and the consumer gets
  ``RequestTimeoutError``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import zmq

from octavo.config import EngineConfig
from octavo.engine import messages as msg
from octavo.engine.engine_process import EngineDeadError, EngineProcess, last_line
from octavo.engine.restart_policy import RestartPolicy
from octavo.engine.stats import EngineStats
from octavo.outputs import OutputAccumulator, RequestOutput
from octavo.pooling import PoolerConfig, PoolingParams
from octavo.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineHungError", "EngineRequestError", "RequestTimeoutError",
           "EngineInfo"]


class EngineHungError(EngineDeadError):
    """A step of the engine ran past the step timeout; it is being replaced."""


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request (the engine itself is fine)."""


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline and was aborted in the engine."""


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    model_aliases: tuple[str, ...] = ()  # further names requests may use
    max_logprobs: int = 20
    pooler: Optional[PoolerConfig] = None  # set when the model serves embeddings


@dataclass(eq=False)
class _Stream:
    """One in-flight request as the front holds it."""

    acc: OutputAccumulator
    engine: EngineProcess  # the incarnation it was sent to
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    error: Optional[BaseException] = None
    timer: Optional[asyncio.TimerHandle] = None

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.acc.finished:
            self.error = error
            self.changed.set()


class AsyncEngineClient:
    """Starts the engine process and multiplexes requests over its sockets.

    Use ``await AsyncEngineClient.start(config)``; then ``generate`` yields
    one request's progress as delta ``RequestOutput`` objects (each holds the
    tokens, logprobs and text new since the previous one; several steps of
    progress may arrive as one); ``OutputAccumulator`` folds them into the
    whole output. FINAL_ONLY params yield one output at the end. Leaving the
    iterator early (client gone, task cancelled) aborts the request in the
    engine.
    """

    def __init__(
        self,
        config: EngineConfig,
        start_timeout_s: float,
        restart_policy: Optional[RestartPolicy],
        on_give_up: Optional[Callable[[str], None]],
        step_timeout_s: Optional[float] = None,
    ) -> None:
        self.config = config
        self.step_timeout_s = step_timeout_s
        self.info: Optional[EngineInfo] = None
        self.stats = EngineStats()
        self.dead_reason: Optional[str] = None
        self.num_restarts = 0
        self._start_timeout_s = start_timeout_s
        self._policy = restart_policy or RestartPolicy(max_restarts=0)
        self._on_give_up = on_give_up
        self._streams: dict[str, _Stream] = {}
        self._engine: Optional[EngineProcess] = None
        self._reader: Optional[asyncio.Task[None]] = None
        self._watchdog: Optional[asyncio.Task[None]] = None
        self._restarter: Optional[asyncio.Task[None]] = None
        self._closing = False

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        timeout_s: float = 600.0,
        restart_policy: Optional[RestartPolicy] = None,
        on_give_up: Optional[Callable[[str], None]] = None,
        step_timeout_s: Optional[float] = None,
    ) -> AsyncEngineClient:
        """The first start must succeed (a bad model is an error now, not a
        restart loop); ``restart_policy`` (default: never) governs later deaths;
        ``step_timeout_s`` (default: none) is the longest a step may run."""
        client = cls(config, timeout_s, restart_policy, on_give_up, step_timeout_s)
        client._adopt(*await EngineProcess.launch(config, timeout_s))
        return client

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def engine_pid(self) -> Optional[int]:
        """The running engine process's id (None while there is none)."""
        return self._engine.proc.pid if self._engine is not None and self._engine.alive else None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        deadline: Optional[float] = None,
    ) -> AsyncIterator[RequestOutput]:
        """``deadline``: a ``time.monotonic()`` instant after which the request
        is aborted and ``RequestTimeoutError`` raised. ``PoolingParams``: an
        embedding request, whose one output carries ``embedding``."""
        engine = self._engine
        if self.dead_reason is not None or engine is None:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        try:
            if isinstance(params, PoolingParams):
                add_msg = msg.AddRequest(request_id, list(prompt_token_ids), None, priority, arrival_time, params)
            else:
                if params.output_kind is RequestOutputKind.CUMULATIVE:
                    # Cumulative outputs over the wire would cost quadratic time in the output length.
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
                add_msg = msg.AddRequest(request_id, list(prompt_token_ids), params, priority, arrival_time)
            add = msg.encoder.encode(add_msg)
        except RecursionError:
            raise EngineRequestError("the request is too deeply nested to send to the engine") from None
        stream = _Stream(OutputAccumulator(list(prompt_token_ids)), engine)
        self._streams[request_id] = stream
        if deadline is not None:
            delay = max(0.0, deadline - time.monotonic())
            stream.timer = asyncio.get_running_loop().call_later(delay, self._expire, request_id)
        try:
            engine.send_bytes(add)
            while True:
                await stream.changed.wait()
                stream.changed.clear()
                if stream.error is not None:
                    raise stream.error
                out = stream.acc.take()
                yield out
                if out.finished:
                    return
        finally:
            self._forget(request_id, stream)

    def _forget(self, request_id: str, stream: _Stream) -> None:
        self._streams.pop(request_id, None)
        if stream.timer is not None:
            stream.timer.cancel()
        # Only the incarnation that has the request can abort it (and a dead
        # one must not be sent to: see engine_process.py).
        if not stream.acc.finished and stream.engine is self._engine and stream.engine.alive:
            with contextlib.suppress(EngineDeadError):  # died meanwhile: its sentinel fires next
                stream.engine.send(msg.AbortRequests([request_id]))

    def _expire(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.acc.finished:
            return
        if stream.engine is self._engine and stream.engine.alive:
            with contextlib.suppress(EngineDeadError):  # died meanwhile: its sentinel fires next
                stream.engine.send(msg.AbortRequests([request_id]))
        stream.fail(RequestTimeoutError("the request timed out"))

    # ---- engine lifecycle ----------------------------------------------

    def _adopt(self, engine: EngineProcess, ready: msg.EngineReady) -> None:
        self.info = EngineInfo(ready.model_name, ready.max_model_len, ready.vocab_size, ready.generation_defaults,
                               tuple(ready.model_aliases), ready.max_logprobs, ready.pooler)
        logger.info("engine process %d ready: model %s, context %d", ready.pid, ready.model_name, ready.max_model_len)
        self._engine = engine
        self.stats = EngineStats()
        self.dead_reason = None
        loop = asyncio.get_running_loop()
        loop.add_reader(engine.sentinel, self._on_exit, engine)
        self._reader = asyncio.create_task(self._read_loop(engine))
        if self.step_timeout_s is not None:
            self._watchdog = asyncio.create_task(self._watch(engine, self.step_timeout_s))

    async def _watch(self, engine: EngineProcess, timeout_s: float) -> None:
        """Replace ``engine`` when a step of it runs past ``timeout_s``; checks
        a few times per timeout (and at least every second)."""
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            report = engine.clock.overdue(timeout_s)
            if report is not None:
                logger.error(
                    "engine step hung: running %.1f s, over the step timeout of %.1f s (--engine-step-timeout); "
                    "it holds %d requests, %d tokens; the longest step before it took %.2f s",
                    report.running_s, timeout_s, report.num_requests, report.num_tokens, report.longest_before_s,
                )
                self._lose(engine, f"engine step hung (over {timeout_s:g} s)", EngineHungError)
                return

    async def _read_loop(self, engine: EngineProcess) -> None:
        while True:
            try:
                self._dispatch(engine, await engine.recv())
            except (asyncio.CancelledError, zmq.ZMQError):  # retired: its sockets are closing
                return
            except Exception as exc:
                # A message we cannot read or apply: no request can be trusted
                # to finish, so the engine is replaced (a silent reader death
                # would leave every request waiting forever).
                logger.exception("unusable message from the engine")
                self._lose(engine, f"unusable message from the engine: {type(exc).__name__}")
                return

    def _dispatch(self, engine: EngineProcess, m: msg.FromEngine) -> None:
        if isinstance(m, msg.StepOutputs):
            for delta in m.outputs:
                self._on_delta(delta)
        elif isinstance(m, msg.StatsUpdate):
            self.stats = m.stats
        elif isinstance(m, msg.RequestRejected):
            stream = self._streams.get(m.request_id)
            if stream is not None:
                stream.fail(EngineRequestError(m.message))
        elif isinstance(m, msg.EngineFailed):
            logger.error("engine process failed:\n%s", m.message)
            self._lose(engine, f"engine failed: {last_line(m.message)}")

    def _on_delta(self, delta: msg.OutputDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None or stream.error is not None:
            return  # gone, or already failed (a timeout's abort output)
        stream.acc.add(msg.from_message(delta))
        stream.changed.set()

    def _on_exit(self, engine: EngineProcess) -> None:
        self._lose(engine, f"engine process exited (code {engine.exitcode})")

    def _lose(self, engine: EngineProcess, reason: str, error: type[EngineDeadError] = EngineDeadError) -> None:
        """The engine died (or hung): fail what it was serving with ``error``
        and restart or give up."""
        if engine is not self._engine or self._closing:
            return
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        engine.alive = False
        self._engine = None
        delay = self._policy.on_failure(time.monotonic())
        self.dead_reason = f"{reason}; {self._next_step(delay)}"
        logger.error("%s; failing %d in-flight requests", self.dead_reason, len(self._streams))
        for stream in self._streams.values():
            stream.fail(error(f"{reason}; the engine is restarting, retry the request" if delay is not None else reason))
        self._restarter = asyncio.create_task(self._replace(engine, delay))

    async def _retire(self, engine: EngineProcess, grace_s: float) -> None:
        """Stop reading from ``engine`` and watching it, then close it (a hung
        process is killed once ``grace_s`` has passed)."""
        tasks = [t for t in (self._reader, self._watchdog) if t is not None]
        self._reader = self._watchdog = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.aclose(grace_s)

    async def _replace(self, dead: EngineProcess, delay: Optional[float]) -> None:
        await self._retire(dead, grace_s=0.0)
        while delay is not None:
            await asyncio.sleep(delay)
            try:
                self._adopt(*await EngineProcess.launch(self.config, self._start_timeout_s))
            except Exception as exc:  # EngineDeadError, or the spawn itself failing (OSError, ZMQError)
                delay = self._policy.on_failure(time.monotonic())
                self.dead_reason = f"engine restart failed; {self._next_step(delay)}"
                logger.error("%s: %s", self.dead_reason, exc)
                continue
            self.num_restarts += 1
            logger.warning("engine restarted (%d restarts so far)", self.num_restarts)
            return
        if self._on_give_up is not None:
            self._on_give_up(self.dead_reason)

    def _next_step(self, delay: Optional[float]) -> str:
        if delay is not None:
            return f"restarting in {delay:.1f} s"
        return f"gave up after {self._policy.recent_failures} failures within {self._policy.window_s:.0f} s"

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the engine process (in-flight requests are the caller's to drain first)."""
        self._closing = True
        if self._restarter is not None:
            self._restarter.cancel()
        engine, self._engine = self._engine, None
        self.dead_reason = self.dead_reason or "engine shut down"
        if engine is None:
            return
        if engine.alive:
            with contextlib.suppress(EngineDeadError):  # gone already: nothing to ask
                engine.send(msg.Shutdown())
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        engine.alive = False
        await self._retire(engine, grace_s)
