"""The autoscaler's policy in the simulated loop: replicas come after the
cold start, serve, and drain when the load goes."""
from __future__ import annotations

from dataclasses import replace

from octavo.autoscale.policy import Autoscaler, AutoscalerConfig, ReactiveConfig
from octavo.simulate.autoscaling import PolicyScaler
from octavo.simulate.replica import ReplicaState
from octavo.simulate.report import SLO, summarize
from octavo.simulate.simulator import FleetConfig
from octavo.simulate.traces import LengthDist, TraceSpec, generate
from tests.simulate.sim_helpers import cost_model, shape, simulate

COST = cost_model(step=0.010, prefill_tokens=1e-4, decode_seqs=0.001)
LENGTHS = {"prompt": LengthDist.parse("fixed:64"), "output": LengthDist.parse("fixed:100")}


def _step_load() -> list:
    """0.5 requests/s for 120 s, then 6/s for 240 s (queues: more than one replica's worth), then 0.5/s for 300 s."""
    quiet = generate(TraceSpec("poisson", 120.0, 0.5, **LENGTHS), seed=1)
    busy = generate(TraceSpec("poisson", 240.0, 6.0, **LENGTHS), seed=2)
    after = generate(TraceSpec("poisson", 300.0, 0.5, **LENGTHS), seed=3)
    return (quiet + [replace(r, arrival_s=r.arrival_s + 120.0) for r in busy]
            + [replace(r, arrival_s=r.arrival_s + 360.0) for r in after])


def _scaler() -> PolicyScaler:
    config = AutoscalerConfig(min_replicas=1, max_replicas=6, scale_down_window_s=60.0,
                              reactive=ReactiveConfig(targets={"in_flight": 8.0}, metric_window_s=20.0))
    return PolicyScaler(Autoscaler(config), interval_s=5.0)


def test_step_load_adds_replicas_after_the_cold_start_and_drains_them_after():
    fleet = FleetConfig(initial_replicas=1, cold_start_s=30.0, interval_s=5.0)
    scaler = _scaler()
    result = simulate(_step_load(), COST, shape(max_num_seqs=16), fleet, scaler)
    ups = [(t, a, b) for t, a, b in result.scale_events if b > a]
    assert ups and ups[0][0] >= 120.0  # nothing before the step
    added = result.replicas[1:]
    assert added, "no replica was added"
    for r in added:
        assert r.ready_s == r.created_s + 30.0
        served = [rec for rec in result.records if rec.replica == r.name]
        assert served and min(rec.dispatched_s for rec in served) >= r.ready_s
    # Once the load is gone the fleet shrinks back, draining (every request finishes).
    assert all(r.state is ReplicaState.STOPPED and r.ready_s < r.stopped_s < result.end_s for r in added)
    assert result.scale_events[-1][2] == 1
    assert all(rec.finish_s is not None for rec in result.records)
    # The scaled fleet meets the SLO more often than one replica alone.
    fixed = simulate(_step_load(), COST, shape(max_num_seqs=16), FleetConfig(initial_replicas=1))
    slo = SLO(ttft_s=2.0, tpot_s=0.1)
    assert summarize(result, slo)["slo"]["attainment"] > summarize(fixed, slo)["slo"]["attainment"] + 0.2


def test_cold_start_delays_the_first_added_replica():
    step = [r for r in _step_load() if r.arrival_s < 240.0]  # the rise is enough

    def first_ready(cold: float) -> float:
        fleet = FleetConfig(initial_replicas=1, cold_start_s=cold, interval_s=5.0)
        result = simulate(step, COST, shape(max_num_seqs=16), fleet, _scaler())
        return result.replicas[1].ready_s - result.scale_events[0][0]

    assert first_ready(10.0) == 10.0
    assert first_ready(90.0) == 90.0
