"""The served speed tape: a recorded stall replayed as it came, the tape recovered from step records made on a
machine with known stalls, and the simulated tail of a known case."""
from __future__ import annotations

import random
import statistics

import pytest

from octavo.simulate.cost_model import CostModel
from octavo.simulate.report import percentile
from octavo.simulate.served import ServedCost
from octavo.simulate.served_steps import ServedStep
from octavo.simulate.simulator import FleetConfig, Simulator
from octavo.simulate.speed_tape import SpeedTape
from octavo.simulate.traces import TraceRequest
from tests.simulate.sim_helpers import cost_model, shape, simulate
from tests.simulate.test_served_steps import BARE, TRUE, _lone, _steps

# Two seconds: 1.8 s at full speed, then a 0.2 s stall in which the engine gets through a tenth of its work.
STALL = SpeedTape([1.8, 0.2], [1.8, 0.02])


def test_a_step_that_meets_a_stall_crawls_through_it():
    assert STALL.length_s == 2.0 and STALL.mean_rate == pytest.approx(0.91)
    assert STALL.duration(0.0, 0.1) == pytest.approx(0.1)
    # 0.05 s of work before the stall, 0.02 in its 0.2 s, the last 0.03 after it.
    assert STALL.duration(1.75, 0.1) == pytest.approx(0.05 + 0.2 + 0.03)
    # Starting halfway through the stall: 0.01 of work in its last 0.1 s, then 0.09.
    assert STALL.duration(1.9, 0.1) == pytest.approx(0.19)
    # The tape wraps round: tape time 3.9 is 1.9, and -0.1 is too.
    assert STALL.duration(3.9, 0.1) == pytest.approx(0.19) and STALL.duration(-0.1, 0.1) == pytest.approx(0.19)
    # A loop's work takes a loop from anywhere; two take two.
    assert STALL.duration(0.7, 1.82) == pytest.approx(2.0) and STALL.duration(1.95, 3.64) == pytest.approx(4.0)
    assert STALL.duration(1.0, 0.0) == 0.0


def test_a_bad_tape_is_named():
    with pytest.raises(ValueError, match="speed_tape"):
        SpeedTape([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="speed_tape"):
        SpeedTape([0.1, 0.0], [0.1, 0.1])
    with pytest.raises(ValueError, match="speed_tape"):
        SpeedTape([], [])


def _stalled_steps(machine: SpeedTape, rng: random.Random) -> list[ServedStep]:
    """The steps of ``_steps`` (TRUE's terms) run back to back on a machine that stalls as ``machine`` says, with
    a little independent noise besides."""
    steps, now = [], 0.0
    for step in _steps(TRUE, 0.0, rng):
        seconds = machine.duration(now, step.seconds) * rng.lognormvariate(0.0, 0.05)
        steps.append(ServedStep(step.work, seconds))
        now += seconds
    return steps


def test_fit_steps_keeps_the_stalls_in_the_runs_they_came_in():
    """A machine that stalls for 0.4 s of every 4, getting through a fifth of the work meanwhile: the terms
    fitted still describe a typical step, and the tape holds the stalls, their share of the time and the
    machine's mean rate, where independent stretches would have lost which steps were slow together."""
    machine = SpeedTape([3.6, 0.4], [3.6, 0.08])
    steps = _stalled_steps(machine, random.Random(0))
    fitted = ServedCost.fit_steps(steps, BARE.predict, _lone(TRUE))
    for name in ("engine_scale", "mixed_scale", "per_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    tape = fitted.speed_tape
    assert tape is not None and len(tape.seconds) == len(steps)
    assert tape.length_s == pytest.approx(sum(s.seconds for s in steps), rel=1e-4)
    assert tape.mean_rate == pytest.approx(machine.mean_rate, rel=0.05)
    stalled = sum(s for s, w in zip(tape.seconds, tape.work) if w / s < 0.5)
    assert stalled / tape.length_s == pytest.approx(0.1, abs=0.02)
    # Slow steps follow slow steps: a stall spans several of them (steps of 5-30 ms of work, 0.08 s in a stall).
    assert tape.lag1_autocorrelation() > 0.5
    shuffled = ServedCost.fit_steps(random.Random(1).sample(steps, len(steps)), BARE.predict, _lone(TRUE))
    assert abs(shuffled.speed_tape.lag1_autocorrelation()) < 0.1


def test_the_tape_survives_the_cost_model_file(tmp_path):
    cost = CostModel(BARE.coefficients, served=ServedCost(engine_scale=1.5, speed_tape=STALL))
    cost.save(tmp_path / "cost.json")
    loaded = CostModel.load(tmp_path / "cost.json")
    assert loaded.served.speed_tape == STALL and loaded.served.speed_tape.duration(1.75, 0.1) == pytest.approx(0.28)


def test_the_simulated_tail_is_the_stall_a_request_meets():
    """Requests of ten 10 ms steps, one at a time, at phases spread over the tape: one meeting no stall takes
    0.1 s; one starting from 1.72 to 1.8 s spends the whole stall (0.2 s, 0.02 of its work) in it: 0.28 s, 4% of
    phases; from 1.7 to 1.72 and from 1.8 to 2.0 (in the stall) less, on ramps: 15% of requests slowed in all,
    the mean 0.1171 s."""
    cost = CostModel(cost_model(step=0.01).coefficients, served=ServedCost(speed_tape=STALL))
    # 0.613 s apart: longer than the slowest request, and the phases fill the tape evenly.
    trace = [TraceRequest(0.613 * i, 16, 10) for i in range(3000)]
    e2e = [r.e2e for r in simulate(trace, cost, shape(), FleetConfig(stalls="recorded"), seed=5).records]
    assert statistics.median(e2e) == pytest.approx(0.1)
    assert sum(e > 0.1 + 1e-6 for e in e2e) / len(e2e) == pytest.approx(0.15, abs=0.01)
    assert percentile(e2e, 99) == pytest.approx(0.28) and max(e2e) == pytest.approx(0.28)
    assert sum(e > 0.28 - 1e-6 for e in e2e) / len(e2e) == pytest.approx(0.04, abs=0.01)
    assert statistics.fmean(e2e) == pytest.approx(0.1171, rel=0.02)


def test_recorded_stalls_need_a_tape():
    with pytest.raises(ValueError, match="stalls"):
        FleetConfig(stalls="sometimes")
    with pytest.raises(ValueError, match="stalls: recorded"):
        Simulator(CostModel(BARE.coefficients, served=ServedCost()), shape(), FleetConfig(stalls="recorded"))
