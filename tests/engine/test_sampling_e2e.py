"""The sampling surface through LLM.generate / LLMEngine: parallel sampling on
shared KV blocks, best_of, seeds across batch mixes, stops, min_tokens,
penalties, biases and bans, and bad input."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.core.outputs import SchedulerOutput
from octavo.engine.llm_engine import LLMEngine
from octavo.outputs import RequestOutput
from tests.engine.conftest import random_prompts
from tests.engine.conftest import assert_no_leak
from tests.model_factory import EOS_ID, IM_END_ID, load_hf_model
from tests.worker.runner_utils import hf_logits

BLOCKS = 64  # 1024 tokens: ample here, and quick to allocate
BLOCK_SIZE = 16
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)

Adjust = Callable[[torch.Tensor, list[int]], torch.Tensor]


@pytest.fixture(scope="module")
def hf(folder):
    return load_hf_model(folder)


@pytest.fixture
def llm(folder):
    return LLM(folder, dtype="float32", num_blocks=BLOCKS)


def hf_greedy_with(
    hf_model: torch.nn.Module,
    prompt: list[int],
    steps: int,
    adjust: Adjust,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Reference greedy decoding: full transformers forwards, the last logits
    passed through ``adjust(logits, outputs so far)``; ends after a stop id."""
    out: list[int] = []
    for _ in range(steps):
        logits = adjust(hf_logits(hf_model, prompt + out)[-1].clone(), out)
        out.append(int(logits.argmax()))
        if out[-1] in stop_ids:
            break
    return out


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def generate_tokens(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """The first sequence's tokens of each prompt."""
    return tokens(llm.generate(prompts, params, use_tqdm=False))


# ---- parallel sampling -------------------------------------------------


def run_stepwise(
    engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], monkeypatch
) -> tuple[dict[str, RequestOutput], list[tuple[SchedulerOutput, int]]]:
    """Step the engine until the requests finish. Returns the final outputs and,
    per step, the scheduler's decision and the blocks in use after the step."""
    decisions: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        decisions.append(schedule())
        return decisions[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    steps: list[tuple[SchedulerOutput, int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        stats = engine.get_stats()
        steps.append((decisions[-1], stats.num_total_blocks - stats.num_free_blocks))
    return final, steps


def test_parallel_sampling_shares_prompt_blocks(folder, monkeypatch):
    n, max_tokens = 3, 6
    prompt = random_prompts([37], seed=31)[0]  # two full blocks and a partial one
    params = SamplingParams(n=n, temperature=1.0, seed=11, max_tokens=max_tokens, ignore_eos=True)
    # Prefix caching off: any sharing seen here comes from the fork alone.
    group = LLM(folder, dtype="float32", num_blocks=BLOCKS, enable_prefix_caching=False)
    final, steps = run_stepwise(group.engine, [("g", prompt, params)], monkeypatch)

    full = len(prompt) // BLOCK_SIZE
    per_seq = -(-(len(prompt) + max_tokens - 1) // BLOCK_SIZE)  # the last token's K/V is never written
    assert max(used for _, used in steps) == full + n * (per_seq - full)
    # The children join the parent's table right after its prompt; in the
    # step where all n write into the shared partial block, n - 1 of them
    # get a copy of it (the last writer keeps the original).
    # Each sequence's block table as the workers hold it: the deltas added up.
    tables: dict[str, list[int]] = {}
    for fork, _ in steps:
        for s in fork.scheduled:
            table = tables.setdefault(s.request_id, [])
            table[s.blocks_from :] = s.block_ids[0]
        if any(s.request_id == "g#1" for s in fork.scheduled):
            break
    assert len(tables) == n and all(t[:full] == tables["g#0"][:full] for t in tables.values())
    sources = {src for src, _ in fork.block_copies}
    assert len(fork.block_copies) == n - 1 and len(sources) == 1
    assert sources | {dst for _, dst in fork.block_copies} == {t[full] for t in tables.values()}
    assert_no_leak(group)

    alone = LLM(folder, dtype="float32", num_blocks=BLOCKS, enable_prefix_caching=False)
    separate = [
        (f"s{i}", prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=max_tokens, ignore_eos=True))
        for i in range(n)
    ]
    singles, single_steps = run_stepwise(alone.engine, separate, monkeypatch)
    assert max(used for _, used in single_steps) == n * per_seq

    group_tokens = [c.token_ids for c in final["g"].outputs]
    assert len({tuple(t) for t in group_tokens}) == n, "seeded sequences should differ"
    # Sequence i draws with seed + i, exactly as that seed alone does.
    assert group_tokens == [singles[f"s{i}"].outputs[0].token_ids for i in range(n)]
    assert_no_leak(alone)


def test_parallel_sampling_without_free_seats_and_abort(folder, llm):
    prompt = random_prompts([37], seed=31)[0]
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    # Two seats for three sequences: the third computes the prompt itself.
    crowded = LLM(folder, dtype="float32", num_blocks=BLOCKS, max_num_seqs=2)
    group = crowded.generate([prompt], SamplingParams(n=3, seed=11, **base), use_tqdm=False)[0]
    singles = generate_tokens(llm, [prompt] * 3, [SamplingParams(seed=11 + i, **base) for i in range(3)])
    assert [c.token_ids for c in group.outputs] == singles

    engine = crowded.engine
    engine.add_request("x", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    engine.abort_request(["x"])
    (final,) = engine.step()
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 4
    assert_no_leak(crowded)


def test_best_of_returns_the_most_likely(llm, hf):
    prompt = random_prompts([12], seed=32)[0]
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(n=2, best_of=5, seed=40, **base), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert all(o.logprobs is None for o in out.outputs), "logprobs were not asked for"

    # The five candidates are the seeds 40..44 alone; score them with transformers.
    candidates = generate_tokens(llm, [prompt] * 5, [SamplingParams(seed=40 + i, **base) for i in range(5)])
    scores = []
    for cand in candidates:
        ref = torch.log_softmax(hf_logits(hf, prompt + cand), dim=-1)
        scores.append(sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(cand)))
    ranked = sorted(range(5), key=lambda i: scores[i], reverse=True)[:2]
    assert [o.token_ids for o in out.outputs] == [candidates[i] for i in ranked]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([scores[i] for i in ranked], abs=1e-3)
    assert_no_leak(llm)


# ---- seeds ---------------------------------------------------------------


def test_seeded_sampling_is_batch_independent(folder, llm):
    target = random_prompts([23], seed=33)[0]
    others_a = random_prompts([5, 40, 17], seed=34)
    others_b = random_prompts([31, 3, 60], seed=35)
    params_a = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.7, max_tokens=20),  # unseeded: the global RNG
        SamplingParams(temperature=1.0, seed=1234, top_p=0.5, presence_penalty=1.0, max_tokens=8),
    ]
    params_b = [
        SamplingParams(temperature=1.3, min_p=0.1, max_tokens=16),
        SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.2, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=3),
    ]
    alone = generate_tokens(llm, [target], SEEDED)[0]
    with_a = generate_tokens(llm, others_a[:1] + [target] + others_a[1:], params_a[:1] + [SEEDED] + params_a[1:])
    with_b = generate_tokens(llm, others_b + [target], params_b + [SEEDED])
    chunked = LLM(folder, dtype="float32", num_blocks=BLOCKS, max_num_batched_tokens=16)
    with_chunks = generate_tokens(chunked, others_a + [target], params_a + [SEEDED])
    assert with_a[1] == with_b[3] == with_chunks[3] == alone
    # It really sampled: another seed and greedy decoding both differ.
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=12, ignore_eos=True)
    assert generate_tokens(llm, [target, target], [reseeded, greedy(12)]) != [alone, alone]
    assert_no_leak(llm)
    assert_no_leak(chunked)


def test_seeded_sampling_survives_preemption(folder, llm):
    prompts = random_prompts([20, 35, 50, 28], seed=5)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(4)]
    roomy = generate_tokens(llm, prompts, params)
    # Up to 80 tokens each need 18 blocks of 16; with 8, a request is evicted
    # after sampling some tokens and recomputes them later.
    tight = LLM(folder, dtype="float32", num_blocks=8)
    assert generate_tokens(tight, prompts, params) == roomy
    assert tight.engine.get_stats().num_preemptions > 0
    assert_no_leak(tight)


# ---- stops -----------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_output(llm, folder, include):
    prompt = "Once upon a time"
    seq = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert seq.text == tok.decode(seq.token_ids)
    # A stop string the greedy continuation surely produces: a printable
    # token from its middle.
    pieces = (tok.decode([t]) for t in seq.token_ids[4:])
    stop = next(text for text in pieces if len(text.strip()) >= 2 and text.isprintable())
    at = seq.text.index(stop)
    params = greedy(24, stop=[stop], include_stop_str_in_output=include)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text == seq.text[: at + len(stop) if include else at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == seq.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    # The tokens are the fewest that make the returned text: none of the cut stop string's own.
    assert tok.decode(out.token_ids).startswith(out.text)
    assert not out.token_ids or len(tok.decode(out.token_ids[:-1])) < len(out.text)
    assert_no_leak(llm)


def test_min_tokens_defers_stop_strings(llm):
    prompt, min_tokens = "Once upon a time", 5
    # The same bans as the stopped run below, so both choose the same tokens.
    full = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=min_tokens), use_tqdm=False
    )[0].outputs[0]
    tok = llm.get_tokenizer()
    stop = tok.decode(full.token_ids[1:2])  # would end the output after two tokens
    early = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]), use_tqdm=False)
    assert len(early[0].outputs[0].token_ids) <= 2
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=min_tokens, stop=[stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    # Only a match ending after the text of the first min_tokens tokens counts.
    first_text = len(tok.decode(full.token_ids[:min_tokens]))
    at = full.text.find(stop, max(0, first_text - len(stop) + 1))
    assert at != -1, "the stop string should recur later in this continuation"
    assert out.text == full.text[:at] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) > min_tokens
    assert_no_leak(llm)


def test_min_tokens_defers_stop_tokens(llm, hf):
    prompt = random_prompts([10], seed=36)[0]
    plain = generate_tokens(llm, [prompt], greedy(12))[0]
    stop_at = plain[1]
    stops = (stop_at, EOS_ID, IM_END_ID)  # the model's two end tokens stop too
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at])
    early = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert early.token_ids == plain[:2] and early.stop_reason == stop_at

    min_tokens = 5

    def ban_stops_early(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        if len(out) < min_tokens:
            logits[list(stops)] = float("-inf")
        return logits

    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], min_tokens=min_tokens)
    seq = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(seq.token_ids) > min_tokens
    assert seq.token_ids == hf_greedy_with(hf, prompt, 12, ban_stops_early, stops)
    assert_no_leak(llm)


# ---- logit processors ------------------------------------------------------


def presence_frequency(presence: float, frequency: float) -> Adjust:
    def adjust(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        return logits

    return adjust


def test_repetition_penalty_matches_transformers(llm, hf):
    prompt = random_prompts([8], seed=37)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
            repetition_penalty=1.8, eos_token_id=None, pad_token_id=2,
        )[0, len(prompt):].tolist()
    params = greedy(16, repetition_penalty=1.8)
    plain = greedy(16)
    penalised, unpenalised = generate_tokens(llm, [prompt, prompt], [params, plain])
    assert penalised == ref
    assert penalised != unpenalised


def test_presence_and_frequency_penalties(llm, hf):
    prompt = random_prompts([8], seed=38)[0]
    params = greedy(16, presence_penalty=1.5, frequency_penalty=1.0)
    plain = greedy(16)
    penalised, unpenalised = generate_tokens(llm, [prompt, prompt], [params, plain])
    assert penalised == hf_greedy_with(hf, prompt, 16, presence_frequency(1.5, 1.0))
    assert penalised != unpenalised


def test_logit_bias_allowed_token_ids_and_bad_words(llm, hf):
    prompt = random_prompts([9], seed=39)[0]
    plain = generate_tokens(llm, [prompt], greedy(10))[0]
    favoured = next(t for t in range(5, 512) if t not in plain)
    allowed = [plain[0] + 1, favoured]
    tok = llm.get_tokenizer()
    word = tok.decode([plain[0]])
    variants = SamplingParams(bad_words=[word])
    variants.resolve_bad_words(tok)
    bans = variants.bad_words_token_ids

    def no_bad_words(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for ids in bans:
            if len(out) >= len(ids) - 1 and out[len(out) - len(ids) + 1 :] == ids[:-1]:
                logits[ids[-1]] = float("-inf")
        return logits

    def only_allowed(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = logits[allowed]
        return keep

    params = [
        greedy(10, logit_bias={favoured: 100.0}),
        greedy(10, allowed_token_ids=allowed),
        greedy(10, bad_words=[word]),
    ]
    biased, restricted, cleaned = generate_tokens(llm, [prompt] * 3, params)
    assert biased == [favoured] * 10
    assert set(restricted) <= set(allowed)
    assert restricted == hf_greedy_with(hf, prompt, 10, only_allowed)
    assert cleaned[0] != plain[0]
    assert not any(cleaned[i : i + len(ids)] == ids for ids in bans for i in range(len(cleaned)))
    assert cleaned == hf_greedy_with(hf, prompt, 10, no_bad_words)
    assert_no_leak(llm)


# ---- bad input ---------------------------------------------------------------


def mutated(**fields: object) -> SamplingParams:
    """Params made valid, then changed behind the validation's back."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(n=2, best_of=1), "best_of"),
        (lambda: SamplingParams(logprobs=21), "logprobs"),
        (lambda: SamplingParams(max_tokens=3, min_tokens=4), "min_tokens"),
        (lambda: SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
        (lambda: SamplingParams(logit_bias={512: 1.0}), "logit_bias"),
        (lambda: SamplingParams(allowed_token_ids=[3, 999]), "allowed_token_ids"),
        (lambda: mutated(temperature=-1.0), "temperature"),
        (lambda: mutated(top_k=-5), "top_k"),
        (lambda: mutated(max_tokens=-2), "max_tokens"),
    ],
)
def test_invalid_params_raise_and_the_engine_keeps_serving(llm, hf, make, field):
    good = greedy(4)
    prompts = random_prompts([6, 11], seed=40)
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, [good, make()], use_tqdm=False)
    assert_no_leak(llm)
    assert generate_tokens(llm, prompts, good) == [
        hf_greedy_with(hf, p, 4, lambda logits, out: logits) for p in prompts
    ]
