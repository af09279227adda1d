"""The engine <-> front wire format: deltas rebuild exactly the engine's cumulative outputs."""
from __future__ import annotations

import copy

import pytest

from octavo.engine import messages as msg
from octavo.engine.stats import EngineStats
from octavo.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from octavo.sampling_params import SamplingParams, StructuredOutputParams


def _lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=t, logprob=-0.1 * t, rank=1, top=[(t, -0.1 * t), (t + 1, -2.0)])


def _engine_outputs() -> list[RequestOutput]:
    """Snapshots of one n=2 request as an engine would report them step by step."""
    texts = [["He", "Hell", "Hello", "Hello", "Hello!"], ["a", "ab", "a?", "a?c", "a?cd"]]  # "ab" -> "a?": text revised
    snaps = []
    for step in range(5):
        choices = []
        for i in range(2):
            ids = list(range(10 * i, 10 * i + step + 1))
            choices.append(
                CompletionOutput(
                    index=i,
                    text=texts[i][step],
                    token_ids=ids,
                    cumulative_logprob=-float(step),
                    logprobs=[_lp(t) for t in ids],
                    finish_reason=("stop" if i == 0 else "length") if step == 4 else None,
                    stop_reason="!" if (i == 0 and step == 4) else None,
                )
            )
        snaps.append(
            RequestOutput(
                request_id="r1",
                prompt=None,
                prompt_token_ids=[1, 2, 3],
                outputs=choices,
                finished=step == 4,
                prompt_logprobs=[None, _lp(2), _lp(3)],
                num_cached_tokens=2,
                metrics=RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5 if step else None),
            )
        )
    return snaps


def test_deltas_rebuild_cumulative_outputs_through_msgpack():
    tracker = msg.DeltaTracker()
    rebuilt = RequestOutput("r1", None, [1, 2, 3], [], finished=False)
    for snap in _engine_outputs():
        wire = msg.encoder.encode(msg.StepOutputs([tracker.delta(copy.deepcopy(snap))]))
        decoded = msg.from_engine_decoder.decode(wire)
        assert isinstance(decoded, msg.StepOutputs)
        msg.apply_delta(rebuilt, decoded.outputs[0])
        assert rebuilt.outputs == snap.outputs
        assert rebuilt.prompt_logprobs == snap.prompt_logprobs
        assert rebuilt.finished == snap.finished
        assert rebuilt.metrics == snap.metrics
    assert tracker._sent == {}  # finished requests are forgotten


def test_deltas_send_only_new_tokens():
    tracker = msg.DeltaTracker()
    snaps = _engine_outputs()
    tracker.delta(snaps[0])
    d = tracker.delta(snaps[1])
    assert [c.token_ids for c in d.choices] == [[1], [11]]
    assert [c.text for c in d.choices] == ["ll", "b"]
    assert d.prompt_logprobs is None  # sent with the first delta already
    d = tracker.delta(snaps[2])
    assert (d.choices[1].text_start, d.choices[1].text) == (0, "a?")  # revision resends the text


def test_requests_and_stats_round_trip():
    params = SamplingParams(
        n=2, temperature=0.5, stop=["x"], logit_bias={"3": 1.0},
        structured_outputs=StructuredOutputParams(json_schema={"type": "object"}),
    )
    add = msg.AddRequest("r", [1, 2], params, priority=3, arrival_time=12.5)
    assert msg.to_engine_decoder.decode(msg.encoder.encode(add)) == add
    stats = msg.StatsUpdate(EngineStats(num_running=1, num_free_blocks=3, num_total_blocks=4, prompt_tokens=9))
    assert msg.from_engine_decoder.decode(msg.encoder.encode(stats)) == stats
    abort = msg.AbortRequests(["a", "b"])
    assert msg.to_engine_decoder.decode(msg.encoder.encode(abort)) == abort


def test_parse_bytes():
    from octavo.entrypoints.engine_args import parse_bytes

    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes("1000") == 1000
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("lots")
