"""A step's admission work must not grow with the waiting queue: past
saturation the queue holds thousands of requests and every step would pay
for each of them. Counted as the waiting requests the scheduler reads
(a copy of the queue reads all of them), not as time."""
from __future__ import annotations

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens

from octavo.core.request_queue import RequestQueue
from octavo.core.scheduler import Scheduler

NUM_WAITING = 1000


class _Visits:
    """Waiting requests read by ``Scheduler.schedule`` (indexed, or copied by iterating)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sched: Scheduler) -> None:
        self.count = 0
        self._on = False
        getitem, iterate, schedule = RequestQueue.__getitem__, RequestQueue.__iter__, sched.schedule

        def counted_getitem(queue: RequestQueue, index: int):
            if self._on and queue is sched.waiting:
                self.count += 1
            return getitem(queue, index)

        def counted_iter(queue: RequestQueue):
            if self._on and queue is sched.waiting:
                self.count += len(queue)
            return iterate(queue)

        def counted_schedule():
            self._on = True
            try:
                return schedule()
            finally:
                self._on = False

        monkeypatch.setattr(RequestQueue, "__getitem__", counted_getitem)
        monkeypatch.setattr(RequestQueue, "__iter__", counted_iter)
        monkeypatch.setattr(sched, "schedule", counted_schedule)


def _admitted(out) -> int:
    return sum(1 for s in out.scheduled if s.new is not None)


def test_a_step_reads_only_the_waiting_requests_it_admits_and_one_more(monkeypatch):
    sched, runner = make_scheduler(num_blocks=64, max_num_seqs=8)
    requests = [make_request(f"r{i}", 4, max_tokens=2) for i in range(NUM_WAITING)]
    for r in requests:
        sched.add_request(r)
    visits = _Visits(monkeypatch, sched)
    run = Run(sched, runner)
    admitted_order = []
    while sched.has_unfinished_requests():
        before = visits.count
        out = run.step()
        assert visits.count - before <= _admitted(out) + 1, (len(sched.waiting), visits.count - before)
        admitted_order += [s.request_id for s in out.scheduled if s.new is not None]
    assert admitted_order == [r.request_id for r in requests]  # first come, first served
    for r in requests:
        assert run.tokens[r.request_id] == reference_tokens(r.prompt_token_ids, 2, r.request_id)


def test_a_head_that_does_not_fit_costs_one_read_per_step(monkeypatch):
    # A free seat but too few free blocks for the head: nothing behind it is admitted, or read.
    sched, runner = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8)
    first = make_request("first", 20, max_tokens=6)  # 5 blocks of 8, then 7 as it decodes
    sched.add_request(first)
    run = Run(sched, runner)
    run.step()
    big = make_request("big", 16, max_tokens=1)  # 4 blocks: waits for `first` to finish
    sched.add_request(big)
    for i in range(NUM_WAITING):
        sched.add_request(make_request(f"w{i}", 4, max_tokens=1))
    visits = _Visits(monkeypatch, sched)
    while sched.get_request("first") is not None:
        before = visits.count
        out = run.step()
        assert [s.request_id for s in out.scheduled] == ["first"]
        assert visits.count - before == 1
    run.until_done(max_steps=5000)
    assert run.finish["big"] == "length"
