"""The simulated replica's queue at a known capacity: every step costs the same, so how many requests a replica
finishes a second follows from its batch alone; past that rate requests wait for those ahead of them, below it
none waits."""
from __future__ import annotations

import pytest

from octavo.simulate.traces import TraceRequest
from tests.simulate.sim_helpers import cost_model, shape, simulate

STEP_S = 0.01
EVERY_STEP = cost_model(step=STEP_S)  # a step costs 10 ms whatever it holds


def test_one_slot_queues_as_a_single_server():
    """One request at a time, one token each: 100 requests/s. Arriving every 5 ms, request i waits for the i
    ahead of it and has its token at (i + 1) steps; arriving every 20 ms, none waits."""
    one_slot = shape(max_num_seqs=1)
    fast = simulate([TraceRequest(i * STEP_S / 2, 16, 1) for i in range(50)], EVERY_STEP, one_slot).records
    assert [r.ttft for r in fast] == pytest.approx([STEP_S * (1 + i / 2) for i in range(50)])
    slow = simulate([TraceRequest(i * STEP_S * 2, 16, 1) for i in range(50)], EVERY_STEP, one_slot).records
    assert [r.ttft for r in slow] == pytest.approx([STEP_S] * 50)


def test_a_full_batch_serves_at_its_capacity_and_the_queue_holds_the_rest():
    """Four slots, eight tokens a request (its prompt's step, then seven decodes): a slot frees every eight
    steps, so the replica finishes 4 / (8 x 10 ms) = 50 requests/s. At 100 arriving a second it finishes 50, and
    the last request waits for the 399 ahead of it served at 50/s."""
    rate, n, capacity = 100.0, 400, 50.0
    records = simulate([TraceRequest(i / rate, 16, 8) for i in range(n)], EVERY_STEP, shape(max_num_seqs=4)).records
    finished = sorted(r.finish_s for r in records)
    assert (n - 1) / (finished[-1] - finished[0]) == pytest.approx(capacity, rel=0.01)
    assert records[-1].ttft == pytest.approx(n / capacity - n / rate, rel=0.02)
    # Below capacity no request waits: its first token comes after at most the step in flight and its own.
    below = simulate([TraceRequest(i / 25.0, 16, 8) for i in range(100)], EVERY_STEP, shape(max_num_seqs=4)).records
    assert max(r.ttft for r in below) <= 2 * STEP_S + 1e-9
