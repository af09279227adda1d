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
  every decoding sequence (in thousands).

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
from typing import Optional, Sequence

import numpy as np

from octavo.core.outputs import SchedulerOutput

FEATURES = (
    "step",
    "prefill_tokens",
    "prefill_seqs",
    "prefill_attention_mpairs",
    "decode_seqs",
    "decode_context_ktokens",
)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StepWork:
    """What one step computes."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_tokens or self.decode_seqs)

    def features(self) -> list[float]:
        """The model's inputs, in the order of FEATURES."""
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_seqs),
            self.prefill_attention_pairs / 1e6,
            float(self.decode_seqs),
            self.decode_context_tokens / 1e3,
        ]


def step_work(scheduler_output: SchedulerOutput) -> StepWork:
    prefill_tokens = prefill_seqs = decode_seqs = decode_context = 0
    pairs = 0.0
    for s in scheduler_output.scheduled:
        if s.num_tokens == 1:
            decode_seqs += 1
            decode_context += s.start_pos + 1
        else:
            prefill_seqs += 1
            prefill_tokens += s.num_tokens
            pairs += s.num_tokens * (s.start_pos + (s.num_tokens + 1) / 2)
    return StepWork(prefill_tokens, prefill_seqs, pairs, decode_seqs, decode_context)


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


@dataclass
class FitQuality:
    num_steps: int
    mean_abs_rel_error: float
    p90_abs_rel_error: float


@dataclass
class CostModel:
    """Seconds per unit of each feature of FEATURES (all >= 0)."""

    coefficients: dict[str, float]
    machine: MachineInfo = field(default_factory=MachineInfo)
    engine: Optional[EngineShape] = None
    fit: Optional[FitQuality] = None

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
        return sum(self.coefficients[f] * x for f, x in zip(FEATURES, work.features()))

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
        x = np.array([w.features() for w in works], dtype=np.float64)
        y = np.array(seconds, dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError("seconds: step times must be > 0")
        coef = _nonnegative_relative_lstsq(x, y)
        rel = np.abs(x @ coef - y) / y
        quality = FitQuality(len(y), float(rel.mean()), float(np.percentile(rel, 90)))
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
        return cls(
            coefficients={k: float(v) for k, v in data["coefficients"].items()},
            machine=MachineInfo(**data.get("machine", {})),
            engine=EngineShape(**engine) if engine else None,
            fit=FitQuality(**fit) if fit else None,
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


def _nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_c sum(((x c - y) / y)^2) subject to c >= 0: scipy's NNLS (Lawson and Hanson's active set) on the
    rows divided by y. Columns are scaled to unit norm first: the features differ by orders of magnitude, and the
    active-set test compares their gradients."""
    from scipy.optimize import nnls  # scipy comes with the simulate extra (statsmodels needs it too)

    a = x / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0  # a feature no step exercised keeps coefficient 0
    coef, _residual = nnls(a / norms, np.ones_like(y))
    return coef / norms
