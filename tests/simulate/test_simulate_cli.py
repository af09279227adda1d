"""`octavo simulate calibrate` and `octavo simulate run` end to end."""
from __future__ import annotations

import json

import pytest

from octavo.entrypoints.cli import main
from octavo.simulate.cost_model import FEATURES, CostModel
from tests.model_factory import make_tiny_model


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    """A real calibration, on a tiny random model (a few seconds)."""
    folder = tmp_path_factory.mktemp("calibrate")
    model = make_tiny_model(folder / "model")
    out = folder / "cost.json"
    main(["simulate", "calibrate", str(model), "-o", str(out), "--repeats", "1", "--max-model-len", "128",
          "--num-blocks", "4096", "--max-num-seqs", "32", "--max-batch", "4", "--steps-out", str(folder / "steps.jsonl")])
    assert len((folder / "steps.jsonl").read_text().splitlines()) == CostModel.load(out).fit.num_steps
    return out


def test_calibration_writes_a_fitted_model_with_the_engine_shape(cost_file):
    cost = CostModel.load(cost_file)
    assert set(cost.coefficients) == set(FEATURES)
    assert cost.coefficients["step"] > 0  # every step costs something
    assert cost.fit.num_steps > 50
    assert cost.engine.num_kv_blocks == 4096 and cost.engine.max_model_len == 128
    assert cost.engine.max_num_seqs == 32
    assert cost.machine.cpu and cost.machine.threads >= 1 and cost.machine.model.startswith("llama")


def test_run_writes_summary_and_plot(cost_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the optional extra octavo[simulate]; the test extra installs it
    summary, plot = tmp_path / "summary.json", tmp_path / "timeline.png"
    main(["simulate", "run", "--cost-model", str(cost_file), "--trace", "diurnal", "--rate", "2",
          "--duration", "120", "--period", "120", "--prompt-len", "uniform:8:120", "--output-len", "fixed:8",
          "--replicas", "2", "--slo-ttft", "0.5", "--slo-from", "60", "--summary", str(summary), "--plot", str(plot)])
    data = json.loads(summary.read_text())
    assert data["requests"] > 100 and data["finished"] == data["requests"]
    assert 0 <= data["slo"]["attainment"] <= 1 and data["slo"]["ttft_s"] == 0.5
    assert data["slo_from"]["from_s"] == 60 and 0 <= data["slo_from"]["attainment"] <= 1
    assert data["ttft_s"]["p50"] <= data["ttft_s"]["p99"]
    assert data["replicas"]["started"] == 2 and data["replicas"]["replica_hours"] > 0
    assert data["machine"]["model"].startswith("llama")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()  # the headline, for a person; the JSON went to the file
    assert f"{data['finished']} of {data['requests']} requests finished" in printed.out and "TTFT p50" in printed.out
    # Progress on stderr, a line per tenth of the simulated span, the last one at its end.
    progress = [line for line in printed.err.splitlines() if line.startswith("simulated ")]
    assert len(progress) == 10 and progress[-1].endswith(f"of {data['requests']} requests finished")


def test_refused_requests_are_said_on_screen(cost_file, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    too_long = 100_000  # longer than any context the cost file's engine has
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.5, "prompt_tokens": too_long if i % 2 else 20,
                                         "output_tokens": 4}) + "\n" for i in range(10)))
    main(["simulate", "run", "--cost-model", str(cost_file), "--trace", str(trace), "--summary",
          str(tmp_path / "s.json")])
    printed = capsys.readouterr().out
    assert "5 requests refused (50%)" in printed


def test_a_recorded_trace_runs(cost_file, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 20 + i, "output_tokens": 4}) + "\n"
                             for i in range(10)))
    main(["simulate", "run", "--cost-model", str(cost_file), "--trace", str(trace)])
    data = json.loads(capsys.readouterr().out)
    assert data["requests"] == 10 and data["finished"] == 10


def test_bad_options_exit_with_the_field_named(cost_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "run", "--cost-model", str(cost_file), "--prompt-len", "gaussian:3"])
    assert exc.value.code == 2
    assert "prompt_len" in capsys.readouterr().err
