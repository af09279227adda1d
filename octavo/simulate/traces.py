"""Request arrival traces: generated (Poisson, bursty, diurnal) or recorded.

A trace is a list of ``TraceRequest`` sorted by arrival. The recorded format
is JSON Lines, one request a line, times in seconds from the trace's start::

    {"arrival_s": 0.173, "prompt_tokens": 212, "output_tokens": 64}

(other keys are ignored). ``benchmarks/serve.py --trace-out FILE`` writes
this for the requests it sent to a real server, so a measured run can be
replayed in the simulator.

Generated arrivals:
- ``poisson``: exponential gaps at a constant rate;
- ``bursty``: a two-state Markov-modulated Poisson process (on/off): the
  rate switches between ``rate`` and ``burst_rate`` after exponentially
  distributed stays of mean ``off_s`` and ``on_s``;
- ``diurnal``: a sinusoidal rate over a (compressed) day, mean ``rate``,
  peak ``rate * (1 + amplitude)`` at mid-period, optionally multiplied by
  ``burst_factor`` during ``[burst_at_s, burst_at_s + burst_s)``; drawn by
  thinning (Lewis and Shedler) from a Poisson process at the peak rate.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

TRACE_KINDS = ("poisson", "bursty", "diurnal")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, written ``fixed:N``, ``uniform:LO:HI`` or
    ``lognormal:MEDIAN:SIGMA[:LO:HI]`` (clipped to [LO, HI], default [1, 8*MEDIAN])."""

    kind: str
    a: float
    b: float = 0.0
    low: int = 1
    high: int = 1

    @classmethod
    def parse(cls, text: str, name: str = "length") -> LengthDist:
        parts = text.split(":")
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"{name}: numbers expected in {text!r}") from None
        kind = parts[0]
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0], low=int(nums[0]), high=int(nums[0]))
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1], int(nums[0]), int(nums[1]))
        if kind == "lognormal" and len(nums) in (2, 4) and nums[0] >= 1 and nums[1] >= 0:
            low, high = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, int(8 * nums[0]))
            if 1 <= low <= high:
                return cls("lognormal", nums[0], nums[1], low, high)
        raise ValueError(
            f"{name}: {text!r} is not fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:LO:HI] (lengths >= 1)"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return max(self.low, min(self.high, round(rng.lognormvariate(math.log(self.a), self.b))))


@dataclass(frozen=True)
class TraceSpec:
    """A generated trace's parameters (rates in requests per second)."""

    kind: str
    duration_s: float
    rate: float
    prompt: LengthDist
    output: LengthDist
    burst_rate: float = 0.0  # bursty: the "on" rate
    on_s: float = 10.0  # bursty: mean stay in the burst
    off_s: float = 50.0  # bursty: mean stay at the base rate
    amplitude: float = 0.8  # diurnal: peak-to-mean, relative
    period_s: float = 3600.0  # diurnal: one compressed day
    burst_at_s: Optional[float] = None  # diurnal: an extra burst
    burst_s: float = 0.0
    burst_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise ValueError(f"trace: {self.kind!r} is not one of {TRACE_KINDS} (or a .jsonl file)")
        for name in ("duration_s", "rate", "on_s", "off_s", "period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kind == "bursty" and not self.burst_rate > 0:
            raise ValueError(f"burst_rate must be > 0 for a bursty trace, got {self.burst_rate}")
        if not 0 <= self.amplitude <= 1:
            raise ValueError(f"amplitude must be in [0, 1], got {self.amplitude}")
        if self.burst_factor < 1 or self.burst_s < 0:
            raise ValueError("burst_factor must be >= 1 and burst_s >= 0")


def generate(spec: TraceSpec, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    if spec.kind == "poisson":
        times = _poisson(rng, spec.rate, 0.0, spec.duration_s)
    elif spec.kind == "bursty":
        times = _on_off(rng, spec)
    else:
        times = _thinned(rng, diurnal_rate(spec), spec.rate * (1 + spec.amplitude) * spec.burst_factor,
                         spec.duration_s)
    return [TraceRequest(t, spec.prompt.sample(rng), spec.output.sample(rng)) for t in times]


def diurnal_rate(spec: TraceSpec) -> Callable[[float], float]:
    """The diurnal trace's rate at time t: lowest at t = 0, highest at period / 2."""

    def rate(t: float) -> float:
        r = spec.rate * (1 - spec.amplitude * math.cos(2 * math.pi * t / spec.period_s))
        if spec.burst_at_s is not None and spec.burst_at_s <= t < spec.burst_at_s + spec.burst_s:
            r *= spec.burst_factor
        return r

    return rate


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times, t = [], start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)


def _on_off(rng: random.Random, spec: TraceSpec) -> list[float]:
    times: list[float] = []
    t, on = 0.0, False
    while t < spec.duration_s:
        stay = rng.expovariate(1 / (spec.on_s if on else spec.off_s))
        end = min(t + stay, spec.duration_s)
        times += _poisson(rng, spec.burst_rate if on else spec.rate, t, end)
        t, on = end, not on
    return times


def _thinned(rng: random.Random, rate: Callable[[float], float], peak: float, end: float) -> list[float]:
    return [t for t in _poisson(rng, peak, 0.0, end) if rng.random() * peak < rate(t)]


# ---- recorded traces ----------------------------------------------------


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    """A recorded trace; ValueError naming the line and field for a bad one."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"trace: cannot read {path}: {exc.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(TraceRequest(float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])))
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace: {path}:{i}: not JSON ({exc.msg})") from None
        except KeyError as exc:
            raise ValueError(f"trace: {path}:{i}: field {exc.args[0]} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trace: {path}:{i}: {exc}") from None
    if not out:
        raise ValueError(f"trace: {path} holds no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def save_jsonl(trace: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({"arrival_s": round(r.arrival_s, 6), "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens}) + "\n")
