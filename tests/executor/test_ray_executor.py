"""TP=2 through a local Ray cluster gives the tokens of one process; so does expert parallelism (a
tiny Mixtral, each actor holding half the experts), with the same routing counts."""
from __future__ import annotations

import pytest
import ray  # the test extra installs it; users get it with octavo[ray]

from octavo import LLM
from tests.executor.test_tensor_parallel_engine import ENGINE, GREEDY, PROMPTS
from tests.model_factory import make_tiny_model, make_variant


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_tp2_on_ray_matches_tp1(local_cluster, tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    want = [o.outputs[0].token_ids for o in LLM(folder, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
    split = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", threads_per_worker=1, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in split.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
    finally:
        split.shutdown()


def test_expert_parallel_on_ray_matches_one_process(local_cluster, tmp_path):
    folder = make_variant(tmp_path, "mixtral")
    one = LLM(folder, **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want_routes = one.engine.get_stats().moe_routed_tokens
    split = LLM(folder, tensor_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="ray",
                threads_per_worker=1, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in split.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want and split.engine.get_stats().moe_routed_tokens == want_routes
    finally:
        split.shutdown()
