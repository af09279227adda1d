"""The simulated fleet: timing from the cost model, the real scheduler's
behaviour (chunks, preemption), saturation, determinism."""
from __future__ import annotations

import pytest

from octavo.core.outputs import ScheduledRequest, SchedulerOutput
from octavo.simulate.cost_model import step_work
from octavo.simulate.report import SLO, summarize
from octavo.simulate.simulator import FleetConfig
from octavo.simulate.traces import LengthDist, TraceRequest, TraceSpec, generate
from tests.simulate.sim_helpers import cost_model, shape, simulate

COST = cost_model(step=0.005, prefill_tokens=2e-4, prefill_seqs=1e-3, prefill_attention_mpairs=0.05,
                  decode_seqs=5e-4, decode_context_ktokens=1e-4)


def _prefill_time(n: int, start: int = 0) -> float:
    return COST.predict(step_work(SchedulerOutput([ScheduledRequest("x", start, n, [], 0, [], True)])))


def _decode_time(context: int) -> float:
    return COST.predict(step_work(SchedulerOutput([ScheduledRequest("x", context - 1, 1, [], 0, [], True)])))


def test_a_lone_request_takes_the_cost_models_prefill_then_decodes():
    (record,) = simulate([TraceRequest(3.0, 300, 5)], COST).records
    assert record.ttft == pytest.approx(_prefill_time(300), rel=1e-9)  # no queueing
    decodes = sum(_decode_time(301 + i) for i in range(4))
    assert record.e2e == pytest.approx(_prefill_time(300) + decodes, rel=1e-9)
    assert record.tokens_done == 5


def test_request_and_step_overheads_add_where_they_belong():
    fleet = FleetConfig(request_overhead_s=0.25, step_overhead_s=0.03)
    (record,) = simulate([TraceRequest(0.0, 100, 3)], COST, fleet=fleet).records
    assert record.ttft == pytest.approx(0.25 + _prefill_time(100) + 0.03, rel=1e-9)
    assert record.tpot == pytest.approx((_decode_time(101) + _decode_time(102)) / 2 + 0.03, rel=1e-9)


def test_long_prompts_are_chunked_as_the_scheduler_chunks_them():
    trace = [TraceRequest(0.0, 200, 1)]
    chunked = simulate(trace, COST, shape(max_num_batched_tokens=64, chunked=True)).records[0]
    chunks = [(0, 64), (64, 64), (128, 64), (192, 8)]
    assert chunked.ttft == pytest.approx(sum(_prefill_time(n, s) for s, n in chunks), rel=1e-9)
    # Without chunked prefill a prompt longer than the budget runs alone, whole.
    whole = simulate(trace, COST, shape(max_num_batched_tokens=64, chunked=False)).records[0]
    assert whole.ttft == pytest.approx(_prefill_time(200), rel=1e-9)


def test_a_small_kv_pool_preempts_and_everything_still_finishes():
    # 10 blocks of 16 tokens; 4 requests growing to 32 + 64 tokens (6 blocks each).
    trace = [TraceRequest(0.0, 32, 64) for _ in range(4)]
    result = simulate(trace, COST, shape(num_blocks=10))
    summary = summarize(result, SLO())
    assert summary["finished"] == 4 and summary["preemptions"] > 0
    assert all(r.tokens_done == 64 for r in result.records)
    (replica,) = result.replicas
    assert replica.scheduler.kv_cache_manager.num_free_blocks == 10  # no block leaked
    # With room for all of them, none is preempted.
    assert summarize(simulate(trace, COST, shape(num_blocks=100)), SLO())["preemptions"] == 0


def test_throughput_saturates_where_the_cost_model_says():
    """8 sequences decode per step at 10 ms + 1 ms per sequence: at most
    8 / 0.018 = 444 tokens/s, however fast requests come."""
    cost = cost_model(step=0.010, decode_seqs=0.001)
    out = LengthDist.parse("fixed:400")

    def throughput(rate: float) -> float:
        trace = generate(TraceSpec("poisson", 60.0, rate, LengthDist.parse("fixed:16"), out), seed=0)
        s = summarize(simulate(trace, cost, shape(max_num_seqs=8)), SLO())
        return s["throughput"]["output_tokens_per_s"]

    cap = 8 / 0.018
    assert throughput(0.2) < 0.25 * cap  # well below: throughput follows the offered load
    assert throughput(3.0) == pytest.approx(cap, rel=0.03)
    assert throughput(6.0) == pytest.approx(cap, rel=0.03)


def test_queueing_grows_under_overload():
    cost = cost_model(step=0.010, decode_seqs=0.001)
    trace = generate(TraceSpec("poisson", 60.0, 4.0, LengthDist.parse("fixed:16"), LengthDist.parse("fixed:200")),
                     seed=0)
    records = simulate(trace, cost, shape(max_num_seqs=8)).records
    early = [r.ttft for r in records[:20]]
    late = [r.ttft for r in records[-20:]]
    assert min(late) > 10 * max(early)


def _two_replica_run(seed: int) -> dict:
    trace = generate(TraceSpec("bursty", 120.0, 1.0, LengthDist.parse("uniform:20:400"),
                               LengthDist.parse("uniform:5:80"), burst_rate=8.0), seed=seed)
    return summarize(simulate(trace, COST, fleet=FleetConfig(initial_replicas=2), seed=seed), SLO())


def test_same_seed_same_result():
    assert _two_replica_run(7) == _two_replica_run(7)
    assert _two_replica_run(7) != _two_replica_run(8)


def test_round_robin_spreads_requests_over_replicas():
    trace = [TraceRequest(i * 10.0, 50, 5) for i in range(6)]
    records = simulate(trace, COST, fleet=FleetConfig(initial_replicas=3, routing="round-robin")).records
    assert sorted(r.replica for r in records) == ["replica-0"] * 2 + ["replica-1"] * 2 + ["replica-2"] * 2


def test_fleet_config_errors_name_the_field():
    with pytest.raises(ValueError, match="routing"):
        FleetConfig(routing="kv-aware")
    with pytest.raises(ValueError, match="initial_replicas"):
        simulate([TraceRequest(0.0, 5, 5)], COST, fleet=FleetConfig(initial_replicas=0))


def test_a_request_longer_than_the_context_fails_alone():
    trace = [TraceRequest(0.0, 50, 5), TraceRequest(0.1, 5000, 5), TraceRequest(0.2, 60, 5)]
    result = simulate(trace, COST, shape(max_model_len=1024))
    summary = summarize(result, SLO())
    assert summary["refused"] == 1 and summary["finished"] == 2
    assert "context length" in result.records[1].error
