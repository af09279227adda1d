"""Property: any keyword arguments give a valid SamplingParams or a ValueError, never another exception."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.sampling_params import SamplingParams

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.text(max_size=8),
    st.sampled_from(["\ud800", "cumulative", "final_only", "a"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3)),
    max_leaves=8,
)
_ids = st.lists(st.integers(0, 100), max_size=4)
_VALID = {  # plausible values, so that many examples pass validation and reach the later checks
    "n": st.integers(1, 4), "best_of": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3), "stop_token_ids": _ids,
    "max_tokens": st.integers(0, 64), "min_tokens": st.integers(0, 8), "logprobs": st.integers(0, 20),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": _ids, "bad_words": st.lists(st.text("abc ", min_size=1, max_size=4), max_size=2),
    "truncate_prompt_tokens": st.integers(1, 10**6), "presence_penalty": st.floats(-2, 2),
    "structured_outputs": st.sampled_from([{"regex": "a+"}, {"choice": ["x"]}, {"json_object": True}]),
    "repetition_penalty": st.floats(0.1, 2), "frequency_penalty": st.floats(-2, 2), "prompt_logprobs": st.integers(0, 20),
    "output_kind": st.sampled_from(["cumulative", "delta", "final_only"]), "_bad_words_token_ids": st.lists(_ids, max_size=2),
    **{name: st.booleans() for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize")},
}
_kwargs = st.fixed_dictionaries(
    {}, optional={name: st.one_of(*[_VALID[name]] * 8, _values) if name in _VALID else _values for name in _FIELDS}
)


@settings(max_examples=400, deadline=None)
@given(_kwargs)
def test_any_arguments_are_valid_or_a_value_error(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    # Accepted: the checks the engine relies on hold.
    assert isinstance(params.n, int) and 1 <= params.n <= params.best_of
    assert isinstance(params.stop, list) and all(isinstance(s, str) and s for s in params.stop)
    dataclasses.replace(params)  # the engine copies params per sequence; that must not fail either
