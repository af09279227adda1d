"""`octavo serve --quantization int4` end to end: the server's engine
quantizes at start-up (its logprobs are those of the offline LLM with the same
options, not the unquantized model's) and serves completions; the
model-level checks are in tests/quant/."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.server.conftest import ServerProcess

OPTIONS = ("--quantization", "int4", "--quantization-group-size", "32")


def _offline_logprobs(model_path, **options) -> list[float]:
    llm = LLM(model_path, dtype="float32", num_blocks=64, **options)
    try:
        out = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0, logprobs=0), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return [entry.logprob for entry in out.outputs[0].logprobs]


def test_serve_quantizes_at_start_up_and_serves(model_path, tmp_path):
    srv = ServerProcess(model_path, tmp_path / "server.log", "--num-blocks", "64", *OPTIONS)
    try:
        client = srv.openai()
        out = client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=5,
                                        temperature=0, logprobs=0)
    finally:
        srv.stop()
    served = out.choices[0].logprobs.token_logprobs
    assert len(served) == 5
    quantized = _offline_logprobs(model_path, quantization="int4", quantization_group_size=32)
    assert served == pytest.approx(quantized, abs=1e-4)
    assert served != pytest.approx(_offline_logprobs(model_path), abs=1e-3)
