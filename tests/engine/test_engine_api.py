"""The Python API: bad input is a ValueError and the engine keeps serving; aborts free blocks."""
from __future__ import annotations

import dataclasses
import shutil
import time

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak, hf_greedy, random_prompts
from tests.model_factory import EOS_ID, IM_END_ID

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir("llama"), dtype="float32", max_model_len=256)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([7] * 300, "maximum context length is 256 tokens"),
        ([7, 100000], "outside the vocabulary"),
    ],
)
def test_bad_prompt_is_value_error_and_engine_keeps_serving(llm, model_dir, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], prompt], GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    prompts = random_prompts([4, 9])
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(model_dir("llama"), prompts, 8)


def test_prompt_plus_max_tokens_over_limit(llm):
    with pytest.raises(ValueError, match="you requested 260 tokens"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=60), use_tqdm=False)
    assert_no_leak(llm)


def test_unknown_folder(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        LLM(tmp_path / "nope")


def test_unknown_attention_backend(model_dir):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model_dir("llama"), attention_backend="flash")


def test_unknown_linear_backend(model_dir):
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LLM(model_dir("llama"), linear_backend="mkl")


@pytest.mark.parametrize("backend", ["native", "onednn"])
def test_packed_linear_backends_refuse_float32(model_dir, backend):
    with pytest.raises(ValueError, match=f"linear_backend '{backend}' runs bfloat16"):
        LLM(model_dir("llama"), dtype="float32", linear_backend=backend)


def test_native_linear_backend_refuses_weights_its_kernel_cannot_read(model_dir, monkeypatch):
    from octavo.kernels.amx_linear import AmxLinearKernel, amx_linear_kernel

    if amx_linear_kernel() is None:
        pytest.skip("this CPU (or OS) offers no AMX bf16 tiles")
    monkeypatch.setattr(AmxLinearKernel, "share_onednn", lambda *_: None)  # as if oneDNN's layout changed
    with pytest.raises(ValueError, match="AMX kernel cannot read the packed weight"):
        LLM(model_dir("llama"), dtype="bfloat16", linear_backend="native")


def test_native_backend_refuses_a_cache_dtype_it_cannot_read(model_dir, monkeypatch):
    from octavo.kernels.paged_decode import PagedDecodeKernel

    monkeypatch.setattr(PagedDecodeKernel, "supports", staticmethod(lambda *_: False))
    with pytest.raises(ValueError, match="attention_backend 'native'"):
        LLM(model_dir("llama"), attention_backend="native")


def test_missing_safetensors(model_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(model_dir("llama"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(folder)


def test_abort_in_every_state_returns_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, n in enumerate([30, 60, 90, 120]):
        engine.add_request(f"abort-{i}", [9] * n, params)
    finals = {}

    def step():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out

    engine.abort_request(["abort-0"])  # still waiting
    step()  # the others start prefilling / decoding
    step()
    engine.abort_request(["abort-1", "abort-2"])
    while engine.has_unfinished_requests():
        step()
        if "abort-3" in finals or len(finals) >= 3:
            engine.abort_request(["abort-3"])
    assert {finals[f"abort-{i}"].outputs[0].finish_reason for i in range(3)} == {"abort"}
    assert_no_leak(llm)


def test_finish_reasons_and_eos(model_dir):
    llm = LLM(model_dir("llama"), dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    seq = out.outputs[0]
    assert len(seq.token_ids) <= 5
    if len(seq.token_ids) < 5:
        assert seq.finish_reason == "stop" and seq.token_ids[-1] in (1, 4)
    else:
        assert seq.finish_reason == "length"
    # A stop token chosen from the greedy continuation ends the sequence there.
    ref = hf_greedy(model_dir("llama"), [[5, 6, 7]], 8)[0]
    stop_at = ref[3]
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert_no_leak(llm)


def test_chat_uses_template(model_dir):
    llm = LLM(model_dir("llama"), dtype="float32")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def _drive(engine, prompts, params):
    """Every output each step yields, per request id, until all are done."""
    seen: dict[str, list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"kind-{params.output_kind.value}-{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


@pytest.mark.parametrize("stop", [[], ["e"]])
def test_final_only_yields_one_output_with_the_same_result(model_dir, stop):
    """final_only: no output until a request ends, then the same tokens and
    text as cumulative (decoded once at the end without stop strings, token by
    token with them, which may cut the text early)."""
    llm = LLM(model_dir("llama"), dtype="float32")
    prompts = random_prompts([5, 12, 30], seed=7)
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2, stop=stop)
    cumulative = _drive(llm.engine, prompts, base)
    final = _drive(llm.engine, prompts, dataclasses.replace(base, output_kind="final_only"))
    assert all(len(outs) > 1 for outs in cumulative.values())
    assert all(len(outs) == 1 and outs[0].finished for outs in final.values())
    for (_, c), (_, f) in zip(sorted(cumulative.items()), sorted(final.items())):
        for a, b in zip(c[-1].outputs, f[0].outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids, b.text, b.finish_reason, b.stop_reason)
    assert_no_leak(llm)


def test_final_only_abort_still_reports_the_text_so_far(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind="final_only")
    engine.add_request("final-abort", [9, 10, 11], params)
    for _ in range(4):
        assert engine.step() == []
    engine.abort_request(["final-abort"])
    (out,) = engine.step()
    seq = out.outputs[0]
    assert out.finished and seq.finish_reason == "abort" and seq.token_ids
    assert seq.text == llm.get_tokenizer().decode(seq.token_ids)
    assert_no_leak(llm)


def test_end_tokens_come_from_generation_config_before_config_json(model_dir):
    """generation_config.json's eos list wins over config.json's single id; the
    engine reads it from the model folder (no worker involved), and the ids
    after the first act as stop tokens."""
    from octavo.engine.llm_engine import LLMEngine
    from octavo.entrypoints.engine_args import engine_config

    engine = LLMEngine(engine_config(model_dir("llama"), dtype="float32", num_blocks=8))
    try:
        assert [engine.eos_token_id, *engine._extra_eos_ids] == [EOS_ID, IM_END_ID]
    finally:
        engine.shutdown()


def test_queue_time_ends_before_the_first_forward(folder):
    """first_scheduled_time marks the end of the wait in the queue: a slow first forward counts
    towards the time to first token, not the queue time."""
    llm = LLM(folder, dtype="float32", num_blocks=64)
    executor = llm.engine.executor
    real = executor.execute_model
    delay = 1.0

    def slow(step):
        time.sleep(delay)
        return real(step)

    executor.execute_model = slow
    try:
        out = llm.generate(["hello"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    finally:
        executor.execute_model = real
    m = out.metrics
    assert m.first_scheduled_time - m.arrival_time < delay
    assert m.first_token_time - m.first_scheduled_time >= delay


def test_a_model_folder_reached_by_a_symlink_is_served_under_the_symlinks_name(folder, tmp_path):
    link = tmp_path / "current-model"
    link.symlink_to(folder, target_is_directory=True)
    assert LLM(str(link) + "/", dtype="float32", num_blocks=16).engine.model_name == "current-model"


def test_max_logprobs_bounds_what_a_request_may_ask_for(folder):
    llm = LLM(folder, dtype="float32", num_blocks=16, max_logprobs=2)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 2"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0].top) == 2
    assert_no_leak(llm)


def test_generation_config_source(tmp_path):
    from tests.model_factory import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", generation_config={"eos_token_id": [1, 4], "temperature": 0.3})
    auto = LLM(folder, dtype="float32", num_blocks=16).engine
    assert auto.generation_defaults["temperature"] == 0.3
    none = LLM(folder, dtype="float32", num_blocks=16, generation_config="vllm").engine
    # No sampling defaults, but the checkpoint's stop tokens still end sequences.
    assert none.generation_defaults == {} and none._extra_eos_ids == auto._extra_eos_ids
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text('{"top_k": 7}')
    assert LLM(folder, dtype="float32", num_blocks=16, generation_config=str(other)).engine.generation_defaults == {"top_k": 7}
    with pytest.raises(ValueError, match="generation_config"):
        LLM(folder, dtype="float32", num_blocks=16, generation_config=str(tmp_path / "missing"))
    (other / "generation_config.json").write_text('{"max_new_tokens": 0}')
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        LLM(folder, dtype="float32", num_blocks=16, generation_config=str(other))
