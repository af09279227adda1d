"""How long one engine step takes, as a function of the work the scheduler
put in it: a linear model fitted to step times measured on one machine.

The work of a step is read off its ``SchedulerOutput`` alone (what crosses to
the workers), so the simulator and the calibration compute it the same way.
A scheduled request computing one token is a decode; anything longer is a
prompt chunk (or a recompute after preemption, which costs the same). The
terms and why each is there:

- ``step``: a fixed cost per step (Python scheduling, the forward's launch
  overhead, detokenization) that dominates small decode batches on a CPU;
- ``prefill_tokens``: the matmuls, linear in the tokens of prompt chunks;
- ``prefill_seqs``: per chunk (its logits row, its metadata);
- ``prefill_attention_mpairs``: causal attention over a chunk is quadratic:
  a chunk of n tokens after s computed ones attends n * (s + (n + 1) / 2)
  query-key pairs (in millions);
- ``decode_seqs``: per decoding sequence (its row through the weights and
  the LM head, its sampling);
- ``decode_context_ktokens``: decode attention reads every cached token of
  every decoding sequence (in thousands);
- ``mixed_step``: 1 for a step with both prompt chunks and decodes. A decode
  step alone replays a recorded kernel tape (worker/decode_graphs.py); with a
  prompt chunk in it the step runs eagerly, its decode rows included. On
  octavo-mini one decode joining a 128-token chunk added 3.3 ms where one more
  decode in a decode batch adds 0.04 ms; without the term mixed steps were
  fitted 28% short (median), with it within 1%.
- ``decode_padding_rows``: a decode step replayed from a recording runs at
  the smallest recorded batch size that holds it (1, 2, 4, then steps of 8),
  the rows past its own padded (through the weights, attending to one
  block): on octavo-mini on an AMD EPYC (Zen 4) 9-15 decodes cost about
  what 16 do (4.7-5.3 ms, CPU time), 3 more than 4. A served engine's
  batches take every size; fitted as if a step's cost grew with its own
  rows alone, the served steps' one scale (served.py) came out 1.19 to
  cover the padded sizes and put full batches of 32, which have no padding,
  8-14% long: capacity low.

The fit is least squares on relative error (each step weighs the same
whatever its length, so millisecond decode steps are fitted as well as long
prefills) with every coefficient kept >= 0 (Lawson-Hanson): a negative cost
would let the simulator predict a step faster for having more work. On this
machine's shared CPU (load 15 on 2 cores) it fitted 465 llama-100m steps
with a mean |error| of 23% and median errors of -3% (decode) and -9%
(prefill); weighting by the predicted time instead (a gamma GLM) or not at
all left medians 12-49% off.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from octavo.core.outputs import SchedulerOutput
from octavo.simulate.fitting import nonnegative_relative_lstsq
from octavo.simulate.served import ServedCost

FEATURES = (
    "step",
    "prefill_tokens",
    "prefill_seqs",
    "prefill_attention_mpairs",
    "decode_seqs",
    "decode_context_ktokens",
    "mixed_step",
    "decode_padding_rows",
)
# 2: the mixed_step term and the served terms; 3: served mixed steps scale on their own; 4: decode padding rows
FORMAT_VERSION = 4


@dataclass(frozen=True)
class StepWork:
    """What one step computes."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    # Requests that sample a token this step (decodes and last prompt chunks): what a served engine streams.
    sampled_seqs: int = 0

    @property
    def kind(self) -> str:
        """``decode``, ``prefill`` or ``mixed``: the fit's error is reported per kind."""
        if not self.prefill_tokens:
            return "decode"
        return "mixed" if self.decode_seqs else "prefill"

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_tokens or self.decode_seqs)

    def padding_rows(self, batch_sizes: Sequence[int]) -> int:
        """The rows a decode step runs beyond its own at the recorded ``batch_sizes`` (EngineShape): 0 for a step
        with a prompt chunk (it runs eagerly), none recorded, or more decodes than the largest holds."""
        if self.kind != "decode" or not self.decode_seqs:
            return 0
        fits = [size for size in batch_sizes if size >= self.decode_seqs]
        return min(fits) - self.decode_seqs if fits else 0

    def features(self, batch_sizes: Sequence[int] = ()) -> list[float]:
        """The model's inputs, in the order of FEATURES, decode steps padded to ``batch_sizes``."""
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_seqs),
            self.prefill_attention_pairs / 1e6,
            float(self.decode_seqs),
            self.decode_context_tokens / 1e3,
            float(self.kind == "mixed"),
            float(self.padding_rows(batch_sizes)),
        ]


def step_work(scheduler_output: SchedulerOutput) -> StepWork:
    return work_of((s.num_tokens, s.start_pos, s.sample) for s in scheduler_output.scheduled)


def work_of(scheduled: Iterable[tuple[int, int, bool]]) -> StepWork:
    """A step's work from its scheduled requests' (tokens computed, first position, samples): what a
    ``SchedulerOutput`` holds, and what a served engine's step record (``--step-record``) keeps of it."""
    prefill_tokens = prefill_seqs = decode_seqs = decode_context = sampled = 0
    pairs = 0.0
    for num_tokens, start_pos, sample in scheduled:
        sampled += bool(sample)
        if num_tokens == 1:
            decode_seqs += 1
            decode_context += start_pos + 1
        else:
            prefill_seqs += 1
            prefill_tokens += num_tokens
            pairs += num_tokens * (start_pos + (num_tokens + 1) / 2)
    return StepWork(prefill_tokens, prefill_seqs, pairs, decode_seqs, decode_context, sampled)


@dataclass
class MachineInfo:
    """Where the step times were measured: a cost model holds for this only."""

    cpu: str = ""
    threads: int = 0
    model: str = ""
    dtype: str = ""
    octavo_version: str = ""
    date: str = ""


@dataclass
class EngineShape:
    """The calibrated engine's limits: the simulator's replicas default to them."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    # The batch sizes decode steps are recorded at (``ModelInfo.decode_batch_sizes``): none, every step unpadded.
    decode_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.decode_batch_sizes = tuple(self.decode_batch_sizes)  # a list as read from cost.json


@dataclass
class FitQuality:
    """How far the fitted model is from the steps it was fitted on; ``median_rel_error`` is signed (a model that
    predicts steps too short, as a fit pulled by slow outliers does, shows a negative median)."""

    num_steps: int
    mean_abs_rel_error: float
    p90_abs_rel_error: float
    median_rel_error: float = 0.0
    by_kind: dict[str, FitQuality] = field(default_factory=dict)

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray, kinds: Sequence[str] = ()) -> FitQuality:
        rel = (predicted - measured) / measured
        by_kind = {}
        for kind in sorted(set(kinds)):
            mask = np.array([k == kind for k in kinds])
            by_kind[kind] = cls.of(predicted[mask], measured[mask])
        return cls(len(rel), float(np.abs(rel).mean()), float(np.percentile(np.abs(rel), 90)),
                   float(np.median(rel)), by_kind)

    @classmethod
    def from_json(cls, data: dict) -> FitQuality:
        by_kind = {k: cls.from_json(v) for k, v in data.get("by_kind", {}).items()}
        return cls(**{**data, "by_kind": by_kind})


@dataclass
class CostModel:
    """Seconds per unit of each feature of FEATURES (all >= 0)."""

    coefficients: dict[str, float]
    machine: MachineInfo = field(default_factory=MachineInfo)
    engine: Optional[EngineShape] = None
    fit: Optional[FitQuality] = None
    # What serving adds (served.py): absent, steps cost what the bare engine's did.
    served: Optional[ServedCost] = None

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coefficients]
        if missing:
            raise ValueError(f"coefficients: missing {missing}")
        bad = [f for f, c in self.coefficients.items() if f not in FEATURES or not (c >= 0 and math.isfinite(c))]
        if bad:
            raise ValueError(f"coefficients: {bad} unknown, negative or not finite")

    def predict(self, work: StepWork) -> float:
        """The step's duration in seconds (0 for an empty step)."""
        if work.is_empty:
            return 0.0
        sizes = self.engine.decode_batch_sizes if self.engine is not None else ()
        return sum(self.coefficients[f] * x for f, x in zip(FEATURES, work.features(sizes)))

    def step_seconds(self, work: StepWork) -> float:
        """The step's duration in a served engine: the bare prediction with the served terms, when calibrated."""
        engine_s = self.predict(work)
        if self.served is None or work.is_empty:
            return engine_s
        return self.served.step_seconds(engine_s, work.sampled_seqs, work.kind == "mixed")

    @property
    def request_overhead_s(self) -> float:
        """Each request's time outside steps in a served engine (0 without a served calibration)."""
        return self.served.per_request_s if self.served is not None else 0.0

    def saturation_rate(self, prompt: int, output: int) -> float:
        """Requests/s of ``prompt`` tokens generating ``output`` that a replica of the calibrated engine finishes
        with its batch full (``max_num_seqs`` decoding): each costs what its prompt adds to a full batch's step
        (a mixed step) and ``output`` slots of that batch's decode step, so it finishes at most
        1 / (added + output * step(full batch) / full batch) a second."""
        if self.engine is None:
            raise ValueError("engine: the cost model names no engine limits (calibrate it with the engine)")
        batch = self.engine.max_num_seqs
        context = batch * (prompt + output // 2)
        step = self.step_seconds(StepWork(decode_seqs=batch, decode_context_tokens=context, sampled_seqs=batch))
        joined = self.step_seconds(StepWork(prompt, 1, prompt * (prompt + 1) / 2, batch, context, batch + 1))
        return 1.0 / (joined - step + output * step / batch)

    # ---- fitting --------------------------------------------------------

    @classmethod
    def fit_steps(
        cls,
        works: Sequence[StepWork],
        seconds: Sequence[float],
        machine: Optional[MachineInfo] = None,
        engine: Optional[EngineShape] = None,
    ) -> CostModel:
        if len(works) != len(seconds):
            raise ValueError("seconds: one measured time per step is needed")
        if len(works) < len(FEATURES):
            raise ValueError(f"steps: need at least {len(FEATURES)} measured steps to fit, got {len(works)}")
        sizes = engine.decode_batch_sizes if engine is not None else ()
        x = np.array([w.features(sizes) for w in works], dtype=np.float64)
        y = np.array(seconds, dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError("seconds: step times must be > 0")
        coef = nonnegative_relative_lstsq(x, y)
        quality = FitQuality.of(x @ coef, y, [w.kind for w in works])
        return cls(dict(zip(FEATURES, map(float, coef))), machine or MachineInfo(), engine, quality)

    # ---- files ----------------------------------------------------------

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version: expected {FORMAT_VERSION}, got {data.get('format_version')!r}")
        engine = data.get("engine")
        fit = data.get("fit")
        served = data.get("served")
        return cls(
            coefficients={k: float(v) for k, v in data["coefficients"].items()},
            machine=MachineInfo(**data.get("machine", {})),
            engine=EngineShape(**engine) if engine else None,
            fit=FitQuality.from_json(fit) if fit else None,
            served=ServedCost(**served) if served else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cost_model: cannot read {path}: {exc}") from None
        try:
            return cls.from_json(data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost_model: {path} is not a cost model file: {exc}") from None
