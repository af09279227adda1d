"""The token that stops a sequence (EOS, or one of stop_token_ids) is not
part of the output text, as in vLLM, even when special tokens are kept:
tool-call parsers read text with special tokens and would take "</s>" for
the model's words. include_stop_str_in_output puts it back."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.sampling_params import RequestOutputKind, StructuredOutputParams
from tests.model_factory import EOS_ID, IM_END_ID, SPECIAL_TOKENS

# The grammar ends after "yes": only a stop token may follow (the
# generation_config's EOS ids: </s> and <|im_end|>).
YES = StructuredOutputParams(choice=["yes"])


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", num_blocks=64)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize("skip_special", [True, False])
def test_stop_token_text_is_left_out(llm, kind, skip_special):
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=YES,
                            skip_special_tokens=skip_special, output_kind=kind)
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] in (EOS_ID, IM_END_ID) and out.finish_reason == "stop"
    assert out.text == "yes"


def test_include_stop_str_in_output_keeps_it(llm):
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=YES,
                            skip_special_tokens=False, include_stop_str_in_output=True)
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "yes" + SPECIAL_TOKENS[out.token_ids[-1]]
