"""Mixtures of experts decode through kernel tapes (octavo/worker/kernel_tape.py) as the eager engine does: the
same tokens, the same log-probabilities and the same routing statistics, through decode batches that shrink across
the recorded sizes: 5 rows replay the size-8 tape with three padding rows, 3 rows the size-4 one with one. With int4
experts size 8 is refused (past 4 tokens they read their row counts back, quant/moe.py); in float32
(no grouped float32 experts kernel) every size's recording is
refused half way, after the layers before the first mixture counted, and the step runs eagerly. Neither padding
rows nor a refused attempt's layers may count. Mixtral, Qwen2-MoE (a gated shared expert, a dense layer),
Qwen3-MoE, DeepSeek-V3 (grouped top-k over biased sigmoid scores, latent attention), in bf16 (the bf16 experts
kernel), with int4 experts (the integer-dot-product one) and in float32."""
from __future__ import annotations

import json

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.worker.kernel_tape import KernelReplayError
from tests.engine.conftest import assert_no_leak, random_prompts
from tests.model_factory import make_variant

PROMPT_LENGTHS = [5, 17, 9, 30, 12]
MAX_TOKENS = [3, 6, 9, 12, 16]


def _generate(folder, eager: bool, dtype: str, recorded: list[int], **engine) -> tuple[list, dict[int, list[int]]]:
    llm = LLM(str(folder), dtype=dtype, num_blocks=64, enforce_eager=eager, **engine)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_TOKENS]
        outs = llm.generate(random_prompts(PROMPT_LENGTHS), params, use_tqdm=False)
        graphs = llm.engine.executor.worker.runner._graphs
        if eager:
            assert graphs is None
        else:
            assert graphs.recorded_sizes == recorded
            assert all(graphs._steps[size].settled for size in (1, 2, 4, 8))  # each tried on its second step
        assert_no_leak(llm)
        routes = llm.engine.get_stats().moe_routed_tokens
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], routes


RECORDED = [1, 2, 4, 8]


@pytest.mark.parametrize(("name", "dtype", "recorded", "engine"), [
    ("mixtral", "bfloat16", RECORDED, {}), ("qwen2_moe", "bfloat16", RECORDED, {}),
    ("qwen3_moe", "bfloat16", RECORDED, {}), ("deepseek_v3", "bfloat16", RECORDED, {}),
    # int4 experts past 4 tokens read counts back: size 8 refused half way, its steps eager.
    ("qwen3_moe", "bfloat16", [1, 2, 4], {"quantization": "int4", "quantization_group_size": 32}),
    ("qwen2_moe", "float32", [], {}),
], ids=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_moe-int4", "qwen2_moe-float32-refused"])
def test_recorded_moe_decode_equals_the_eager_engine(name, dtype, recorded, engine, tmp_path):
    folder = make_variant(tmp_path, name)
    taped, taped_routes = _generate(folder, False, dtype, recorded, **engine)
    eager, eager_routes = _generate(folder, True, dtype, recorded, **engine)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(taped, eager):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=0.05)
    assert taped_routes == eager_routes
    # Every layer counted top_k pairs for each token fed (each prompt, every generated token but the last), and
    # not one more: no padding row, no half-run step.
    top_k = json.loads((folder / "config.json").read_text())["num_experts_per_tok"]
    fed = sum(PROMPT_LENGTHS) + sum(MAX_TOKENS) - len(MAX_TOKENS)
    assert {layer: sum(counts) for layer, counts in taped_routes.items()} == {layer: top_k * fed
                                                                              for layer in taped_routes}


def test_a_replay_failing_after_its_kernels_ran_counts_its_step_once(tmp_path):
    """A replay that fails once it has run every kernel (routes counted) is run again eagerly: the step counts once,
    and its size runs eagerly from then on."""
    folder = make_variant(tmp_path, "qwen3_moe")
    first, second = random_prompts([7], seed=3), random_prompts([11], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    routes, tokens = {}, {}
    for eager in (False, True):
        llm = LLM(str(folder), dtype="bfloat16", num_blocks=64, enforce_eager=eager)
        try:
            llm.generate(first, params, use_tqdm=False)  # size 1 recorded, then replayed
            graphs = llm.engine.executor.worker.runner._graphs
            if not eager:
                step = graphs._steps[1]
                recorded = step.replay

                def fails_after_running() -> None:
                    recorded()
                    raise KernelReplayError("octavo_bf16_linear returned -1, recorded 0")

                step.replay = fails_after_running
            tokens[eager] = llm.generate(second, params, use_tqdm=False)[0].outputs[0].token_ids
            if not eager:
                assert graphs.recorded_sizes == []
            routes[eager] = llm.engine.get_stats().moe_routed_tokens
        finally:
            llm.shutdown()
    assert tokens[False] == tokens[True]
    assert routes[False] == routes[True]
