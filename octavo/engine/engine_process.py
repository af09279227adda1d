"""One engine process as the front sees it: the spawned process and its two sockets.

``AsyncEngineClient`` owns one of these at a time and replaces it when the
process dies (see async_client.py). Each incarnation gets fresh sockets in
a fresh temp dir: messages queued for a dead process (an AddRequest it never
read) must not reach its successor, and a PUSH socket without a peer would
block the event loop on send.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import zmq
import zmq.asyncio

from octavo.config import EngineConfig
from octavo.engine import messages as msg
from octavo.engine.core_process import run_engine_core
from octavo.engine.step_clock import StepClock
from octavo.log import current_level

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can complete."""


class EngineProcess:
    def __init__(self, config: EngineConfig) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="octavo-ipc-")
        self._ctx = zmq.asyncio.Context()
        in_addr = f"ipc://{Path(self._tmp.name) / 'in'}"
        out_addr = f"ipc://{Path(self._tmp.name) / 'out'}"
        # A plain (sync) socket for sending: PUSH with an unlimited HWM never
        # has to wait while its peer is connected, so sends stay synchronous,
        # which lets ``finally`` blocks and cancelled tasks abort without
        # awaiting. With the peer gone (the engine died and the front has not
        # seen its sentinel yet) a blocking send would wait forever and freeze
        # the event loop: sends never block (see ``send_bytes``).
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")
        self.clock = StepClock(spawn)  # the front's watchdog reads what the process writes
        self.proc = spawn.Process(
            target=run_engine_core, args=(config, in_addr, out_addr, self.clock, current_level()),
            name="octavo-engine", daemon=True,
        )
        self.alive = False  # True from EngineReady until the owner sees it die

    @classmethod
    async def launch(cls, config: EngineConfig, timeout_s: float) -> tuple[EngineProcess, msg.EngineReady]:
        """Start a process and wait for its EngineReady; EngineDeadError if it
        fails or does not get there within ``timeout_s``."""
        engine = cls(config)
        engine.proc.start()
        try:
            ready = await engine._wait_ready(timeout_s)
        except BaseException:
            await engine.aclose(grace_s=0.0)
            raise
        engine.alive = True
        return engine, ready

    async def _wait_ready(self, timeout_s: float) -> msg.EngineReady:
        deadline = time.monotonic() + timeout_s
        while True:
            # Messages first: a failing engine sends its reason, then exits.
            if await self._pull.poll(200):
                m = msg.from_engine_decoder.decode(await self._pull.recv())
                if isinstance(m, msg.EngineFailed):
                    # One line: what failed. The traceback is for whoever debugs.
                    logger.debug("engine start-up traceback:\n%s", m.message)
                    reason = last_line(m.message)
                    if reason.startswith(_BAD_INPUT):  # a bad model file or option: the user's to fix, said as such
                        raise ValueError(reason.removeprefix(_BAD_INPUT))
                    raise EngineDeadError(f"engine failed to start: {reason}")
                if isinstance(m, msg.EngineReady):
                    return m
                continue
            if not self.proc.is_alive():
                raise EngineDeadError(f"engine process exited during start-up (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine did not start within {timeout_s:.0f} s")

    @property
    def sentinel(self) -> Any:
        return self.proc.sentinel

    @property
    def exitcode(self) -> Optional[int]:
        self.proc.join(timeout=0)
        return self.proc.exitcode

    def send(self, m: msg.ToEngine) -> None:
        self.send_bytes(msg.encoder.encode(m))

    def send_bytes(self, data: bytes) -> None:
        """EngineDeadError when the engine is not connected any more."""
        try:
            self._push.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine process is gone (its input is not connected)") from None

    async def recv(self) -> msg.FromEngine:
        return msg.from_engine_decoder.decode(await self._pull.recv())

    async def aclose(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the process to exit, then stop it, and
        close the sockets. Whoever reads from ``recv`` must have stopped:
        ZMQ sockets belong to one thread at a time."""
        self.alive = False
        await asyncio.to_thread(self._stop, grace_s)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    def _stop(self, grace_s: float) -> None:
        self.proc.join(timeout=grace_s)
        if self.proc.is_alive():  # SIGKILL: the engine ignores SIGTERM (see core_process)
            self.proc.kill()
            self.proc.join()


_BAD_INPUT = "ValueError: "


def last_line(report: str) -> str:
    """The exception line that ends a formatted traceback, its exception
    types without their module paths (``SafetensorError: ...``)."""
    lines = [line for line in report.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    return _QUALIFIED_TYPE.sub(lambda m: m.group(1) + ": ", lines[-1].strip())


# "package.module.Error: " -> "Error: " wherever an exception line names a type.
_QUALIFIED_TYPE = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)+([A-Z]\w*): ")
