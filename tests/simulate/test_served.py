"""The served-engine terms: their fit, the served step they predict, and what
they do to a simulated replica (contention for the cores saturates it sooner)."""
from __future__ import annotations

import random

import pytest

from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.report import SLO, summarize
from octavo.simulate.served import SERVED_TERMS, ServedCost, ServedProbe
from octavo.simulate.traces import LengthDist, TraceRequest, TraceSpec, generate
from tests.simulate.sim_helpers import cost_model, simulate

BARE = cost_model(step=0.002, prefill_tokens=1e-4, prefill_seqs=5e-4, decode_seqs=3e-4,
                  decode_context_ktokens=1e-4)
# Without bursts (no probe runs a mixed step) the fit gives mixed steps the scale of the others.
TRUE = ServedCost(engine_scale=2.5, mixed_scale=2.5, per_step_s=0.004, per_token_s=0.0015, per_request_s=0.02)


def _probes(truth: ServedCost, noise: float, rng: random.Random) -> list[ServedProbe]:
    """What a server with ``truth``'s costs would show, with multiplicative noise: lone requests' first tokens,
    and batches' decode steps."""
    probes = []
    for n in (32, 128, 256, 384, 32, 128, 256, 384):
        engine_s = BARE.predict(StepWork(n, 1, n * (n + 1) / 2, sampled_seqs=1))
        seconds = truth.step_seconds(engine_s, 1) + truth.per_request_s
        probes.append(ServedProbe(engine_s, 1, seconds * rng.uniform(1 - noise, 1 + noise), first_token=True))
    for b in (1, 2, 4, 8, 16, 32, 1, 4, 16, 32):
        engine_s = BARE.predict(StepWork(decode_seqs=b, decode_context_tokens=b * 70, sampled_seqs=b))
        seconds = truth.step_seconds(engine_s, b)
        probes.append(ServedProbe(engine_s, b, seconds * rng.uniform(1 - noise, 1 + noise), first_token=False))
    return probes


def test_fit_recovers_the_served_terms():
    fitted = ServedCost.fit(_probes(TRUE, 0.01, random.Random(0)), load_avg="3.00/2.00/1.00")
    for name in SERVED_TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    assert fitted.num_probes == 18 and fitted.mean_abs_rel_error < 0.02 and fitted.load_avg == "3.00/2.00/1.00"


def test_fit_needs_both_kinds_of_probe():
    probes = _probes(TRUE, 0.0, random.Random(1))
    with pytest.raises(ValueError, match="probes"):
        ServedCost.fit([p for p in probes if not p.first_token])
    with pytest.raises(ValueError, match="probes"):
        ServedCost.fit(probes[:3])
    with pytest.raises(ValueError, match="served.engine_scale"):
        ServedCost(engine_scale=-1.0)


def test_a_served_step_scales_the_engine_and_pays_per_streamed_token():
    served = CostModel(BARE.coefficients, served=TRUE)
    work = StepWork(64, 1, 64 * 65 / 2, 8, 800, sampled_seqs=9)
    assert served.step_seconds(work) == pytest.approx(2.5 * BARE.predict(work) + 0.004 + 9 * 0.0015)
    assert BARE.step_seconds(work) == BARE.predict(work)  # no served calibration: the bare step
    assert served.step_seconds(StepWork()) == 0.0


def test_the_file_keeps_the_served_terms(tmp_path):
    model = CostModel(BARE.coefficients, served=TRUE)
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == model


def test_a_lone_served_request_pays_its_request_cost_and_served_steps():
    served = CostModel(BARE.coefficients, served=TRUE)
    (record,) = simulate([TraceRequest(1.0, 100, 3)], served).records
    prefill = served.step_seconds(StepWork(100, 1, 100 * 101 / 2, sampled_seqs=1))
    assert record.ttft == pytest.approx(0.02 + prefill, rel=1e-9)
    decodes = [served.step_seconds(StepWork(decode_seqs=1, decode_context_tokens=101 + i, sampled_seqs=1))
               for i in range(2)]
    assert record.tpot == pytest.approx(sum(decodes) / 2, rel=1e-9)


def test_streaming_cost_saturates_a_replica_the_bare_model_keeps_up_with():
    """Each streamed token costs the front 1.5 ms of the shared cores, so no batch streams more than ~670 tokens/s:
    a load of 24 req/s x 40 tokens = 960 tokens/s that the bare engine serves queues up when served."""
    spec = TraceSpec("poisson", 20.0, 24.0, LengthDist.parse("fixed:64"), LengthDist.parse("fixed:40"))
    trace = generate(spec, 0)
    bare = summarize(simulate(trace, BARE), SLO())
    served = summarize(simulate(trace, CostModel(BARE.coefficients, served=TRUE)), SLO())
    assert bare["throughput"]["output_tokens_per_s"] > 800
    assert served["throughput"]["output_tokens_per_s"] < 1 / TRUE.per_token_s
    assert served["ttft_s"]["p99"] > 10 * bare["ttft_s"]["p99"]  # the queue grows over the trace



def test_a_served_step_is_never_fitted_faster_than_the_engine_alone():
    """Data a free fit would explain with the engine at half its own CPU time: the scale stays at 1 and the
    other terms take up the rest."""
    faster = ServedCost(engine_scale=0.5, per_step_s=0.004, per_token_s=0.0015, per_request_s=0.02)
    fitted = ServedCost.fit(_probes(faster, 0.0, random.Random(2)))
    assert fitted.engine_scale == pytest.approx(1.0)
    assert fitted.per_step_s >= 0 and fitted.per_token_s >= 0 and fitted.per_request_s >= 0
