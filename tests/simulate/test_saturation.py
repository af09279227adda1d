"""What the served calibration learns from a saturated server: the steps of more requests than the batch holds (the
scheduler's own), the fit that makes the served terms give its measured time per output token (and so what a
saturated mixed step costs), and the spread of served steps."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.replica import burst_steps
from octavo.simulate.served import SERVED_TERMS, SaturationProbe, ServedCost, ServedProbe
from octavo.simulate.traces import TraceRequest
from tests.simulate.sim_helpers import cost_model, shape, simulate

BARE = cost_model(step=0.002, prefill_tokens=1e-4, prefill_seqs=5e-4, decode_seqs=3e-4,
                  decode_context_ktokens=1e-4, mixed_step=1e-3)
SHAPE = shape(max_num_seqs=8, max_num_batched_tokens=256)
BURST = [(100, 10 + 7 * i % 30) for i in range(24)]  # three requests per batch slot, outputs of mixed lengths
SATURATED = [(100, 10 + 7 * i % 30) for i in range(96)]  # twelve per slot: a long steady state


def _served_probes(truth: ServedCost, noise_sigma: float, rng: random.Random, rounds: int = 2) -> list[ServedProbe]:
    """Lone requests and batches as a server with ``truth``'s costs shows them; lone requests stretched by a
    lognormal factor of mean 1 (``noise_sigma``), batches (means over many steps) exact."""
    probes = []
    for _ in range(rounds):
        for n in (32, 128, 256, 384):
            engine_s = BARE.predict(StepWork(n, 1, n * (n + 1) / 2, sampled_seqs=1))
            factor = rng.lognormvariate(-noise_sigma ** 2 / 2, noise_sigma) if noise_sigma else 1.0
            seconds = truth.step_seconds(engine_s, 1) * factor + truth.per_request_s
            probes.append(ServedProbe(engine_s, 1, seconds, first_token=True))
        for b in (1, 2, 4, 8):
            engine_s = BARE.predict(StepWork(decode_seqs=b, decode_context_tokens=b * 70, sampled_seqs=b))
            probes.append(ServedProbe(engine_s, b, truth.step_seconds(engine_s, b), first_token=False))
    return probes


def _steady_probe(truth: ServedCost) -> SaturationProbe:
    """The mean time per output token of a server with ``truth``'s costs kept saturated: the simulated replica's
    requests that decoded wholly in the steady state (after the first request's end, before the last one's first
    token), given more requests than it batches at one instant."""
    records = simulate([TraceRequest(0.0, p, o) for p, o in SATURATED], CostModel(BARE.coefficients, served=truth),
                       SHAPE).records
    steady_from, steady_to = min(r.finish_s for r in records), max(r.first_token_s for r in records)
    tpots = [r.tpot for r in records if r.first_token_s > steady_from and r.finish_s < steady_to]
    assert len(tpots) > len(SATURATED) // 2
    return SaturationProbe.of_steady(burst_steps(SHAPE, SATURATED), BARE.predict, statistics.fmean(tpots))


def _error(fitted: ServedCost, probe: SaturationProbe) -> float:
    """How far ``fitted``'s terms put the probe's mean step from its measured one (relative)."""
    return sum(getattr(fitted, t) * x for t, x in zip(SERVED_TERMS, probe.features())) / probe.seconds - 1


def test_a_burst_runs_every_token_within_the_engines_limits():
    steps = burst_steps(SHAPE, BURST)
    works = [s.work for s in steps]
    assert sum(w.prefill_tokens for w in works) == sum(p for p, _ in BURST)
    assert sum(w.sampled_seqs for w in works) == sum(o for _, o in BURST)
    assert all(w.prefill_seqs + w.decode_seqs <= 8 and w.prefill_tokens + w.decode_seqs <= 256 for w in works)
    # Outputs of mixed lengths: prompts join a decoding batch as others finish.
    assert sum(w.kind == "mixed" for w in works) >= len(BURST) // 2
    unfinished = [s.unfinished for s in steps]
    assert unfinished[0] == len(BURST) and unfinished[-1] >= 1 and unfinished == sorted(unfinished, reverse=True)
    # Every request gets its first token once; the last one joins as a slot frees, long before the burst's end.
    unstarted = [s.unstarted for s in steps]
    assert unstarted[0] == len(BURST) and unstarted == sorted(unstarted, reverse=True) and unstarted[-1] == 0
    assert all(s.unfinished - s.unstarted <= 8 for s in steps)  # those decoding hold the batch's slots
    assert burst_steps(SHAPE, BURST) == steps  # no randomness in which steps run


def test_a_saturated_replica_steps_at_the_probes_mean_step():
    """The simulated replica, kept saturated, decodes at the mean of the steady steps the probe takes from the
    scheduler: its terms' weighted sum is the requests' time per output token."""
    truth = ServedCost(engine_scale=1.5, mixed_scale=0.8, per_step_s=0.003, per_token_s=0.001, per_request_s=0.05)
    probe = _steady_probe(truth)
    assert abs(_error(truth, probe)) < 0.03
    assert probe.mixed_engine_s > 0 and probe.sampled == pytest.approx(8, rel=0.1)  # a full batch, prompts joining
    with pytest.raises(ValueError, match="steps"):  # no more requests than slots: nothing waits, no steady state
        SaturationProbe.of_steady(burst_steps(SHAPE, BURST[:8]), BARE.predict, 0.01)


def test_the_fit_gives_a_saturated_server_its_measured_step():
    """Short batches show 0.5 ms per streamed token; a saturated server pays 1 ms. The ordinary probes alone put
    its steps short (capacity high); with the saturated probe the fit meets it."""
    light = ServedCost(engine_scale=1.5, mixed_scale=1.5, per_step_s=0.003, per_token_s=0.0005, per_request_s=0.02)
    heavy = ServedCost(engine_scale=1.5, mixed_scale=1.5, per_step_s=0.003, per_token_s=0.001, per_request_s=0.02)
    probes = _served_probes(light, 0.0, random.Random(0))
    saturated = _steady_probe(heavy)
    without = ServedCost.fit(probes)
    fitted = ServedCost.fit(probes, saturation=[saturated])
    assert _error(without, saturated) < -0.05
    assert abs(_error(fitted, saturated)) < 0.01
    assert fitted.saturation_probes == 1
    assert fitted.saturation_rel_error == pytest.approx(_error(fitted, saturated), abs=1e-9)
    assert fitted.num_probes == len(probes) and without.saturation_probes == 0


def test_the_saturated_server_sets_what_a_mixed_step_costs():
    """Only the saturated probe runs mixed steps (prompts joining a decoding batch). A server whose mixed steps
    take 0.7 of the bare prediction, while its prompt and decode steps take 1.5 of theirs: the fit finds both,
    and without it mixed steps scale as the others."""
    truth = ServedCost(engine_scale=1.5, mixed_scale=0.7, per_step_s=0.003, per_token_s=0.001, per_request_s=0.02)
    probes = _served_probes(truth, 0.0, random.Random(4))
    fitted = ServedCost.fit(probes, saturation=[_steady_probe(truth)])
    assert fitted.mixed_scale == pytest.approx(0.7, rel=0.05)
    assert fitted.engine_scale == pytest.approx(1.5, rel=0.02)
    assert fitted.per_token_s == pytest.approx(0.001, rel=0.05)
    without = ServedCost.fit(probes)
    assert without.mixed_scale == without.engine_scale == pytest.approx(1.5, rel=0.02)


def test_the_step_spread_is_the_lone_requests_log_residuals():
    truth = ServedCost(engine_scale=1.5, per_step_s=0.003, per_token_s=0.001, per_request_s=0.0)
    noisy = ServedCost.fit(_served_probes(truth, 0.3, random.Random(1), rounds=100))
    assert noisy.step_noise_sigma == pytest.approx(0.3, rel=0.15)
    assert ServedCost.fit(_served_probes(truth, 0.0, random.Random(1))).step_noise_sigma < 1e-6
    with pytest.raises(ValueError, match="served.step_noise_sigma"):
        ServedCost(step_noise_sigma=-0.1)


def test_a_prompt_length_the_terms_miss_is_no_noise():
    """Lone requests of 32 tokens take 1.6x what the terms can give them, every time: repeats agree, no spread."""
    truth = ServedCost(engine_scale=1.5, per_step_s=0.003, per_token_s=0.001, per_request_s=0.0)
    probes = [ServedProbe(p.engine_s, p.sampled, p.seconds * (1.6 if p.first_token and i % 8 == 0 else 1.0),
                          p.first_token) for i, p in enumerate(_served_probes(truth, 0.0, random.Random(3), 3))]
    fitted = ServedCost.fit(probes)
    assert fitted.mean_abs_rel_error > 0.02 and fitted.step_noise_sigma < 1e-6


def test_a_step_factor_has_mean_one_and_draws_nothing_without_a_spread():
    rng = random.Random(2)
    factors = [ServedCost(step_noise_sigma=0.5).step_factor(rng) for _ in range(20_000)]
    assert statistics.fmean(factors) == pytest.approx(1.0, rel=0.03)
    assert statistics.stdev(math.log(f) for f in factors) == pytest.approx(0.5, rel=0.03)
    state = rng.getstate()
    assert ServedCost().step_factor(rng) == 1.0 and rng.getstate() == state


def test_simulated_steps_spread_with_the_fitted_spread_and_replay_with_the_seed():
    """Lone requests a minute apart: each first token is one served prefill, stretched by its own factor."""
    served = CostModel(BARE.coefficients, served=ServedCost(engine_scale=2.0, step_noise_sigma=0.4))
    trace = [TraceRequest(60.0 * i, 200, 1) for i in range(400)]
    ttfts = [r.ttft for r in simulate(trace, served, SHAPE, seed=3).records]
    prefill = served.step_seconds(StepWork(200, 1, 200 * 201 / 2, sampled_seqs=1))
    assert statistics.fmean(ttfts) == pytest.approx(prefill, rel=0.08)
    assert statistics.stdev(math.log(t) for t in ttfts) == pytest.approx(0.4, rel=0.15)
    assert [r.ttft for r in simulate(trace, served, SHAPE, seed=3).records] == ttfts
    assert [r.ttft for r in simulate(trace, served, SHAPE, seed=4).records] != ttfts
