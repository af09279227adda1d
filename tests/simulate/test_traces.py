"""Trace generators match their parameters; recorded traces load or fail naming the line and field."""
from __future__ import annotations

import math
import random

import pytest

from octavo.simulate.traces import LengthDist, TraceRequest, TraceSpec, generate, load_jsonl, save_jsonl

FIXED = LengthDist.parse("fixed:10")


def _within(count: int, expected: float, sigmas: float = 4.0) -> bool:
    return abs(count - expected) <= sigmas * math.sqrt(expected)


def test_poisson_rate_and_gaps():
    trace = generate(TraceSpec("poisson", 2000.0, 3.0, FIXED, FIXED), seed=1)
    assert _within(len(trace), 6000)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    # Exponential gaps: mean 1/rate, and the coefficient of variation is 1.
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(1 / 3, rel=0.05)
    assert sd / mean == pytest.approx(1.0, abs=0.06)


def test_bursty_long_run_rate_and_bursts():
    spec = TraceSpec("bursty", 20000.0, 0.5, FIXED, FIXED, burst_rate=5.0, on_s=10.0, off_s=40.0)
    trace = generate(spec, seed=2)
    expected = (0.5 * 40 + 5.0 * 10) / 50  # time-weighted mean of the two rates
    assert len(trace) / spec.duration_s == pytest.approx(expected, rel=0.1)
    # Overdispersed: counts per 10 s vary far more than a Poisson process's would.
    counts = [0] * 2000
    for r in trace:
        counts[int(r.arrival_s // 10)] += 1
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / len(counts)
    assert var / mean > 3


def test_diurnal_follows_its_sine_and_burst():
    spec = TraceSpec("diurnal", 4000.0, 2.0, FIXED, FIXED, amplitude=0.8, period_s=4000.0,
                     burst_at_s=3000.0, burst_s=200.0, burst_factor=3.0)
    trace = generate(spec, seed=3)

    def count(a: float, b: float) -> int:
        return sum(a <= r.arrival_s < b for r in trace)

    def expected(a: float, b: float, factor: float = 1.0) -> float:
        # Integral of rate * (1 - amplitude * cos(2 pi t / period)) over [a, b).
        w = 2 * math.pi / spec.period_s
        return factor * spec.rate * ((b - a) - 0.8 * (math.sin(w * b) - math.sin(w * a)) / w)

    assert _within(count(0, 500), expected(0, 500))  # the night
    assert _within(count(1750, 2250), expected(1750, 2250))  # the peak
    assert _within(count(3000, 3200), expected(3000, 3200, factor=3.0))  # the burst
    assert count(1750, 2250) > 4 * count(0, 500)


def test_lengths_follow_their_distribution():
    rng = random.Random(0)
    uniform = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(5000)]
    assert min(uniform) == 10 and max(uniform) == 20
    assert sum(uniform) / len(uniform) == pytest.approx(15, abs=0.3)
    logn = sorted(LengthDist.parse("lognormal:100:0.5:1:10000").sample(rng) for _ in range(5001))
    assert logn[2500] == pytest.approx(100, rel=0.05)  # the median
    assert FIXED.sample(rng) == 10
    for bad in ("fixed:0", "uniform:5:2", "lognormal:100", "normal:3", "fixed:x"):
        with pytest.raises(ValueError, match="prompt_len"):
            LengthDist.parse(bad, "prompt_len")


def test_same_seed_same_trace():
    spec = TraceSpec("bursty", 300.0, 1.0, LengthDist.parse("uniform:1:100"), FIXED, burst_rate=4.0)
    assert generate(spec, seed=5) == generate(spec, seed=5)
    assert generate(spec, seed=5) != generate(spec, seed=6)


def test_jsonl_round_trip_and_errors(tmp_path):
    trace = [TraceRequest(0.5, 12, 3), TraceRequest(1.25, 7, 9)]
    save_jsonl(trace, tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 1}\n'
                                        '{"arrival_s": 1, "prompt_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field output_tokens"):
        load_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "neg.jsonl").write_text('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match="prompt_tokens"):
        load_jsonl(tmp_path / "neg.jsonl")
    with pytest.raises(ValueError, match="trace"):
        TraceSpec("sawtooth", 10.0, 1.0, FIXED, FIXED)


def test_the_serving_benchmark_records_a_loadable_trace(tmp_path):
    """benchmarks/serve.py --trace-out: what a real server served, replayable in the simulator."""
    from benchmarks.serve import Result, write_trace

    results = [Result(ok=True, prompt_tokens=30, output_tokens=8, sent=105.5),
               Result(ok=True, prompt_tokens=12, output_tokens=64, sent=100.25),
               Result(ok=False, error="HTTP 503", sent=101.0)]
    write_trace(results, str(tmp_path / "rec.jsonl"))
    assert load_jsonl(tmp_path / "rec.jsonl") == [TraceRequest(0.0, 12, 64), TraceRequest(5.25, 30, 8)]
