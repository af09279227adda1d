"""The engine <-> front wire format: deltas through msgpack fold back into the whole output."""
from __future__ import annotations

import pytest

from octavo.engine import messages as msg
from octavo.engine.stats import EngineStats
from octavo.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, RequestOutput, TokenLogprobs
from octavo.sampling_params import SamplingParams, StructuredOutputParams


def _lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=t, logprob=-0.1 * t, rank=1, top=[(t, -0.1 * t), (t + 1, -2.0)])


def _deltas() -> list[RequestOutput]:
    """One n=2 request as an engine reports it with RequestOutputKind.DELTA:
    each step only the sequences that progressed, with their new part."""
    texts = [["He", "ll", "o", "", "!"], ["a", "b", "", "c", "d"]]
    steps = []
    for step in range(5):
        choices = []
        for i in range(2):
            if i == 0 and step == 3:
                continue  # no progress for this sequence at this step
            choices.append(
                CompletionOutput(
                    index=i,
                    text=texts[i][step],
                    token_ids=[10 * i + step],
                    cumulative_logprob=-float(step),
                    logprobs=[_lp(10 * i + step)],
                    finish_reason=("stop" if i == 0 else "length") if step == 4 else None,
                    stop_reason="!" if (i == 0 and step == 4) else None,
                )
            )
        steps.append(
            RequestOutput(
                request_id="r1",
                prompt=None,
                prompt_token_ids=[1, 2, 3],
                outputs=choices,
                finished=step == 4,
                prompt_logprobs=[None, _lp(2)] if step == 0 else [_lp(3)] if step == 1 else None,
                num_cached_tokens=2,
                metrics=RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5 if step else None),
            )
        )
    return steps


def test_deltas_fold_back_into_the_whole_output_through_msgpack():
    acc = OutputAccumulator([1, 2, 3], "prompt")
    for delta in _deltas():
        wire = msg.encoder.encode(msg.StepOutputs([msg.to_message(delta)]))
        decoded = msg.from_engine_decoder.decode(wire)
        assert isinstance(decoded, msg.StepOutputs)
        assert decoded.outputs[0].outputs == delta.outputs  # sent as is: the new part only
        acc.add(msg.from_message(decoded.outputs[0]))
    whole = acc.take()
    assert (whole.request_id, whole.prompt, whole.prompt_token_ids) == ("r1", "prompt", [1, 2, 3])
    assert [c.text for c in whole.outputs] == ["Hello!", "abcd"]
    assert [c.token_ids for c in whole.outputs] == [[0, 1, 2, 4], [10, 11, 12, 13, 14]]
    assert [lp.token_id for lp in whole.outputs[1].logprobs] == [10, 11, 12, 13, 14]
    assert [(c.finish_reason, c.stop_reason) for c in whole.outputs] == [("stop", "!"), ("length", None)]
    assert whole.prompt_logprobs == [None, _lp(2), _lp(3)]
    assert whole.finished and whole.metrics == RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5)


def test_take_returns_what_came_since_the_last_take():
    acc = OutputAccumulator([1, 2, 3])
    deltas = _deltas()
    acc.add(deltas[0])
    first = acc.take()
    assert [c.text for c in first.outputs] == ["He", "a"] and not first.finished
    for d in deltas[1:4]:
        acc.add(d)
    merged = acc.take()  # a reader that fell behind: three steps as one
    assert [c.token_ids for c in merged.outputs] == [[1, 2], [11, 12, 13]]
    assert [c.text for c in merged.outputs] == ["llo", "bc"]
    assert merged.prompt_logprobs == [_lp(3)]
    acc.add(deltas[4])
    last = acc.take()
    assert last.finished and [c.token_ids for c in last.outputs] == [[4], [14]]


def test_requests_and_stats_round_trip():
    params = SamplingParams(
        n=2, temperature=0.5, stop=["x"], logit_bias={"3": 1.0},
        structured_outputs=StructuredOutputParams(json_schema={"type": "object"}),
    )
    add = msg.AddRequest("r", [1, 2], params, priority=3, arrival_time=12.5)
    assert msg.to_engine_decoder.decode(msg.encoder.encode(add)) == add
    stats = msg.StatsUpdate(EngineStats(num_running=1, num_free_blocks=3, num_total_blocks=4, prompt_tokens=9,
                                        moe_routed_tokens={0: [3, 1]}, moe_load_imbalance={0: 1.5}))
    assert msg.from_engine_decoder.decode(msg.encoder.encode(stats)) == stats
    abort = msg.AbortRequests(["a", "b"])
    assert msg.to_engine_decoder.decode(msg.encoder.encode(abort)) == abort


def test_parse_bytes():
    from octavo.entrypoints.options import parse_bytes

    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes("1000") == 1000
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("lots")
