"""`octavo serve --quantization int4` end to end: the server's engine
quantizes at start-up (its logprobs are those of the offline LLM with the same
options, not the unquantized model's) and serves completions; the
model-level checks are in tests/quant/."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.server.conftest import ServerProcess

OPTIONS = ("--quantization", "int4", "--quantization-group-size", "32")


def _offline_logprobs(llm: LLM) -> list[float]:
    out = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0, logprobs=0), use_tqdm=False)[0]
    return [entry.logprob for entry in out.outputs[0].logprobs]


def test_serve_quantizes_at_start_up_and_serves(model_path, offline_llm, tmp_path):
    srv = ServerProcess(model_path, tmp_path / "server.log", "--num-blocks", "64", *OPTIONS)
    try:
        client = srv.openai()
        out = client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=5,
                                        temperature=0, logprobs=0)
    finally:
        srv.stop()
    served = out.choices[0].logprobs.token_logprobs
    assert len(served) == 5
    quantized_llm = LLM(model_path, dtype="float32", num_blocks=64, quantization="int4", quantization_group_size=32)
    try:
        quantized = _offline_logprobs(quantized_llm)
    finally:
        quantized_llm.shutdown()
    assert served == pytest.approx(quantized, abs=1e-4)
    assert served != pytest.approx(_offline_logprobs(offline_llm), abs=1e-3)
