"""What a served engine's steps cost beyond the bare engine steps the cost
model was fitted on, fitted to what clients of a real `octavo serve` measure.

A served engine shares its cores with the HTTP front (tokenizing prompts,
detokenizing and streaming every token as an SSE chunk) and, on a shared
machine, with other work. Bare engine steps miss all of it: on a 2-core
machine at load 10, served decode steps of ~30 sequences took ~100 ms where
the bare fit predicted ~14 ms. A served step is modelled as

    served(step) = scale * engine(step) + per_step_s + per_token_s * sampled

- ``engine_scale`` (prompt-only and decode-only steps) and ``mixed_scale``
  (steps holding both): the engine's own work stretched by contention for
  the cores (the front, other processes). Each step kind's scale is fitted
  from the probes that run that kind (below): the bare calibration's mixed
  steps are one prompt joining a batch per step, and a served engine's mixed
  steps (prompts joining a full batch as others finish, its front streaming
  every sequence) need not cost what those predict;
- ``per_step_s``: per step, the output message to the front and its wake-up;
- ``per_token_s``: per token streamed, the front's detokenizing and SSE
  writing, which competes with the engine for the same cores and so grows
  with the batch (this is what saturates a served engine sooner);

and each request waits ``per_request_s`` outside steps (HTTP, tokenizing,
the first chunk's way back). The terms are fitted together by non-negative
least squares on relative error to three kinds of probe:

- lone requests: their time to first token, at the client (one prefill step
  plus the per-request cost);
- batches of requests sent together: their time per output token, as the
  server's front measured it (one decode step of the batch);
- the server kept saturated (``SaturationProbe``): twice as many clients as
  the batch holds, each sending its next request as its last ends. The only
  probe that runs a saturated engine, whose mixed steps (prompts joining the
  full batch as others finish) are what capacity is made of. Its requests'
  mean time per output token is read from the server's histogram, and the
  scheduler says which steps a saturated engine runs; it weighs in the fit
  as a constraint (``SATURATION_WEIGHT``). A steady state, not a burst sent
  at once: a burst's replay is much of it its first steps (ten prompts
  prefilled at once) and its drain, which a server past saturation hardly
  runs; fitted to bursts at load 14 on 2 cores, the simulated replica
  saturated at 8.4 requests/s where the real one still decoded at 2.4 ms a
  token at 12.6.

Given the server's step record (``served_steps.py``), ``fit_steps`` fits the
step terms to the server's own steps instead, under Poisson arrivals below,
at and above saturation, and the per-request cost to the lone requests.

Steps of equal work still take different times on a shared machine (other
processes stall the engine, the client and the front). ``step_noise_sigma``
is the spread of the lone requests' log residuals among repeats of one
prompt length, each one served prefill: the simulator multiplies every step
by a lognormal factor of mean 1 with it. Fitted to the server's own steps,
the steps themselves are kept as a ``SpeedTape`` (speed_tape.py): the
simulator replays how fast the engine got through its work moment by
moment, slow stretches in the runs they came in, in place of a stretch drawn
afresh for every step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from octavo.simulate.fitting import nonnegative_relative_lstsq
from octavo.simulate.speed_tape import SpeedTape

if TYPE_CHECKING:
    from octavo.simulate.cost_model import StepWork
    from octavo.simulate.replica import BurstStep
    from octavo.simulate.served_steps import ServedStep

SERVED_TERMS = ("engine_scale", "mixed_scale", "per_step_s", "per_token_s", "per_request_s")
# How much a saturation probe's row weighs against one ordinary probe's: enough that the fit honours it to ~1%
# (a penalty in place of an equality constraint, which NNLS lacks) while the others still set the split of terms.
SATURATION_WEIGHT = 30.0


@dataclass(frozen=True)
class ServedProbe:
    """One measurement of one served step, whose bare prediction is ``engine_s`` and which streams ``sampled``
    tokens: ``first_token``, a lone request's time to first token (the per-request cost included); else a
    batch's mean time per output token (one decode step of the batch). Neither holds a mixed step."""

    engine_s: float
    sampled: int
    seconds: float
    first_token: bool

    def features(self) -> list[float]:
        """The fit's inputs, in the order of SERVED_TERMS."""
        return [self.engine_s, 0.0, 1.0, float(self.sampled), float(self.first_token)]


@dataclass(frozen=True)
class SaturationProbe:
    """A server kept saturated (more requests in flight than the batch holds, each client sending its next one
    as its last ends), whose requests' mean time per output token was ``seconds``: in that steady state every
    decoding request gets one token a step, so it is the mean served step of the saturated engine, which sets its
    capacity. ``engine_s`` and ``mixed_engine_s`` are the weighted means of the bare predictions of the steady
    steps (``of_steady``) of one kind (prompts or decodes) and of the mixed ones, each over all of them,
    ``sampled`` of their streamed tokens."""

    engine_s: float
    mixed_engine_s: float
    sampled: float
    seconds: float

    @classmethod
    def of_steady(cls, steps: Sequence[BurstStep], predict: Callable[[StepWork], float],
                  seconds: float) -> SaturationProbe:
        """From the steps (``replica.burst_steps``) of more requests than the batch holds, queued at once: those
        from the first request's end to the last one's start are the steady state (a slot frees, a waiting
        request takes it). Each weighs as the requests decoding through it, as in their mean time per token."""
        steady = [s for s in steps if s.unfinished < steps[0].unfinished and s.unstarted]
        if not steady:
            raise ValueError("steps: no request waits while others finish: not a saturated engine's steps")
        total = sum(s.unfinished - s.unstarted for s in steady)
        weights = [(s.unfinished - s.unstarted) / total for s in steady]
        mixed = [s.work.kind == "mixed" for s in steady]
        engine = [w * predict(s.work) for w, s in zip(weights, steady)]
        return cls(sum(e for e, m in zip(engine, mixed) if not m), sum(e for e, m in zip(engine, mixed) if m),
                   sum(w * s.work.sampled_seqs for w, s in zip(weights, steady)), seconds)

    def features(self) -> list[float]:
        """The fit's inputs, in the order of SERVED_TERMS: one step, no per-request cost (paid before the first
        token)."""
        return [self.engine_s, self.mixed_engine_s, 1.0, self.sampled, 0.0]


@dataclass
class ServedCost:
    """The served-engine terms (module docstring); ``load_avg``: the machine's 1/5/15-minute load when measured,
    as the scale holds for a similar load only."""

    engine_scale: float = 1.0
    mixed_scale: float = 1.0
    per_step_s: float = 0.0
    per_token_s: float = 0.0
    per_request_s: float = 0.0
    num_probes: int = 0
    mean_abs_rel_error: float = 0.0
    load_avg: str = ""
    step_noise_sigma: float = 0.0
    # The saturation probes: how many, and the fitted terms' signed error on their time per output token.
    saturation_probes: int = 0
    saturation_rel_error: float = 0.0
    # Fitted to the server's own steps (``fit_steps``): how many, and the signed error of the fitted terms and
    # the stretch's mean on their total time (what sets capacity).
    served_steps: int = 0
    served_steps_total_rel_error: float = 0.0
    # The log-mean of a step's stretch: None for -sigma^2 / 2 (a stretch of mean 1, the terms fitted to mean
    # times), 0 for a median of 1 (the terms fitted to a typical step, the stretch adding the stalls).
    step_noise_mu: Optional[float] = None
    # Fitted to the server's own steps: those steps, replayed in place of independent stretches (speed_tape.py).
    speed_tape: Optional[SpeedTape] = None

    def __post_init__(self) -> None:
        if isinstance(self.speed_tape, dict):  # as read from cost.json
            self.speed_tape = SpeedTape(**self.speed_tape)
        for name in (*SERVED_TERMS, "step_noise_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"served.{name} must be finite and >= 0, got {value}")

    def step_seconds(self, engine_s: float, sampled: int, mixed: bool = False) -> float:
        scale = self.mixed_scale if mixed else self.engine_scale
        return scale * engine_s + self.per_step_s + self.per_token_s * sampled

    @classmethod
    def fit(cls, probes: Sequence[ServedProbe], load_avg: str = "",
            saturation: Sequence[SaturationProbe] = ()) -> ServedCost:
        if len(probes) < len(SERVED_TERMS):
            raise ValueError(f"probes: need at least {len(SERVED_TERMS)} served measurements, got {len(probes)}")
        if {p.first_token for p in probes} != {True, False}:
            raise ValueError("probes: need both lone requests' first tokens and batches' decode steps")
        rows = [p.features() for p in probes] + [s.features() for s in saturation]
        x = np.array(rows, dtype=np.float64)
        y = np.array([p.seconds for p in [*probes, *saturation]], dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError("probes: measured seconds must be > 0")
        weights = np.array([1.0] * len(probes) + [SATURATION_WEIGHT] * len(saturation))
        # A prompt or decode step takes at least the engine's own time (one thread: wall >= CPU time):
        # engine_scale >= 1. Left free, the fit traded it for the per-token term, which the decode probes cannot
        # tell apart (both grow with the batch), and put it at 0.1-0.7, making prompt steps under load too short.
        # The mixed scale is free: the saturated server measures it (docstring).
        coef = nonnegative_relative_lstsq(x, y, lower=np.array([1.0, 0.0, 0.0, 0.0, 0.0]), weights=weights)
        if not np.any(x[:, 1]):  # no probe ran a mixed step: mixed steps scale as the others
            coef[1] = coef[0]
        rel = x @ coef / y - 1
        ordinary, saturated = rel[: len(probes)], rel[len(probes):]
        return cls(*map(float, coef), num_probes=len(probes), mean_abs_rel_error=float(np.mean(np.abs(ordinary))),
                   load_avg=load_avg, step_noise_sigma=_lone_spread(probes, ordinary),
                   saturation_probes=len(saturation),
                   saturation_rel_error=float(np.mean(saturated)) if len(saturation) else 0.0)

    @classmethod
    def fit_steps(cls, steps: Sequence[ServedStep], predict: Callable[[StepWork], float],
                  lone: Sequence[ServedProbe], load_avg: str = "") -> ServedCost:
        """The step terms fitted to a served engine's own steps (``served_steps.py``), each step's time from its
        start to the next one's against its bare prediction ``predict``; ``per_request_s`` from the lone
        requests: their median time to first token beyond their served prefill step.

        Least squares on relative error, so the terms describe a typical step, and a stretch of median 1 with
        the spread of the steps' log residuals adds the stalls (``step_noise_mu`` = 0). Stalls come and go with
        the other work on the machine: at load 9, two calibrations' steps had log residuals of mean 0.31 and
        0.61 (spread 0.61-0.65) about such terms, the steps of a validation a few minutes later 0.10 and 0.23.
        Fitted to the calibration's mean times (least squares on absolute error), the terms put the
        validation's steps 45-68% long in total; a median of 1 and that spread, 3-13% short."""
        if len(steps) < len(SERVED_TERMS):
            raise ValueError(f"served_steps: need at least {len(SERVED_TERMS)} steps, got {len(steps)}")
        if not any(p.first_token for p in lone):
            raise ValueError("probes: need lone requests' first tokens (the per-request cost)")
        engine = np.array([predict(s.work) for s in steps])
        mixed = np.array([s.work.kind == "mixed" for s in steps])
        x = np.column_stack([np.where(mixed, 0.0, engine), np.where(mixed, engine, 0.0), np.ones(len(steps)),
                             [s.work.sampled_seqs for s in steps]])
        y = np.array([s.seconds for s in steps])
        # engine_scale >= 1: as in ``fit`` (wall >= CPU time for the engine's one thread).
        coef = nonnegative_relative_lstsq(x, y, lower=np.array([1.0, 0.0, 0.0, 0.0]))
        if not mixed.any():
            coef[1] = coef[0]
        predicted = x @ coef
        sigma = float(np.std(np.log(y / predicted)))
        served = cls(*map(float, coef), load_avg=load_avg, served_steps=len(steps), step_noise_sigma=sigma,
                     step_noise_mu=0.0, speed_tape=SpeedTape.of_steps(y, predicted),
                     served_steps_total_rel_error=float(predicted.sum() * np.exp(sigma ** 2 / 2) / y.sum() - 1))
        firsts = [p for p in lone if p.first_token]
        prefills = np.array([served.step_seconds(p.engine_s, p.sampled) for p in firsts])
        measured = np.array([p.seconds for p in firsts])
        served.per_request_s = max(0.0, float(np.median(measured - prefills)))
        served.num_probes = len(firsts)
        served.mean_abs_rel_error = float(np.mean(np.abs(prefills + served.per_request_s - measured) / measured))
        return served

    def step_factor(self, rng: random.Random) -> float:
        """A step's random stretch: lognormal of spread ``step_noise_sigma`` and log-mean ``step_noise_mu`` (mean 1
        when that is None; 1 without a fitted spread, drawing nothing)."""
        if not self.step_noise_sigma:
            return 1.0
        mu = -self.step_noise_sigma ** 2 / 2 if self.step_noise_mu is None else self.step_noise_mu
        return rng.lognormvariate(mu, self.step_noise_sigma)


def _lone_spread(probes: Sequence[ServedProbe], rel: np.ndarray) -> float:
    """The spread of single served steps: each lone request is one served prefill, and its repeats (same prompt
    length, same prediction) differ by noise alone. Their log residuals' standard deviation pooled within each
    prompt length, so a length the linear terms miss does not count as noise (with a burst weighing in at load
    10, the fit missed the probes by 81% on average)."""
    groups: dict[float, list[float]] = {}
    for probe, r in zip(probes, rel):
        if probe.first_token:
            groups.setdefault(probe.engine_s, []).append(float(np.log1p(r)))
    squares = sum(float(np.sum((np.array(g) - np.mean(g)) ** 2)) for g in groups.values())
    freedom = sum(len(g) - 1 for g in groups.values())
    return float(np.sqrt(squares / freedom)) if freedom else 0.0