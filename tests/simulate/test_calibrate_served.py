"""`octavo simulate calibrate --served URL` against a real `octavo serve`."""
from __future__ import annotations

import httpx
import pytest

from octavo.entrypoints.calibrate_served import ServedProbePlan, calibrate_served
from octavo.entrypoints.cli import main
from octavo.simulate.cost_model import CostModel, EngineShape
from octavo.simulate.served_steps import read_served_steps
from tests.model_factory import make_tiny_model
from tests.server.conftest import ServerProcess
from tests.simulate.sim_helpers import cost_model

ENGINE = ["--max-model-len", "128", "--num-blocks", "512", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    model = make_tiny_model(folder / "model")
    steps = folder / "steps.jsonl"
    server = ServerProcess(model, folder / "server.log", *ENGINE, "--step-record", str(steps), api_key=None)
    yield model, server, steps
    server.stop()


def test_calibration_fits_the_served_terms_from_the_server(served, tmp_path):
    model, server, _steps = served
    out = tmp_path / "cost.json"
    main(["simulate", "calibrate", str(model), "--dtype", "float32", *ENGINE, "-o", str(out), "--repeats", "1",
          "--max-batch", "4", "--clock", "cpu", "--served", server.url])
    cost = CostModel.load(out)
    plan = ServedProbePlan().fitted_to(128, 8, cost.engine.max_num_batched_tokens)
    # Every lone prompt and every batch, in each measured round (the warm-up round is left out).
    assert cost.served.num_probes == plan.repeats * (len(plan.prompt_lens) + len(plan.batches))
    # The server kept saturated weighs in, its time per output token read from the server's histogram.
    assert cost.served.saturation_probes == 1 and abs(cost.served.saturation_rel_error) < 0.5
    assert cost.served.load_avg.count("/") == 2
    assert set(cost.fit.by_kind) == {"decode", "prefill", "mixed"}
    # The probes leave nothing behind: the server holds no request afterwards.
    metrics = httpx.get(f"{server.url}/metrics").text
    running = [line for line in metrics.splitlines() if line.startswith("octavo:num_requests_running")]
    assert running and all(float(line.split()[-1]) == 0 for line in running)


def test_with_its_step_record_the_fit_is_to_the_servers_own_steps(served):
    """Poisson arrivals at three rates, each set by the fit to the steps before it: the terms come from the steps
    the server recorded meanwhile, and the per-request cost from the lone requests."""
    model, server, steps = served
    bare = cost_model(step=1e-3, prefill_tokens=1e-5, decode_seqs=1e-4)
    bare.engine = EngineShape(num_kv_blocks=512, block_size=16, max_model_len=128, max_num_seqs=8,
                              max_num_batched_tokens=2048)
    plan = ServedProbePlan(repeats=1, load_s=2.0)
    served_cost = calibrate_served(server.url, bare, vocab_size=100, plan=plan, steps_path=steps)
    recorded = read_served_steps(steps)
    assert 0 < served_cost.served_steps <= len(recorded)
    assert served_cost.engine_scale >= 1 and served_cost.num_probes == len(plan.fitted_to(128, 8, 2048).prompt_lens)
    # Real steps of equal work differ: a spread, about terms that describe a typical step (a stretch of median 1).
    assert served_cost.step_noise_sigma > 0 and served_cost.step_noise_mu == 0.0
    assert served_cost.served_steps_total_rel_error > -1 and served_cost.load_avg.count("/") == 2


def test_a_server_that_cannot_be_probed_is_a_clear_error():
    with pytest.raises(ValueError, match="served: cannot probe"):
        calibrate_served("http://127.0.0.1:9", cost_model(step=1e-3), vocab_size=100)
