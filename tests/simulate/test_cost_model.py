"""The cost model: the work read off a step, the fit, the file."""
from __future__ import annotations

import random

import pytest

from octavo.core.outputs import ScheduledRequest, SchedulerOutput
from octavo.simulate.cost_model import FEATURES, CostModel, EngineShape, MachineInfo, StepWork, step_work


def _scheduled(start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(f"r{start}-{n}", start, n, [], 0, [], sample=True)


def test_step_work_tells_decodes_from_prompt_chunks():
    out = SchedulerOutput([_scheduled(0, 100), _scheduled(64, 32), _scheduled(300, 1), _scheduled(9, 1)])
    work = step_work(out)
    assert (work.prefill_tokens, work.prefill_seqs, work.decode_seqs) == (132, 2, 2)
    # A chunk of n after s computed tokens attends n * (s + (n + 1) / 2) pairs.
    assert work.prefill_attention_pairs == 100 * 50.5 + 32 * (64 + 16.5)
    assert work.decode_context_tokens == 301 + 10


def _random_work(rng: random.Random) -> StepWork:
    decodes = rng.randint(0, 64)
    prefill = rng.choice([0, 0, rng.randint(2, 2048)])
    if not decodes and not prefill:
        decodes = 1
    start = rng.randint(0, 1024)
    chunks = rng.randint(1, min(4, prefill)) if prefill else 0
    return StepWork(prefill, chunks, prefill * (start + (prefill + 1) / 2),
                    decodes, decodes * rng.randint(1, 2048))


# Decode steps recorded at 1, 2, 4, then every 8 to 64 (worker/decode_graphs.py's sizes for a batch of 64).
RECORDED = EngineShape(5461, 16, 4096, 64, 2048, decode_batch_sizes=(1, 2, 4, *range(8, 65, 8)))


def test_fit_recovers_known_coefficients():
    true = {"step": 4e-3, "prefill_tokens": 1.5e-4, "prefill_seqs": 2e-3, "prefill_attention_mpairs": 3e-2,
            "decode_seqs": 6e-4, "decode_context_ktokens": 2e-4, "mixed_step": 3e-3, "decode_padding_rows": 4e-4}
    truth = CostModel(true, engine=RECORDED)
    rng = random.Random(0)
    works = [_random_work(rng) for _ in range(400)]
    # 2% multiplicative noise, as timing jitter on a quiet machine.
    seconds = [truth.predict(w) * rng.uniform(0.98, 1.02) for w in works]
    fitted = CostModel.fit_steps(works, seconds, engine=RECORDED)
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(true[name], rel=0.1), name
    assert fitted.fit.num_steps == 400 and fitted.fit.mean_abs_rel_error < 0.02


def test_fit_keeps_every_coefficient_non_negative():
    """Data a free fit would explain with a negative per-sequence cost."""
    rng = random.Random(1)
    works = [StepWork(decode_seqs=b, decode_context_tokens=b * 100) for b in range(1, 40)]
    seconds = [0.01 + 0.001 * w.decode_seqs - 0.00002 * w.decode_seqs ** 2 * rng.uniform(0.9, 1.1) for w in works]
    fitted = CostModel.fit_steps(works, seconds)
    assert all(c >= 0 for c in fitted.coefficients.values())
    assert fitted.predict(StepWork(decode_seqs=1, decode_context_tokens=100)) > 0


def test_prediction_is_linear_and_empty_steps_are_free():
    model = CostModel({f: 0.001 * (i + 1) for i, f in enumerate(FEATURES)})
    work = StepWork(10, 1, 2e6, 3, 4000)
    # A prompt chunk and decodes in one step: a mixed step.
    assert model.predict(work) == pytest.approx(0.001 + 0.002 * 10 + 0.003 + 0.004 * 2 + 0.005 * 3 + 0.006 * 4
                                                + 0.007)
    assert model.predict(StepWork()) == 0.0


def test_decode_steps_cost_the_recorded_batch_size_that_holds_them():
    """A decode step of n rows runs at the smallest recorded size >= n, its other rows padding; a step with a prompt
    chunk runs eagerly at its own size, as does one larger than every recording or an engine with none."""
    sizes = (1, 2, 4, 8, 16)
    assert [StepWork(decode_seqs=n).padding_rows(sizes) for n in (1, 3, 4, 5, 9, 16, 17)] == [0, 1, 0, 3, 7, 0, 0]
    assert StepWork(64, 1, decode_seqs=5).padding_rows(sizes) == 0
    assert StepWork(decode_seqs=5).padding_rows(()) == 0
    coefficients = {f: 0.0 for f in FEATURES} | {"step": 1e-3, "decode_seqs": 1e-4, "decode_padding_rows": 5e-5}
    padded = CostModel(coefficients, engine=EngineShape(100, 16, 1024, 16, 512, decode_batch_sizes=sizes))
    # 9 rows run as 16: 7 of them padding.
    assert padded.predict(StepWork(decode_seqs=9)) == pytest.approx(1e-3 + 9e-4 + 7 * 5e-5)
    assert CostModel(coefficients).predict(StepWork(decode_seqs=9)) == pytest.approx(1e-3 + 9e-4)


def test_file_round_trip_keeps_machine_and_engine(tmp_path):
    model = CostModel({f: 1e-3 for f in FEATURES}, MachineInfo("Some CPU", 2, "llama-100m", "bfloat16"), RECORDED)
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == model


def test_bad_input_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="coefficients"):
        CostModel({f: -1.0 for f in FEATURES})
    with pytest.raises(ValueError, match="coefficients"):
        CostModel({"step": 1.0})
    with pytest.raises(ValueError, match="steps"):
        CostModel.fit_steps([StepWork(decode_seqs=1)], [0.01])
    (tmp_path / "x.json").write_text('{"format_version": 99}')
    with pytest.raises(ValueError, match="format_version"):
        CostModel.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="cost_model"):
        CostModel.load(tmp_path / "missing.json")


def test_fit_quality_is_reported_per_step_kind_and_kept_in_the_file(tmp_path):
    truth = CostModel({"step": 2e-3, "prefill_tokens": 1e-4, "prefill_seqs": 0.0, "prefill_attention_mpairs": 0.0,
                       "decode_seqs": 5e-4, "decode_context_ktokens": 0.0, "mixed_step": 0.0,
                       "decode_padding_rows": 0.0})
    works = [StepWork(decode_seqs=b) for b in range(1, 21)] + [StepWork(64 * n, 1) for n in range(1, 11)]
    works += [StepWork(64, 1, decode_seqs=b) for b in range(1, 6)]
    # Decode steps measured 30% slower than the truth, the others exact: no linear model fits both, and each
    # kind's error is its own steps' error.
    seconds = [truth.predict(w) * (1.3 if w.kind == "decode" else 1.0) for w in works]
    fitted = CostModel.fit_steps(works, seconds)
    by_kind = fitted.fit.by_kind
    assert {k: q.num_steps for k, q in by_kind.items()} == {"decode": 20, "prefill": 10, "mixed": 5}
    for kind, quality in by_kind.items():
        steps = [(fitted.predict(w), t) for w, t in zip(works, seconds) if w.kind == kind]
        errors = sorted((p - t) / t for p, t in steps)
        assert quality.mean_abs_rel_error == pytest.approx(sum(map(abs, errors)) / len(errors))
        assert errors[0] <= quality.median_rel_error <= errors[-1]
    assert fitted.fit.mean_abs_rel_error > 0.01  # the compromise shows
    fitted.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json").fit == fitted.fit
