"""The engine process: an LLMEngine stepping in its own OS process.

Why a separate process: the HTTP front spends its time in Python (JSON,
tokenizing, SSE framing) and the engine spends it in model forwards; in one
process they would share one GIL and every request parsed would stall a step.
The split follows vLLM V1:

- The front (``AsyncEngineClient``) starts this process with the ``spawn``
  method (a clean interpreter: no inherited event loop, threads or CUDA state)
  and binds two ZMQ ``ipc://`` sockets in a private temp dir. Front -> engine
  is PUSH/PULL (AddRequest, AbortRequests, Shutdown); engine -> front is
  PUSH/PULL too (EngineReady, StepOutputs, StatsUpdate, RequestRejected,
  EngineFailed). Messages are msgspec msgpack structs (``messages.py``).
- The loop: drain every pending message, then ``step()`` while there is work;
  when idle, block on the socket (in 1 s slices, to notice a dead parent).
  Outputs of one step go out as one message of deltas. Stats go out at most
  every ``STATS_INTERVAL_S`` while busy, and whenever the engine turns idle,
  so metrics read after the last request see the freed KV blocks.
- One request never takes the engine down. Validation happens in the front;
  a ``ValueError`` from ``add_request`` still comes back as
  ``RequestRejected`` (bad input the front missed), any other exception
  there as a final output with ``error`` set (an engine fault confined to
  that request). Inside ``step()`` the engine itself confines per-request
  failures the same way. What still escapes ``step()`` is a failure of the
  whole step (the forward): that is fatal, ``EngineFailed`` is sent and
  the process exits non-zero, and the front restarts it.
  The front also watches the process sentinel, which covers crashes that
  send nothing (OOM killer, segfault), and the step clock (``step_clock.py``),
  which covers a step that never returns.
- SIGINT and SIGTERM are ignored here: Ctrl-C reaches the whole process
  group, and so does the SIGTERM of systemd (control-group kill), `timeout`
  or a shell's job control; the front must be able to drain in-flight
  requests before it sends Shutdown. The engine still exits by itself when
  its parent is gone, and SIGKILL still kills it.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import TYPE_CHECKING, Optional

import zmq

from octavo.config import EngineConfig
from octavo.engine import messages as msg
from octavo.engine.fault_injection import StepDelay
from octavo.engine.stats import EngineStats, StatsLogger
from octavo.engine.step_clock import StepClock
from octavo.engine.step_record import StepRecord
from octavo.log import configure_logging

if TYPE_CHECKING:  # torch: imported in the engine process only
    from octavo.core.outputs import SchedulerOutput
    from octavo.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1
_IDLE_POLL_MS = 1000


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, clock: StepClock, log_level: int = logging.INFO
) -> None:
    """Process entry point (must be importable for ``spawn``); logs at the front's level."""
    configure_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    loop: Optional[_EngineLoop] = None
    try:
        loop = _EngineLoop(config, inp, out, parent, clock)
        loop.run()
    except Exception:
        report = traceback.format_exc()
        # Rank processes stop before the front hears of the failure: it kills
        # this process at once and starts a new engine, which must not find
        # the old ranks still holding their cores and memory.
        _stop_ranks(loop)
        out.send(msg.encoder.encode(msg.EngineFailed(report)))
        raise SystemExit(1)
    finally:
        _stop_ranks(loop)
        inp.close(linger=0)
        out.close()
        ctx.term()


def add_request(engine: LLMEngine, m: msg.AddRequest) -> Optional[msg.FromEngine]:
    """Queue ``m``; when that fails, the message telling the front (None when
    queued). A ValueError is input the front should have refused; anything
    else is an engine fault, but confined to this request, which
    ``LLMEngine.add_request`` leaves no trace of."""
    try:
        params = m.pooling if m.pooling is not None else m.params
        engine.add_request(m.request_id, m.prompt_token_ids, params, priority=m.priority, arrival_time=m.arrival_time)
    except ValueError as exc:
        return msg.RequestRejected(m.request_id, str(exc))
    except Exception as exc:
        logger.exception("request %s failed in add_request", m.request_id)
        return msg.StepOutputs([msg.failed_delta(m.request_id, f"{type(exc).__name__}: {exc}")])
    return None


def _stop_ranks(loop: Optional[_EngineLoop]) -> None:
    if loop is None:  # the engine did not start: it stopped its own ranks
        return
    try:
        loop.engine.shutdown()  # safe to call twice
    except Exception:
        logging.getLogger(__name__).exception("stopping the engine's ranks failed")


class _EngineLoop:
    def __init__(self, config: EngineConfig, inp: zmq.Socket, out: zmq.Socket, parent: int, clock: StepClock) -> None:
        from octavo.engine.llm_engine import LLMEngine  # torch: only in this process

        self._inp, self._out, self._parent, self._clock = inp, out, parent, clock
        self.engine = LLMEngine(config)
        self._delay = StepDelay.from_env()
        path = config.scheduler.step_record
        self._record = StepRecord(path) if path else None
        self.engine.on_step_scheduled = self._scheduled
        self._last_stats: Optional[EngineStats] = None
        self._last_stats_time = 0.0
        self._stats_logger = StatsLogger()
        self._stop = False
        e = self.engine
        self._send(
            msg.EngineReady(
                model_name=e.model_name,
                max_model_len=e.max_model_len,
                vocab_size=e.vocab_size,
                generation_defaults=dict(e.generation_defaults),
                pid=os.getpid(),
                model_aliases=list(e.model_aliases),
                max_logprobs=e.config.model.max_logprobs,
                pooler=e.pooler_config,
            )
        )

    def run(self) -> None:
        idle = True
        while not self._stop:
            if not self.engine.has_unfinished_requests():
                idle = True
                self._maybe_send_stats(force=True)
                if not self._wait_for_input():
                    return
            self._drain_input()
            if self._stop:
                return
            if self.engine.has_unfinished_requests():
                self._clock.start()
                start = time.monotonic()
                outputs = self.engine.step()
                self._clock.stop()
                if self._record is not None:
                    self._record.ran(start, time.monotonic() - start, idle)
                idle = False
                if outputs:
                    self._send(msg.StepOutputs([msg.to_message(o) for o in outputs]))
                self._maybe_send_stats(force=False)

    def _scheduled(self, sched_out: SchedulerOutput) -> None:
        self._clock.scheduled(len(sched_out.scheduled), sched_out.total_num_tokens)
        if self._record is not None:
            self._record.scheduled(sched_out)
        if self._delay is not None:
            self._delay.sleep()

    def _wait_for_input(self) -> bool:
        """Block until a message arrives; False when the front is gone."""
        while not self._inp.poll(_IDLE_POLL_MS):
            if os.getppid() != self._parent:
                return False
        return True

    def _drain_input(self) -> None:
        while True:
            try:
                raw = self._inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(msg.to_engine_decoder.decode(raw))

    def _handle(self, m: msg.ToEngine) -> None:
        if isinstance(m, msg.AddRequest):
            failure = add_request(self.engine, m)
            if failure is not None:
                self._send(failure)
        elif isinstance(m, msg.AbortRequests):
            self.engine.abort_request(m.request_ids)
        elif isinstance(m, msg.Shutdown):
            self._stop = True

    def _maybe_send_stats(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < STATS_INTERVAL_S:
            return
        stats = self.engine.get_stats()
        self._stats_logger.maybe_log(stats, now)
        if stats != self._last_stats:
            self._send(msg.StatsUpdate(stats))
            self._last_stats = stats
        self._last_stats_time = now

    def _send(self, m: object) -> None:
        self._out.send(msg.encoder.encode(m))
