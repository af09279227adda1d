"""The engine process's answer when add_request fails: a 400 for bad input,
an error for that request alone for anything else."""
from __future__ import annotations

from octavo.engine import messages as msg
from octavo.engine.core_process import add_request
from octavo.sampling_params import SamplingParams


class _Engine:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.added: list[str] = []

    def add_request(self, request_id: str, *args: object, **kwargs: object) -> None:
        if self.error is not None:
            raise self.error
        self.added.append(request_id)


def _add(engine: _Engine) -> msg.FromEngine | None:
    return add_request(engine, msg.AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4)))


def test_queued_request_sends_nothing():
    engine = _Engine(None)
    assert _add(engine) is None and engine.added == ["r1"]


def test_value_error_is_a_rejection():
    answer = _add(_Engine(ValueError("max_tokens must be at least 1")))
    assert answer == msg.RequestRejected("r1", "max_tokens must be at least 1")


def test_any_other_error_fails_that_request_with_a_final_output():
    answer = _add(_Engine(KeyError("slot")))
    assert isinstance(answer, msg.StepOutputs)
    (delta,) = answer.outputs
    assert delta.request_id == "r1" and delta.finished and delta.error == "KeyError: 'slot'"
    # It crosses the process boundary like any message.
    assert msg.from_engine_decoder.decode(msg.encoder.encode(answer)) == answer
