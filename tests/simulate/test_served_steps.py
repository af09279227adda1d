"""The served terms fitted to a server's own steps (its --step-record): the record read into steps, the terms
recovered from steps made by known terms, and the saturation rate the simulated replica then shows."""
from __future__ import annotations

import json
import math
import random

import pytest

from octavo.simulate.cost_model import CostModel, EngineShape, StepWork
from octavo.simulate.report import SLO, summarize
from octavo.simulate.served import ServedCost, ServedProbe
from octavo.simulate.served_steps import ServedStep, read_served_steps
from octavo.simulate.traces import LengthDist, TraceSpec, generate
from tests.simulate.sim_helpers import cost_model, shape, simulate

BARE = cost_model(step=0.002, prefill_tokens=1e-4, prefill_seqs=5e-4, decode_seqs=3e-4,
                  decode_context_ktokens=1e-4, mixed_step=0.001)
TRUE = ServedCost(engine_scale=1.4, mixed_scale=2.2, per_step_s=0.0015, per_token_s=0.0004, per_request_s=0.03)


def _line(start: float, scheduled: list[list[int]], after_idle: bool = False) -> str:
    return json.dumps({"start": start, "seconds": 0.001, "after_idle": after_idle, "scheduled": scheduled})


def test_a_step_lasts_from_its_start_to_the_next_one_and_idle_waits_are_left_out(tmp_path):
    path = tmp_path / "steps.jsonl"
    # The engine's first steps of each token count (100, 51, 2, 8), which pay one-off costs.
    first = [_line(1.0 + i, [[n, 0, 1]], after_idle=True) for i, n in enumerate((100, 51, 2, 8))]
    lines = [_line(10.0, [[100, 0, 1]], after_idle=True), _line(10.02, [[1, 100, 1], [50, 0, 1]]),
             _line(10.05, [[1, 101, 1], [1, 50, 1]]),
             _line(12.0, [[8, 0, 1]], after_idle=True),  # after an idle wait: the step before it is not counted
             _line(12.01, [[1, 8, 0]]), _line(12.02, [[1, 9, 1]]), _line(12.03, [[1, 10, 1]])]
    path.write_text("\n".join(first + lines) + "\n")
    steps = read_served_steps(path, since=5.0)
    # The step of 12.01 is the first of one token: left out; the last has no next start.
    assert [s.seconds for s in steps] == pytest.approx([0.02, 0.03, 0.01, 0.01])
    assert steps[0].work == StepWork(100, 1, 100 * 101 / 2, sampled_seqs=1)
    assert steps[1].work == StepWork(50, 1, 50 * 51 / 2, 1, 101, 2)  # mixed: a decode and a prompt
    assert steps[2].work == StepWork(8, 1, 8 * 9 / 2, sampled_seqs=1)
    assert steps[3].work == StepWork(decode_seqs=1, decode_context_tokens=10, sampled_seqs=1)
    # A window by start time.
    assert [s.seconds for s in read_served_steps(path, since=10.01, until=12.0)] == pytest.approx([0.03])


def test_a_bad_record_line_is_named(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(_line(1.0, [[4, 0, 1]]) + "\n" + '{"start": 2.0, "scheduled": [[1, 2]]}\n')
    with pytest.raises(ValueError, match=f"served_steps: {path} line 2"):
        read_served_steps(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_served_steps(tmp_path / "missing.jsonl")


def _steps(truth: ServedCost, sigma: float, rng: random.Random) -> list[ServedStep]:
    """Steps a served engine with ``truth``'s terms would run under load: decode batches of every size, prompts
    alone and prompts joining a batch, each stretched by lognormal noise of median 1."""
    works = []
    for _ in range(400):
        batch = rng.randint(1, 32)
        context = batch * rng.randint(100, 300)
        prompt = rng.randint(64, 256)
        works += [StepWork(decode_seqs=batch, decode_context_tokens=context, sampled_seqs=batch),
                  StepWork(prompt, 1, prompt * (prompt + 1) / 2, batch, context, batch + 1)]
        if rng.random() < 0.2:
            works.append(StepWork(prompt, 1, prompt * (prompt + 1) / 2, sampled_seqs=1))
    return [ServedStep(w, truth.step_seconds(BARE.predict(w), w.sampled_seqs, w.kind == "mixed")
                       * rng.lognormvariate(0.0, sigma)) for w in works]


def _lone(truth: ServedCost) -> list[ServedProbe]:
    probes = []
    for n in (32, 128, 256, 384):
        engine_s = BARE.predict(StepWork(n, 1, n * (n + 1) / 2, sampled_seqs=1))
        probes.append(ServedProbe(engine_s, 1, truth.step_seconds(engine_s, 1) + truth.per_request_s, True))
    return probes


def test_fit_steps_recovers_the_terms_that_made_the_steps():
    steps = _steps(TRUE, 0.15, random.Random(0))
    fitted = ServedCost.fit_steps(steps, BARE.predict, _lone(TRUE), load_avg="9.00/8.00/7.00")
    for name, rel in (("engine_scale", 0.1), ("mixed_scale", 0.1), ("per_token_s", 0.15), ("per_request_s", 0.05)):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=rel), name
    # The per-step term trades against the engine's own per-step cost, but not what a step is predicted to take.
    # (Least squares on relative error puts steps with noise of spread s about exp(-1.5 s^2) low: 3% here.)
    full, joined = StepWork(decode_seqs=32, decode_context_tokens=6400, sampled_seqs=32), StepWork(200, 1, 20100, 31,
                                                                                                 6200, 32)
    for work in (full, joined):
        served = [c.step_seconds(BARE.predict(work), 32, work.kind == "mixed") for c in (fitted, TRUE)]
        assert served[0] == pytest.approx(served[1], rel=0.05), work.kind
    # The terms and a stretch of median 1 with the steps' spread give their total time, which sets capacity.
    assert abs(fitted.served_steps_total_rel_error) < 0.05 and fitted.served_steps == len(steps)
    assert fitted.step_noise_sigma == pytest.approx(0.15, rel=0.2) and fitted.step_noise_mu == 0.0
    assert fitted.load_avg == "9.00/8.00/7.00" and fitted.num_probes == 4


def test_fit_steps_needs_steps_and_lone_requests():
    steps = _steps(TRUE, 0.0, random.Random(1))
    with pytest.raises(ValueError, match="served_steps"):
        ServedCost.fit_steps(steps[:3], BARE.predict, _lone(TRUE))
    with pytest.raises(ValueError, match="lone"):
        ServedCost.fit_steps(steps, BARE.predict, [])


def test_the_replica_saturates_at_the_predicted_rate():
    """Every step costs 10 ms; four slots, eight tokens a request: 4 / (8 x 10 ms) = 50 requests/s. Below it the
    replica keeps up with the arrivals, above it finishes 50 a second however many arrive."""
    engine = EngineShape(num_kv_blocks=1000, block_size=16, max_model_len=4096, max_num_seqs=4,
                         max_num_batched_tokens=512)
    cost = CostModel(cost_model(step=0.01).coefficients, engine=engine)
    saturation = cost.saturation_rate(16, 8)
    assert saturation == pytest.approx(50.0)
    lengths = {"prompt": LengthDist.parse("fixed:16"), "output": LengthDist.parse("fixed:8")}
    for factor, expected in ((0.7, 0.7 * saturation), (1.5, saturation)):
        trace = generate(TraceSpec("poisson", 60.0, factor * saturation, **lengths), 3)
        result = simulate(trace, cost, shape(max_num_seqs=4))
        finished = sorted(r.finish_s for r in result.records)
        assert (len(finished) - 1) / (finished[-1] - finished[0]) == pytest.approx(expected, rel=0.05), factor
    assert math.isfinite(summarize(result, SLO())["ttft_s"]["p99"])


def test_padded_decode_steps_leave_the_full_batch_its_own_cost():
    """A served engine whose decode steps run at recorded batch sizes (1, 2, 4, then every 8 to 32): a batch of 9
    costs nearly what one of 16 does. With the padding in the bare model, the served terms fitted to such steps
    predict the full batch of 32 (which has none) as it is; without it, the one engine scale grows to cover the
    padded sizes and puts the full batch long, so the simulated replica saturates early."""
    sizes = (1, 2, 4, 8, 16, 24, 32)
    engine = EngineShape(num_kv_blocks=1000, block_size=16, max_model_len=4096, max_num_seqs=32,
                         max_num_batched_tokens=512, decode_batch_sizes=sizes)
    padded = CostModel({**BARE.coefficients, "decode_padding_rows": 2.5e-4}, engine=engine)
    truth = ServedCost(engine_scale=1.0, mixed_scale=1.3, per_step_s=0.001)
    rng = random.Random(2)
    steps = [ServedStep(s.work, truth.step_seconds(padded.predict(s.work), s.work.sampled_seqs,
                                                   s.work.kind == "mixed") * rng.lognormvariate(0.0, 0.05))
             for s in _steps(truth, 0.0, rng)]
    unpadded = CostModel(padded.coefficients)  # the same coefficients, no recorded sizes: every step unpadded
    full = StepWork(decode_seqs=32, decode_context_tokens=6400, sampled_seqs=32)
    real = truth.step_seconds(padded.predict(full), 32)
    with_padding = ServedCost.fit_steps(steps, padded.predict, _lone(truth))
    assert with_padding.engine_scale == pytest.approx(1.0, abs=0.03)
    assert with_padding.step_seconds(padded.predict(full), 32) == pytest.approx(real, rel=0.03)
    without = ServedCost.fit_steps(steps, unpadded.predict, _lone(truth))
    assert without.step_seconds(unpadded.predict(full), 32) > 1.05 * real
