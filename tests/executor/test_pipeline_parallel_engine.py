"""Pipeline parallelism: a 3-layer Llama split over two stages (two layers,
then one) gives exactly the greedy tokens of one process, with chunked
prefill, prefix hits and preemption, and two steps in flight; TP=2 x PP=2
(four ranks) on a GQA model gives the same tokens, and so do two stages that each hold the layers
of one KV cache group.

Logprobs agree within 1e-5, not bitwise: with two steps in flight the
batches are composed differently (a request waits for its step to come
back), and a matmul's rounding depends on its row count."""
from __future__ import annotations

from octavo import LLM, SamplingParams
from tests.executor.test_tensor_parallel_engine import ENGINE, PROMPTS
from tests.model_factory import make_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_pp2_gives_the_tokens_of_pp1(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    want = _run(LLM(folder, **ENGINE))
    split = LLM(folder, pipeline_parallel_size=2, threads_per_worker=1, **ENGINE)
    engine = split.engine
    depths = []  # steps in flight once each step is submitted
    submit = engine.executor.submit
    engine.executor.submit = lambda out: (depths.append(len(engine._in_flight) + 1), submit(out))
    try:
        got = _run(split)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) < 1e-5
        # While the second stage runs a step, the first runs the next one.
        assert max(depths) == 2
        stats = engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    finally:
        split.shutdown()


def test_tp2_x_pp2_gives_the_same_tokens(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3", num_hidden_layers=2)  # q/k norms; 4 heads, 2 KV heads
    want = [t for t, _ in _run(LLM(folder, **ENGINE))]
    split = LLM(folder, tensor_parallel_size=2, pipeline_parallel_size=2, threads_per_worker=1, **ENGINE)
    try:
        assert [t for t, _ in _run(split)] == want
    finally:
        split.shutdown()



def test_pp2_with_a_stage_per_kv_cache_group(tmp_path):
    """Qwen2 with a global layer 0 and a sliding layer 1 (window 16): each stage holds the layer of one KV
    cache group and reads that group's tables (the sliding one released as the window moves on), and the
    tokens are those of one process."""
    folder = make_tiny_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    want = [t for t, _ in _run(LLM(folder, **ENGINE))]
    split = LLM(folder, pipeline_parallel_size=2, threads_per_worker=1, **ENGINE)
    try:
        assert [t for t, _ in _run(split)] == want
        assert split.engine.scheduler.kv_cache_manager.windows == (None, 16)
    finally:
        split.shutdown()
