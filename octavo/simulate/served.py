"""What a served engine's steps cost beyond the bare engine steps the cost
model was fitted on, fitted to what clients of a real `octavo serve` measure.

A served engine shares its cores with the HTTP front (tokenizing prompts,
detokenizing and streaming every token as an SSE chunk) and, on a shared
machine, with other work. Bare engine steps miss all of it: on a 2-core
machine at load 10, served decode steps of ~30 sequences took ~100 ms where
the bare fit predicted ~14 ms. A served step is modelled as

    served(step) = engine_scale * engine(step) + per_step_s + per_token_s * sampled

- ``engine_scale``: the engine's own work stretched by contention for the
  cores (the front, other processes); 1 on cores of its own, and never less;
- ``per_step_s``: per step, the output message to the front and its wake-up;
- ``per_token_s``: per token streamed, the front's detokenizing and SSE
  writing, which competes with the engine for the same cores and so grows
  with the batch (this is what saturates a served engine sooner);

and each request waits ``per_request_s`` outside steps (HTTP, tokenizing,
the first chunk's way back). The terms are fitted together by non-negative
least squares on relative error to two kinds of probe: lone requests (their
time to first token, at the client: one prefill step plus the per-request
cost) and batches of requests sent together (their time per output token, as
the server's front measured it: one decode step of the batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from octavo.simulate.fitting import nonnegative_relative_lstsq

SERVED_TERMS = ("engine_scale", "per_step_s", "per_token_s", "per_request_s")


@dataclass(frozen=True)
class ServedProbe:
    """One measurement of one served step, whose bare prediction is ``engine_s`` and which streams ``sampled``
    tokens: ``first_token``, a lone request's time to first token (the per-request cost included); else a
    batch's mean time per output token (one decode step of the batch)."""

    engine_s: float
    sampled: int
    seconds: float
    first_token: bool

    def features(self) -> list[float]:
        """The fit's inputs, in the order of SERVED_TERMS."""
        return [self.engine_s, 1.0, float(self.sampled), float(self.first_token)]


@dataclass
class ServedCost:
    """The served-engine terms (module docstring); ``load_avg``: the machine's 1/5/15-minute load when measured,
    as the scale holds for a similar load only."""

    engine_scale: float = 1.0
    per_step_s: float = 0.0
    per_token_s: float = 0.0
    per_request_s: float = 0.0
    num_probes: int = 0
    mean_abs_rel_error: float = 0.0
    load_avg: str = ""

    def __post_init__(self) -> None:
        for name in SERVED_TERMS:
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"served.{name} must be finite and >= 0, got {value}")

    def step_seconds(self, engine_s: float, sampled: int) -> float:
        return self.engine_scale * engine_s + self.per_step_s + self.per_token_s * sampled

    @classmethod
    def fit(cls, probes: Sequence[ServedProbe], load_avg: str = "") -> ServedCost:
        if len(probes) < len(SERVED_TERMS):
            raise ValueError(f"probes: need at least {len(SERVED_TERMS)} served measurements, got {len(probes)}")
        if {p.first_token for p in probes} != {True, False}:
            raise ValueError("probes: need both lone requests' first tokens and batches' decode steps")
        x = np.array([p.features() for p in probes], dtype=np.float64)
        y = np.array([p.seconds for p in probes], dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError("probes: measured seconds must be > 0")
        # A served step takes at least the engine's own time (one thread: wall >= CPU time): engine_scale >= 1.
        # Left free, the fit traded it for the per-token term, which the decode probes cannot tell apart (both
        # grow with the batch), and put it at 0.1-0.7, making prompt steps under load too short.
        coef = nonnegative_relative_lstsq(x, y, lower=np.array([1.0, 0.0, 0.0, 0.0]))
        error = float(np.mean(np.abs(x @ coef - y) / y))
        return cls(*map(float, coef), num_probes=len(probes), mean_abs_rel_error=error, load_avg=load_avg)
