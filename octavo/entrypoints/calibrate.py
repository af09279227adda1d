"""``octavo simulate calibrate``: time the real engine's steps on this machine
and fit the simulator's cost model to them (octavo/simulate/cost_model.py).

The engine runs in this process (``LLM``); a designed set of probes puts
known work in its steps: prompts alone at several lengths (prefill), batches
of prompts (several chunks per step), batches decoding at several context
lengths and at sizes between the recorded ones (padded, cost_model.py), and
a staggered probe where a new prompt joins a decoding batch every step
(mixed steps, as under online load). The probe set runs once
untimed first (kernels build, and a step of a new shape pays one-off costs a
served engine has long paid); then each ``LLMEngine.step()`` is timed whole
(scheduling, forward, sampling, the scheduler's update and detokenizing:
what the engine's loop spends per step), and the step's work is read from
the ``SchedulerOutput`` that step scheduled.

Steps are timed on the wall clock, or (``--clock cpu``) on the process's CPU
clock: with one thread that is the step's own work without the time other
processes held the core, which on a loaded machine scatters wall-clock steps
of the same work over a range of 1-10x. A cost model fitted on CPU time
predicts the engine alone; ``--served`` then measures what contention and the
HTTP front add (calibrate_served.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import octavo
from octavo.config import option
from octavo.entrypoints.calibrate_served import calibrate_served, served_summary
from octavo.sampling_params import SamplingParams
from octavo.simulate.cost_model import CostModel, EngineShape, FitQuality, MachineInfo, StepWork, step_work

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """``batch`` requests of ``prompt_len`` tokens generating ``output_len``;
    ``stagger``: one request joins before each step instead of all at once."""

    batch: int
    prompt_len: int
    output_len: int
    stagger: bool = False


def _fit(n: int, max_model_len: int) -> int:
    """A prompt length cut to the context, leaving room for the outputs."""
    return max(2, min(n, max_model_len - 32))


def warmup_probes(max_model_len: int) -> list[Probe]:
    return [Probe(2, _fit(64, max_model_len), 4), Probe(1, _fit(512, max_model_len), 2)]


def default_probes(max_model_len: int, max_batch: int = 64) -> list[Probe]:
    """The probe set; ``max_batch`` caps the batch sizes (a quicker, coarser calibration)."""

    def fit(n: int) -> int:
        return _fit(n, max_model_len)

    def batches(*sizes: int) -> list[int]:
        return sorted({min(b, max_batch) for b in sizes})

    probes = [Probe(1, fit(n), 1) for n in (16, 64, 256, 512, 1024, 1536)]
    probes += [Probe(b, fit(128), 1) for b in batches(2, 4, 8)] + [Probe(min(4, max_batch), fit(480), 1)]
    probes += [Probe(b, fit(n), 24) for n in (32, 512) for b in batches(1, 2, 4, 8, 16, 32, 64)]
    # Batches between the recorded decode sizes (1, 2, 4, every 8), decoding without finishing: padded steps. The
    # staggered probes' drains pad too, but a request finishes every step of them, which cost 0.6-1.5 ms more on
    # octavo-mini (Zen 4, CPU time): fitted to those alone, the padding term took it in (0.26-0.33 ms a row,
    # 0.19 with these).
    probes += [Probe(b, fit(128), 24) for b in batches(3, 6, 12, 20, 28, 44, 60)]
    probes += [Probe(b, fit(1536), 16) for b in batches(1, 4, 16)]
    probes += [Probe(min(24, max_batch), fit(128), 32, stagger=True),
               Probe(min(12, max_batch), fit(400), 24, stagger=True)]
    return probes


class _StepRecorder:
    """Stands in for ``scheduler.schedule`` and keeps what it returned last:
    the engine's step calls it once."""

    def __init__(self, schedule: Callable[[], Any]) -> None:
        self._schedule = schedule
        self.last: Any = None  # the SchedulerOutput

    def __call__(self) -> Any:
        self.last = self._schedule()
        return self.last


CLOCKS = ("wall", "cpu")


@dataclass
class TimedSteps:
    """Each non-empty step's work and its seconds on both clocks, in the order they ran."""

    works: list[StepWork] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def seconds(self, clock: str) -> list[float]:
        return self.cpu if clock == "cpu" else self.wall


def measure(engine, probes: list[Probe], repeats: int) -> TimedSteps:
    recorder = _StepRecorder(engine.scheduler.schedule)
    engine.scheduler.schedule = recorder
    timed = TimedSteps()
    ids = iter(range(10**9))
    vocab = engine.vocab_size

    def add(probe: Probe, i: int) -> None:
        # Distinct token ids per request: no prefix-cache hit shortens a probe.
        rid = next(ids)
        prompt = [(rid * 7919 + j * 31 + i) % (vocab - 10) + 5 for j in range(probe.prompt_len)]
        params = SamplingParams(max_tokens=probe.output_len, ignore_eos=True, temperature=0.0)
        engine.add_request(f"cal-{rid}", prompt, params)

    for repeat in range(repeats):
        for i, probe in enumerate(probes):
            logger.info("calibration %d/%d, probe %d/%d: %s", repeat + 1, repeats, i + 1, len(probes), probe)
            pending = probe.batch
            if not probe.stagger:
                for j in range(probe.batch):
                    add(probe, j)
                pending = 0
            while engine.has_unfinished_requests() or pending:
                if pending:
                    add(probe, pending)
                    pending -= 1
                wall, cpu = time.perf_counter(), time.process_time()
                engine.step()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                work = step_work(recorder.last) if recorder.last is not None else StepWork()
                if not work.is_empty:
                    timed.works.append(work)
                    timed.wall.append(wall)
                    timed.cpu.append(cpu)
    return timed


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def calibrate(model: Optional[str], options: dict, repeats: int = 2, max_batch: int = 64,
              steps_out: Optional[Path] = None, clock: str = "wall", served_url: Optional[str] = None,
              served_steps: Optional[Path] = None) -> CostModel:
    """Fit the cost model to the engine's steps; with ``served_url`` (an `octavo serve` of the same model and
    options), also the served terms, fitted to its own steps when ``served_steps`` is its step record."""
    import torch

    from octavo.entrypoints.llm import LLM

    llm = LLM(model, **options)
    engine = llm.engine
    try:
        probes = default_probes(engine.max_model_len, max_batch)
        # Kernels build and caches fill on the first steps, and a step of a shape the engine has not run yet pays
        # one-off costs that a served engine has long paid (on octavo-mini a 128-token prompt joining 1-23 decodes
        # took 8.3-11.1 ms the first time, 5.1-7.7 ms the next; timing the first put a 5 ms mixed-step term in the
        # fit): the probe set runs once untimed first.
        measure(engine, warmup_probes(engine.max_model_len) + probes, 1)
        timed = measure(engine, probes, repeats)
    finally:
        llm.shutdown()
    config = engine.config
    machine = MachineInfo(
        cpu=cpu_model(),
        threads=torch.get_num_threads(),
        model=Path(config.model.model).name,
        dtype=config.model.dtype,
        octavo_version=octavo.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    shape = EngineShape(
        num_kv_blocks=engine.scheduler.kv_cache_manager.num_total_blocks,
        block_size=config.cache.block_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        decode_batch_sizes=engine.executor.model_info.decode_batch_sizes,
    )
    seconds = timed.seconds(clock)
    if steps_out is not None:
        with open(steps_out, "w") as f:
            for work, t, wall, cpu in zip(timed.works, seconds, timed.wall, timed.cpu):
                f.write(json.dumps({**dataclasses.asdict(work), "seconds": t, "wall_s": wall, "cpu_s": cpu}) + "\n")
    cost = CostModel.fit_steps(timed.works, seconds, machine, shape)
    if served_url is not None:
        cost.served = calibrate_served(served_url, cost, engine.vocab_size, steps_path=served_steps)
    return cost


@dataclass
class CalibrateConfig:
    """``octavo simulate calibrate``'s options besides the engine's."""

    output: Path = field(metadata={"help": "the cost model JSON to write", "aliases": ("-o",)})
    repeats: int = option(2, "times to run the probe set")
    max_batch: int = option(64, "largest probe batch")
    steps_out: Optional[Path] = option(None, "also write every timed step (JSONL)")
    clock: str = option("wall", "time steps on the wall clock, or on the process's CPU clock (one thread: the "
                                "engine's own work, steadier on a loaded machine)", choices=tuple(CLOCKS))
    served: Optional[str] = option(None, "URL of a running `octavo serve` of the same model and engine options: "
                                         "also fit what serving adds (the front, contention) from probes of it")
    served_steps: Optional[Path] = option(None, "that server's --step-record file: fit its served steps to its own "
                                                "steps under Poisson arrivals below, at and above saturation")


def run_calibrate(model: Optional[str], engine_options: dict[str, Any], args: CalibrateConfig) -> CostModel:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.served_steps is not None and args.served is None:
        raise ValueError("--served-steps: give the server's URL too (--served)")
    cost = calibrate(model, engine_options, args.repeats, args.max_batch, args.steps_out, args.clock, args.served,
                     args.served_steps)
    cost.save(args.output)
    print(f"cost model: {args.output} ({fit_summary(cost.fit)})")
    for kind, quality in cost.fit.by_kind.items():
        print(f"  {kind:>8} steps: {fit_summary(quality)}")
    for name, value in cost.coefficients.items():
        print(f"  {name:>26}: {value * 1e3:.4f} ms")
    if cost.served is not None:
        print(served_summary(cost.served))
    return cost


def fit_summary(fit: FitQuality) -> str:
    return (f"{fit.num_steps} steps; |error| mean {100 * fit.mean_abs_rel_error:.1f}%, "
            f"p90 {100 * fit.p90_abs_rel_error:.1f}%, median error {100 * fit.median_rel_error:+.1f}%")
