"""Replicas as ``octavo serve`` processes on this machine, behind a gateway.

Up: a process on a free port; once its /health answers, it is registered
with the gateway's admin API and counts as ready. Down: the newest replica
(the oldest keep their warm prefix caches) is drained first: deregistered
(the gateway sends it nothing new), then left until its own /metrics show
no request running or waiting, then sent SIGTERM, on which the server
finishes whatever is still open within its --shutdown-timeout-s. A replica
still starting is the first to go, since it serves nobody yet.

Transitions run on a thread each, so ``scale`` returns at once and the
control loop keeps sampling while replicas start (seconds to minutes).
"""
from __future__ import annotations

import enum
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

import httpx

from octavo.autoscale.actuators.base import Actuator
from octavo.autoscale.gateway_admin import GatewayAdmin
from octavo.autoscale.signals import parse_metrics
from octavo.config import option

logger = logging.getLogger(__name__)

# After deregistering, a request the gateway routed just before may still be
# on its way to the replica: its queue is not read as idle before this.
_DEREGISTER_GRACE_S = 1.0
_POLL_S = 0.5
# After a replica fails to start, new ones wait this long, doubling with each failure in a row up to the
# cap: a replica that cannot start (a bad model path, a port range in use) is not retried every round.
_BACKOFF_S, _BACKOFF_CAP_S = 5.0, 300.0


@dataclass
class LocalConfig:
    serve_args: tuple[str, ...] = option((), "`octavo serve` arguments of every replica: MODEL and flags "
                                              "(--host and --port are the actuator's), as one shell-quoted string",
                                    parse=shlex.split, metavar="ARGS")
    host: str = option("127.0.0.1", "address the replicas listen on (and are registered with)")
    start_timeout_s: float = option(300.0, "a replica not healthy within this is killed")
    drain_timeout_s: float = option(120.0, "longest wait for a deregistered replica's requests to finish "
                                           "before SIGTERM (which drains for its own --shutdown-timeout-s)")
    stop_timeout_s: float = option(60.0, "after SIGTERM, this long until SIGKILL")
    log_dir: Optional[str] = option(None, "one log file per replica here (default: a temporary folder, "
                                          "named in the error when a replica fails to start)")

    def __post_init__(self) -> None:
        for name in ("start_timeout_s", "drain_timeout_s", "stop_timeout_s"):
            if not (getattr(self, name) > 0):
                raise ValueError(f"local.{name} must be > 0, got {getattr(self, name)}")
        if any(a in ("--port", "--host") or a.startswith(("--port=", "--host=")) for a in self.serve_args):
            raise ValueError("local.serve_args: --host and --port are chosen by the actuator")


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class LocalReplica:
    url: str
    process: subprocess.Popen
    started_at: float
    state: State = State.STARTING
    log: Optional[IO[bytes]] = field(default=None, repr=False)
    log_path: Optional[Path] = None


def _last_line(path: Optional[Path]) -> str:
    """The last non-empty line of a replica's log (its ``octavo: error:`` line when it failed to start)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except (OSError, AttributeError):
        return ""
    return lines[-1][:300] if lines else ""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalActuator(Actuator):
    def __init__(self, config: LocalConfig, gateway: Optional[GatewayAdmin]) -> None:
        self.config = config
        self.gateway = gateway
        self._lock = threading.Lock()
        self._replicas: list[LocalReplica] = []
        self._threads: list[threading.Thread] = []
        self._http = httpx.Client(timeout=5.0)
        self._log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="octavo-replicas-"))
        self._failed_starts = 0
        self._no_start_before = 0.0

    def replicas(self) -> int:
        self._reap()
        with self._lock:
            return sum(r.state in (State.STARTING, State.READY) for r in self._replicas)

    def replica_urls(self) -> list[str]:
        self._reap()
        with self._lock:
            return [r.url for r in self._replicas if r.state is State.READY]

    def _reap(self) -> None:
        """A ready replica whose process died is deregistered and counted out,
        so the next decision replaces it instead of counting a corpse."""
        with self._lock:
            dead = [r for r in self._replicas if r.state is State.READY and r.process.poll() is not None]
            for replica in dead:
                replica.state = State.STOPPED
        for replica in dead:
            logger.error("replica %s exited with %s", replica.url, replica.process.returncode)
            self._deregister(replica)
            if replica.log is not None:
                replica.log.close()

    def states(self) -> dict[str, State]:
        """Every replica this actuator has run, by URL (stopped ones too): for logs and tests."""
        with self._lock:
            return {r.url: r.state for r in self._replicas}

    def scale(self, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        with self._lock:
            active = [r for r in self._replicas if r.state in (State.STARTING, State.READY)]
            missing = replicas - len(active)
            if missing > 0 and time.monotonic() < self._no_start_before:
                missing = 0  # backing off after failed starts; a later round starts them
            for _ in range(missing):
                replica = self._spawn()
                self._replicas.append(replica)
                self._run(self._bring_up, replica)
            # Starting ones first (they serve nobody yet), then the newest ready ones.
            victims = sorted(active, key=lambda r: (r.state is State.READY, -r.started_at))
            for replica in victims[: max(0, len(active) - replicas)]:
                serving = replica.state is State.READY
                replica.state = State.DRAINING
                self._run(self._drain if serving else self._stop, replica)

    def close(self) -> None:
        """Stop every replica (drained as on scale-down) and wait for the transitions."""
        self.scale(0)
        for thread in list(self._threads):
            thread.join()
        if self.gateway is not None:
            self.gateway.close()
        self._http.close()

    def _run(self, target, replica: LocalReplica) -> None:
        thread = threading.Thread(target=target, args=(replica,), name=f"autoscale {replica.url}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _spawn(self) -> LocalReplica:
        port = free_port(self.config.host)
        url = f"http://{self.config.host}:{port}"
        # -P: the working folder is not put on sys.path, so a folder holding some other checkout named
        # octavo/ cannot shadow the installed package (Python 3.11+).
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, *safe_path, "-m", "octavo.entrypoints.cli", "serve", *self.config.serve_args,
               "--host", self.config.host, "--port", str(port)]
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"replica-{port}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(cmd, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
        logger.info("starting replica %s (pid %d, log %s)", url, process.pid, log_path)
        return LocalReplica(url, process, time.monotonic(), log=log, log_path=log_path)

    def _start_failed(self, replica: LocalReplica, how: str) -> None:
        """One line with the replica's own last words and where the rest is; new starts back off."""
        if replica.log is not None:
            replica.log.flush()
        last = _last_line(replica.log_path)
        with self._lock:
            self._failed_starts += 1
            wait = min(_BACKOFF_S * 2 ** (self._failed_starts - 1), _BACKOFF_CAP_S)
            self._no_start_before = time.monotonic() + wait
        logger.error("replica %s %s%s (log %s); next start in %.0f s", replica.url, how,
                     f": {last}" if last else "", replica.log_path, wait)

    def _bring_up(self, replica: LocalReplica) -> None:
        deadline = replica.started_at + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if replica.state is not State.STARTING:
                return  # scaled down while starting: the drain thread stops it
            if replica.process.poll() is not None:
                self._start_failed(replica, f"exited with {replica.process.returncode} while starting")
                self._set(replica, State.STOPPED)
                return
            if self._healthy(replica.url):
                try:
                    if self.gateway is not None:
                        self.gateway.add(replica.url)
                except httpx.HTTPError as exc:
                    logger.error("could not register %s with the gateway: %s", replica.url, exc)
                    break
                with self._lock:
                    if replica.state is State.STARTING:
                        replica.state = State.READY
                        self._failed_starts = 0
                        logger.info("replica %s ready after %.1fs", replica.url,
                                    time.monotonic() - replica.started_at)
                        return
                # Scaled down the moment it became healthy: undo the registration; the drain thread stops it.
                self._deregister(replica)
                return
            time.sleep(_POLL_S)
        self._start_failed(replica, f"was not ready within {self.config.start_timeout_s:g} s; stopping it")
        with self._lock:
            if replica.state is not State.STARTING:
                return
            replica.state = State.DRAINING
        self._stop(replica)

    def _drain(self, replica: LocalReplica) -> None:
        self._deregister(replica)
        time.sleep(_DEREGISTER_GRACE_S)
        deadline = time.monotonic() + self.config.drain_timeout_s
        idle_polls = 0
        while time.monotonic() < deadline and replica.process.poll() is None and idle_polls < 2:
            idle_polls = idle_polls + 1 if self._idle(replica.url) else 0
            time.sleep(_POLL_S)
        self._stop(replica)

    def _deregister(self, replica: LocalReplica) -> None:
        if self.gateway is None:
            return
        try:
            self.gateway.remove(replica.url)
        except httpx.HTTPError as exc:
            logger.error("could not deregister %s from the gateway: %s", replica.url, exc)

    def _stop(self, replica: LocalReplica) -> None:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
            try:
                replica.process.wait(self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.error("replica %s ignored SIGTERM for %.0fs: killing it", replica.url,
                             self.config.stop_timeout_s)
                replica.process.kill()
                replica.process.wait()
        if replica.log is not None:
            replica.log.close()
        logger.info("replica %s stopped (exit %s)", replica.url, replica.process.returncode)
        self._set(replica, State.STOPPED)

    def _set(self, replica: LocalReplica, state: State) -> None:
        with self._lock:
            replica.state = state

    def _healthy(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _idle(self, url: str) -> bool:
        """No request running or waiting on the replica (an unreadable page counts as busy)."""
        try:
            r = self._http.get(f"{url}/metrics")
            r.raise_for_status()
        except httpx.HTTPError:
            return False
        s = parse_metrics(r.text)
        return s.running == 0 and s.waiting == 0
