"""The speculative decoding counters equal what the test counts itself: in
the engine's stats, in /metrics of a server, and in the log line."""
from __future__ import annotations


import octavo.worker.model_runner as model_runner
from octavo import LLM, SamplingParams
from octavo.engine.stats import EngineStats, StatsLogger, format_stats_line
from tests.engine.conftest import assert_no_leak, random_prompts
from tests.server.conftest import ServerProcess

# Not adaptive: the governor decides from timings, and the counts must not depend on them.
SPEC = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--no-speculative-adaptive"]
PROMPTS = [[7, 8, 9, 10] * 6, [40, 41, 42, 43, 44] * 4, *random_prompts([9, 30])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def counted_run(folder, monkeypatch) -> tuple[EngineStats, dict, list[str]]:
    """Run PROMPTS offline with speculation, counting every verification
    (proposals and accepted ones per request) as the runner sees them."""
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0, 0, 0]}
    verify = model_runner.verify

    def counting_verify(logits, meta, drafts, argmax):
        result = verify(logits, meta, drafts, argmax)
        for k, a in zip(drafts.num_draft, result.num_accepted):
            if k:
                counts["drafts"] += 1
                counts["draft_tokens"] += k
                counts["accepted"] += a
                for i in range(a):
                    counts["per_position"][i] += 1
        return result

    monkeypatch.setattr(model_runner, "verify", counting_verify)
    llm = LLM(folder, dtype="float32", speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    return llm.engine.get_stats(), counts, [o.outputs[0].text for o in outs]


def test_engine_counters_equal_the_verifications(model_dir, monkeypatch):
    stats, counts, _ = counted_run(model_dir("llama"), monkeypatch)
    assert counts["accepted"] > 0 and counts["draft_tokens"] > counts["accepted"]
    assert stats.spec_num_drafts == counts["drafts"]
    assert stats.spec_num_draft_tokens == counts["draft_tokens"]
    assert stats.spec_num_accepted_tokens == counts["accepted"]
    assert stats.spec_accepted_per_position == counts["per_position"]


def test_log_line_shows_the_mean_acceptance_length():
    prev = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=5,
                       spec_accepted_per_position=[4, 1, 0])
    now = EngineStats(num_running=2, generation_tokens=50, spec_num_drafts=30, spec_num_draft_tokens=90,
                      spec_num_accepted_tokens=35, spec_accepted_per_position=[16, 10, 4])
    line = format_stats_line(now, prev, 10.0)
    # 30 accepted over 20 verifications since the last line: 1 + 1.5 tokens per step.
    assert "mean acceptance length 2.50" in line and "acceptance rate 50.0%" in line
    assert "per position 0.60, 0.45, 0.20" in line
    assert "spec decode" not in format_stats_line(EngineStats(), EngineStats(), 1.0)


def test_stats_logger_logs_once_per_interval_while_busy(caplog):
    stats_logger = StatsLogger(interval_s=10.0)
    busy = EngineStats(num_running=1, generation_tokens=100, spec_num_drafts=10, spec_num_accepted_tokens=20)
    with caplog.at_level("INFO", logger="octavo.engine.stats"):
        assert stats_logger.maybe_log(EngineStats(), 0.0) is None  # the first snapshot: nothing to compare
        assert stats_logger.maybe_log(busy, 5.0) is None  # within the interval
        line = stats_logger.maybe_log(busy, 10.0)
        assert "generation 10.0 tok/s" in line and "mean acceptance length 3.00" in line
        assert stats_logger.maybe_log(EngineStats(generation_tokens=100), 30.0) is None  # idle since
    assert [r.getMessage() for r in caplog.records] == [line]


def test_server_metrics_equal_the_offline_counts(model_dir, monkeypatch, tmp_path):
    folder = model_dir("llama")
    _, counts, texts = counted_run(folder, monkeypatch)
    server = ServerProcess(folder, tmp_path / "server.log", *SPEC, "--num-blocks", "256", api_key=None)
    try:
        client = server.openai()
        for i, prompt in enumerate(PROMPTS):
            kwargs = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=40, temperature=0.0,
                          extra_body={"ignore_eos": True})
            if i % 2:  # streaming works with several tokens per step
                text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
            else:
                text = client.completions.create(**kwargs).choices[0].text
            assert text == texts[i]
        m = server.wait_idle()
    finally:
        server.stop()
    # Per request the proposals depend on its own tokens only: the same
    # counts as offline, whatever the server's batches were.
    assert m["octavo:spec_decode_num_drafts_total"] == counts["drafts"]
    assert m["octavo:spec_decode_num_draft_tokens_total"] == counts["draft_tokens"]
    assert m["octavo:spec_decode_num_accepted_tokens_total"] == counts["accepted"]
    for i, n in enumerate(counts["per_position"]):
        assert m[f"octavo:spec_decode_num_accepted_tokens_per_pos_total[position={i}]"] == n
