"""One simulated `octavo serve` replica: Octavo's own Scheduler (with its KV
cache manager and block pool) stepping on a simulated clock.

The engine's loop is reproduced at the level that decides timing: requests
that arrived while a step ran join before the next ``schedule()``; steps run
back to back while there is work; a step's duration is the cost model's
prediction for what ``schedule()`` put in it. Where the engine would run the
model, the replica makes up the results: every scheduled request that samples
gets one token. Requests are forced to their trace length (``ignore_eos``),
as benchmark clients force real servers, so the token's value does not
matter; prompts are random token ids, so the prefix cache hits as rarely as
it does on the benchmark's random prompts.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.gateway.config import BreakerConfig
from octavo.gateway.replicas import Breaker, Replica
from octavo.sampling_params import SamplingParams
from octavo.simulate.cost_model import FEATURES, CostModel, EngineShape, StepWork, step_work

# Any id works (outputs are forced to their length); outside the prompts' range.
_SAMPLED_TOKEN = 0
_PROMPT_TOKEN_RANGE = (1, 30_000)


class ReplicaState(enum.Enum):
    STARTING = "starting"  # cold start: not routable yet
    ACTIVE = "active"
    DRAINING = "draining"  # scaled down: finishes what it holds, takes nothing new
    STOPPED = "stopped"


@dataclass
class RequestRecord:
    """One request's life in the simulation (times in simulated seconds)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    replica: str = ""
    dispatched_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    tokens_done: int = 0
    preemptions: int = 0
    error: Optional[str] = None  # refused by the replica (e.g. longer than its context), as a server's 400

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot(self) -> Optional[float]:
        if self.finish_s is None or self.first_token_s is None or self.tokens_done < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.tokens_done - 1)


@dataclass(frozen=True)
class ReplicaShape:
    """What every replica of the simulated fleet is configured with."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    num_blocks: int
    max_model_len: int

    @classmethod
    def of_engine(cls, engine: EngineShape) -> ReplicaShape:
        """The calibrated engine's limits."""
        return cls(SchedulerConfig(engine.max_num_seqs, engine.max_num_batched_tokens, engine.enable_chunked_prefill),
                   CacheConfig(block_size=engine.block_size), engine.num_kv_blocks, engine.max_model_len)


class SimReplica:
    def __init__(self, name: str, shape: ReplicaShape, cost_model: CostModel, created_s: float, ready_s: float,
                 rng: random.Random, step_overhead_s: float = 0.0, recorded_stalls: bool = False) -> None:
        self.name = name
        self.scheduler = Scheduler(shape.scheduler, shape.cache, shape.num_blocks, shape.max_model_len)
        # What the gateway's routing policies read: the replica's /metrics, scraped.
        self.view = Replica(url=name, breaker=Breaker(BreakerConfig()))
        self.state = ReplicaState.STARTING if ready_s > created_s else ReplicaState.ACTIVE
        self.created_s = created_s
        self.ready_s = ready_s
        self.stopped_s: Optional[float] = None
        self.busy_s = 0.0
        self.num_steps = 0
        self._cost = cost_model
        self._step_overhead_s = step_overhead_s
        self._rng = rng
        # ``recorded_stalls``: the served calibration's steps replayed (speed_tape.py), from a point of the tape
        # drawn per replica, so the replicas of one fleet meet their stalls at different times.
        self._tape = cost_model.served.speed_tape if recorded_stalls and cost_model.served is not None else None
        self._tape_offset_s = rng.uniform(0.0, self._tape.length_s) if self._tape is not None else 0.0
        self._records: dict[str, RequestRecord] = {}
        self._step: Optional[SchedulerOutput] = None
        self.step_work: Optional[StepWork] = None  # what the step in flight computes
        self.step_end_s: Optional[float] = None

    # ---- requests -------------------------------------------------------

    def add(self, record: RequestRecord, now: float) -> None:
        """Queue a request; ValueError (the scheduler's) for one the replica cannot serve."""
        prompt = [self._rng.randrange(*_PROMPT_TOKEN_RANGE) for _ in range(record.prompt_tokens)]
        params = SamplingParams(max_tokens=record.output_tokens, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(Request(record.request_id, prompt, params, arrival_time=now))
        record.replica, record.dispatched_s = self.name, now
        self._records[record.request_id] = record
        self.refresh_view()

    @property
    def num_requests(self) -> int:
        return len(self._records)

    @property
    def busy(self) -> bool:
        return self._step is not None

    # ---- steps ----------------------------------------------------------

    def start_step(self, now: float) -> Optional[float]:
        """Schedule the next step if idle and there is work: its end time, else None."""
        if self._step is not None or not self.scheduler.has_unfinished_requests():
            return None
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        work = step_work(out)
        duration = self._cost.step_seconds(work) + self._step_overhead_s
        if self._tape is not None:  # steps of equal work differ on a shared machine (served.py)
            duration = self._tape.duration(now + self._tape_offset_s, duration)
        elif self._cost.served is not None:
            duration *= self._cost.served.step_factor(self._rng)
        self._step, self.step_work, self.step_end_s = out, work, now + duration
        self.busy_s += duration
        self.num_steps += 1
        return self.step_end_s

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        """Apply the running step's results at ``now``: the requests that got
        their first token, and those that finished."""
        out, self._step, self.step_work, self.step_end_s = self._step, None, None, None
        if out is None:
            raise RuntimeError(f"replica {self.name}: no step in flight")
        for rid in out.preempted_request_ids:
            self._records[rid].preemptions += 1
        sampled = {s.request_id: [_SAMPLED_TOKEN] for s in out.scheduled if s.sample}
        started, finished = [], []
        for core_out in self.scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled)):
            record = self._records[core_out.request_id]
            if core_out.new_token_ids and record.first_token_s is None:
                record.first_token_s = now
                started.append(record)
            record.tokens_done += len(core_out.new_token_ids)
            if core_out.finished:
                record.finish_s = now
                finished.append(self._records.pop(core_out.request_id))
        self.refresh_view()
        return started, finished

    def refresh_view(self) -> None:
        """The routing policies see this replica's true state (an instant scrape)."""
        self.view.running = self.scheduler.num_running
        self.view.waiting = self.scheduler.num_waiting
        self.view.kv_usage = self.scheduler.kv_cache_manager.usage


@dataclass(frozen=True)
class BurstStep:
    """One step of a burst: its work, and how many of the burst's requests are unfinished as it starts (each of
    them waits for it for its last token) and how many have no token yet (each waits for it for its first)."""

    work: StepWork
    unfinished: int
    unstarted: int


def burst_steps(shape: ReplicaShape, requests: Sequence[tuple[int, int]], seed: int = 0) -> list[BurstStep]:
    """The steps a replica of ``shape`` runs for ``requests`` ((prompt tokens, output tokens) each) all queued at
    once, in order. No request arrives while they run, so the steps do not depend on how long each takes: they
    are the steps a real engine of that shape runs for the same burst."""
    free = CostModel({f: 0.0 for f in FEATURES})
    replica = SimReplica("burst", shape, free, 0.0, 0.0, random.Random(seed))
    for i, (prompt, output) in enumerate(requests):
        replica.add(RequestRecord(f"burst-{i}", 0.0, prompt, output), 0.0)
    steps, unstarted = [], len(requests)
    while replica.start_step(0.0) is not None:
        steps.append(BurstStep(replica.step_work, replica.num_requests, unstarted))
        started, _finished = replica.finish_step(0.0)
        unstarted -= len(started)
    return steps
