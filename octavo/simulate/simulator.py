"""The discrete-event loop: a trace's requests arrive at a gateway, its
routing policy (octavo/gateway/routing.py, the objects `octavo gateway` uses)
picks a replica, and each replica steps its own Scheduler on the simulated
clock (replica.py). An optional scaler changes the fleet: a new replica
serves after ``cold_start_s``; a replica scaled down drains (takes nothing
new, finishes what it holds) and then stops.

Events at the same instant run in the order they were posted. Requests that
find no ready replica (all starting, or a fleet at zero) wait at the gateway
and go out, oldest first, when one becomes ready.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol, Sequence

from octavo.gateway.routing import LeastLoad, Policy, RoundRobin, RouteInput
from octavo.simulate.cost_model import CostModel
from octavo.simulate.replica import ReplicaShape, ReplicaState, RequestRecord, SimReplica
from octavo.simulate.traces import TraceRequest

# Policies that need no more than a trace holds (prefix/session/kv-aware
# routing would need prompt text, sessions or KV events, which a trace lacks).
ROUTING_POLICIES: dict[str, Callable[[], Policy]] = {"round-robin": RoundRobin, "least-load": LeastLoad}
STALL_MODELS = ("independent", "recorded")


@dataclass
class FleetConfig:
    routing: str = "least-load"
    initial_replicas: int = 1
    cold_start_s: float = 60.0
    # How often the fleet is sampled (timeline, and the scaler's input) and the scaler consulted.
    interval_s: float = 10.0
    # Latency outside the engine's steps (HTTP, tokenization, streaming): added before a request reaches a replica,
    # on top of the cost model's served per-request cost.
    request_overhead_s: float = 0.0
    # What a served step costs beyond the calibrated step (the cost model's served terms, when it has them): added
    # to every step.
    step_overhead_s: float = 0.0
    # How a served step's stretch is drawn (served.py): "independent", each step its own; "recorded", the served
    # calibration's steps replayed as they came, slow ones in runs (speed_tape.py).
    stalls: str = "independent"

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {sorted(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.stalls not in STALL_MODELS:
            raise ValueError(f"stalls must be one of {list(STALL_MODELS)}, got {self.stalls!r}")
        if self.initial_replicas < 0:
            raise ValueError(f"initial_replicas must be >= 0, got {self.initial_replicas}")
        for name in ("cold_start_s", "request_overhead_s", "step_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


@dataclass(frozen=True)
class FleetSample:
    """The fleet at the end of one interval."""

    time: float
    arrivals: int  # requests that arrived during the interval
    ready: int  # replicas serving
    starting: int
    draining: int
    running: int
    waiting: int  # in the replicas' queues and at the gateway
    kv_usage: float  # mean over ready replicas
    ttft_p99: Optional[float]  # over first tokens during the interval
    target: int  # replicas wanted (ready + starting after this interval's decision)


class Scaler(Protocol):
    def target(self, history: Sequence[FleetSample], current: int, now: float) -> int:
        """Replicas wanted at ``now``, given the samples so far and the
        replicas serving or starting."""


@dataclass
class SimResult:
    records: list[RequestRecord]
    samples: list[FleetSample]
    replicas: list[SimReplica]
    end_s: float
    interval_s: float
    scale_events: list[tuple[float, int, int]] = field(default_factory=list)  # (time, from, to)


class Simulator:
    def __init__(self, cost_model: CostModel, shape: ReplicaShape, fleet: FleetConfig,
                 scaler: Optional[Scaler] = None, seed: int = 0) -> None:
        if fleet.initial_replicas == 0 and scaler is None:
            raise ValueError("initial_replicas must be >= 1 without an autoscaler to start replicas")
        if fleet.stalls == "recorded" and (cost_model.served is None or cost_model.served.speed_tape is None):
            raise ValueError("stalls: recorded needs a cost model fitted to a server's own steps "
                             "(`octavo simulate calibrate --served-steps`)")
        self.cost_model, self.shape, self.fleet, self.scaler = cost_model, shape, fleet, scaler
        self._rng = random.Random(seed)
        self._policy = ROUTING_POLICIES[fleet.routing]()
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._replicas: list[SimReplica] = []
        self._gateway_queue: deque[RequestRecord] = deque()
        self._records: list[RequestRecord] = []
        self._unfinished = 0
        self._arrivals_in_interval = 0
        self._interval_ttfts: list[float] = []  # first tokens since the last tick
        self._samples: list[FleetSample] = []
        self._scale_events: list[tuple[float, int, int]] = []
        self._now = 0.0

    # ---- the loop -------------------------------------------------------

    def run(self, trace: Sequence[TraceRequest],
            on_tick: Optional[Callable[[float, int, int], None]] = None) -> SimResult:
        """Simulate ``trace`` to its end; ``on_tick(simulated seconds, requests finished, requests)``
        after every autoscaling interval (a progress display)."""
        for _ in range(self.fleet.initial_replicas):
            self._add_replica(0.0, cold=False)
        for i, t in enumerate(sorted(trace, key=lambda r: r.arrival_s)):
            record = RequestRecord(f"r{i}", t.arrival_s, t.prompt_tokens, t.output_tokens)
            self._records.append(record)
            delay = self.fleet.request_overhead_s + self.cost_model.request_overhead_s
            self._post(t.arrival_s + delay, "arrive", record)
        self._unfinished = len(self._records)
        last_arrival = max((t.arrival_s for t in trace), default=0.0)
        self._post(self.fleet.interval_s, "tick", None)
        while self._events:
            self._now, _, kind, obj = heapq.heappop(self._events)
            if kind == "tick":
                self._tick()
                if on_tick is not None:
                    on_tick(self._now, len(self._records) - self._unfinished, len(self._records))
                # Stop when all is served, or when nothing can serve what is
                # left (no replica, none coming, no scaler to start one).
                stuck = not self._events and not any(r.state is not ReplicaState.STOPPED for r in self._replicas)
                if (self._unfinished or self._now < last_arrival) and not stuck:
                    self._post(self._now + self.fleet.interval_s, "tick", None)
            elif kind == "arrive":
                self._arrive(obj)
            elif kind == "step":
                self._step_done(obj)
            elif kind == "ready":
                self._ready(obj)
        end = self._now
        for r in self._replicas:
            if r.stopped_s is None:
                r.stopped_s = end
        return SimResult(self._records, self._samples, self._replicas, end, self.fleet.interval_s,
                         self._scale_events)

    def _post(self, time: float, kind: str, obj: object) -> None:
        heapq.heappush(self._events, (time, next(self._seq), kind, obj))

    # ---- requests -------------------------------------------------------

    def _arrive(self, record: RequestRecord) -> None:
        self._arrivals_in_interval += 1
        ready = self._ready_replicas()
        if not ready:
            self._gateway_queue.append(record)
            return
        self._dispatch(record, ready)

    def _dispatch(self, record: RequestRecord, ready: list[SimReplica]) -> None:
        by_url = {r.name: r for r in ready}
        decision = self._policy.choose(RouteInput(), [r.view for r in ready])
        replica = by_url[decision.replica.url]
        try:
            replica.add(record, self._now)
        except ValueError as exc:  # as the server's 400: this request fails, the run goes on
            record.error = str(exc)
            self._unfinished -= 1
            return
        self._kick(replica)

    def _kick(self, replica: SimReplica) -> None:
        end = replica.start_step(self._now)
        if end is not None:
            self._post(end, "step", replica)

    def _step_done(self, replica: SimReplica) -> None:
        started, finished = replica.finish_step(self._now)
        self._unfinished -= len(finished)
        self._interval_ttfts += [r.ttft for r in started]
        self._kick(replica)
        if replica.state is ReplicaState.DRAINING and not replica.num_requests and not replica.busy:
            self._stop(replica)

    # ---- the fleet ------------------------------------------------------

    def _ready_replicas(self) -> list[SimReplica]:
        return [r for r in self._replicas if r.state is ReplicaState.ACTIVE]

    def _add_replica(self, now: float, cold: bool = True) -> None:
        ready_s = now + (self.fleet.cold_start_s if cold else 0.0)
        replica = SimReplica(f"replica-{len(self._replicas)}", self.shape, self.cost_model, now, ready_s, self._rng,
                             self.fleet.step_overhead_s, self.fleet.stalls == "recorded")
        self._replicas.append(replica)
        if replica.state is ReplicaState.STARTING:
            self._post(ready_s, "ready", replica)

    def _ready(self, replica: SimReplica) -> None:
        if replica.state is not ReplicaState.STARTING:
            return  # scaled down while it was starting
        replica.state = ReplicaState.ACTIVE
        ready = self._ready_replicas()
        while self._gateway_queue:
            self._dispatch(self._gateway_queue.popleft(), ready)

    def _stop(self, replica: SimReplica) -> None:
        replica.state = ReplicaState.STOPPED
        replica.stopped_s = self._now

    def _scale_to(self, target: int) -> None:
        live = [r for r in self._replicas if r.state in (ReplicaState.ACTIVE, ReplicaState.STARTING)]
        if target == len(live):
            return
        self._scale_events.append((self._now, len(live), target))
        for _ in range(target - len(live)):
            self._add_replica(self._now)
        # Down: cancel cold starts first (they serve nothing yet), then drain
        # the replicas holding the fewest requests (the quickest to empty).
        order = sorted(live, key=lambda r: (r.state is ReplicaState.ACTIVE, r.num_requests, -r.created_s))
        for replica in order[: max(0, len(live) - target)]:
            if replica.state is ReplicaState.STARTING or (not replica.num_requests and not replica.busy):
                self._stop(replica)
            else:
                replica.state = ReplicaState.DRAINING

    def _tick(self) -> None:
        ready = self._ready_replicas()
        starting = sum(r.state is ReplicaState.STARTING for r in self._replicas)
        target = len(ready) + starting
        sample = FleetSample(
            time=self._now,
            arrivals=self._arrivals_in_interval,
            ready=len(ready),
            starting=starting,
            draining=sum(r.state is ReplicaState.DRAINING for r in self._replicas),
            running=sum(r.scheduler.num_running for r in self._replicas),
            waiting=sum(r.scheduler.num_waiting for r in self._replicas) + len(self._gateway_queue),
            kv_usage=sum(r.view.kv_usage for r in ready) / len(ready) if ready else 0.0,
            ttft_p99=_p99(self._interval_ttfts),
            target=target,
        )
        self._arrivals_in_interval, self._interval_ttfts = 0, []
        if self.scaler is not None:
            self._samples.append(sample)
            target = self.scaler.target(self._samples, target, self._now)
            self._samples.pop()
            self._scale_to(target)
            live = sum(r.state in (ReplicaState.ACTIVE, ReplicaState.STARTING) for r in self._replicas)
            sample = replace(sample, target=live)
        self._samples.append(sample)


def _p99(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
