"""``octavo simulate calibrate --served URL``: probe a running `octavo serve` of
the calibrated model and fit what serving adds to the bare engine steps
(octavo/simulate/served.py).

Three kinds of probe, each a streaming /v1/completions request with the prompt
as token ids and ``ignore_eos`` (so its work is known exactly):
- lone requests of several prompt lengths, nothing else in flight: their time
  to first token is one prefill step plus the per-request cost;
- batches of requests sent together with prompts short enough to prefill in
  one step: from its first token to its last every step decodes the whole
  batch, so their mean time per output token is one served decode step of the
  batch. It is read from the server's own histogram
  (``octavo:request_time_per_output_token_seconds``, its sum and count before
  and after), not at the client: a client on the same loaded cores reads 32
  streams in bursts, and its own time would be taken for the server's.
- the server kept saturated: twice as many clients as the batch holds, each
  sending its next request (outputs of mixed lengths) as its last ends, so
  prompts join the full batch as others finish, as under a load past
  saturation. Their mean time per output token is read from the server's
  histogram as above, from the end of the first third (the batch full and
  the engine past its first steps of each shape) to the end. The scheduler,
  run on more such requests than the batch holds, says which steps a
  saturated engine runs; the fit makes the served terms give that mean step
  (octavo/simulate/served.py).

With the server's step record (``octavo serve --step-record PATH``, given
here as ``steps_path``) the saturated probe gives way to what the server's
own steps say: after the probes above (which set the per-request cost and a
first guess at saturation), open-loop Poisson arrivals at 0.6, 1 and 1.6
times the saturation rate, 8 s each (prompts of 128-256 tokens, 32-96
output tokens), and the step terms are fitted to the steps the server ran
meanwhile, each from its start to the next one's (``ServedCost.fit_steps``).
The fit is redone after each rate and sets the next: at load 11 the probes
put saturation at 43 req/s, twice what the steps then said, and all three
rates ran a full batch. Closed-loop
clients keep one batch mix (a full batch, most of it decoding, one prompt
joining as one request ends); Poisson arrivals past saturation build a queue
and another mix of prompt chunks and decode rows. Kept saturated by 64
clients, a quiet server decoded at 8.32 ms a token, where Poisson arrivals
drew 35% more output tokens/s from it, which put the simulator's capacity
26% low.

Each batch size runs once unmeasured first: the engine records a decode step
the first time it meets a batch size, a one-off cost served traffic does not
pay again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Awaitable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.replica import ReplicaShape, burst_steps
from octavo.simulate.served import SaturationProbe, ServedCost, ServedProbe
from octavo.simulate.served_steps import read_served_steps
from octavo.simulate.traces import LengthDist, TraceSpec, generate

logger = logging.getLogger(__name__)

TPOT_HISTOGRAM = "octavo:request_time_per_output_token_seconds"


@dataclass(frozen=True)
class ServedProbePlan:
    """The probe set: lone prompts of ``prompt_lens``; batches of ``batches`` decoding ``decode_tokens`` each
    after ``batch_prompt_len``-token prompts; all ``repeats`` times. Then the server kept saturated for
    ``saturation_s`` by ``saturation_clients_per_seq`` clients per sequence the engine batches, each sending
    ``saturation_prompt_len``-token prompts with outputs uniform in ``saturation_output``, one after another.
    With the server's step record: instead of that, Poisson arrivals for ``load_s`` at each of ``load_factors``
    times the saturation rate the other probes predict, prompts and outputs uniform in ``load_prompt`` and
    ``load_output``."""

    prompt_lens: tuple[int, ...] = (32, 128, 256, 384)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    batch_prompt_len: int = 32
    decode_tokens: int = 48
    repeats: int = 4
    saturation_s: float = 12.0
    saturation_clients_per_seq: int = 2
    saturation_prompt_len: int = 192
    saturation_output: tuple[int, int] = (32, 96)
    load_factors: tuple[float, ...] = (0.6, 1.0, 1.6)
    load_s: float = 8.0
    load_prompt: tuple[int, int] = (128, 256)
    load_output: tuple[int, int] = (32, 96)
    max_load_requests: int = 2000  # per rate: a fit gone wrong must not send millions of requests

    def fitted_to(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> ServedProbePlan:
        """Cut to the engine's context, sequence limit and token budget (a batch's prompts fit one step)."""
        room = max(2, max_model_len - self.decode_tokens - 8)
        batches = tuple(sorted({min(b, max_num_seqs) for b in self.batches}))
        batch_prompt = max(2, min(self.batch_prompt_len, room, max_num_batched_tokens // batches[-1]))
        longest = max(2, min(self.saturation_output[1], max_model_len // 2))
        saturation_output = (min(self.saturation_output[0], longest), longest)
        saturation_prompt = max(2, min(self.saturation_prompt_len, max_model_len - longest - 8))
        load_output = (min(self.load_output[0], longest), min(self.load_output[1], longest))
        load_longest = max(2, min(self.load_prompt[1], max_model_len - load_output[1] - 8))
        load_prompt = (min(self.load_prompt[0], load_longest), load_longest)
        return replace(self, prompt_lens=tuple(sorted({min(n, room) for n in self.prompt_lens})), batches=batches,
                       batch_prompt_len=batch_prompt, saturation_prompt_len=saturation_prompt,
                       saturation_output=saturation_output, load_prompt=load_prompt, load_output=load_output)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of a server-sent event stream, up to ``[DONE]``. Lines are split at ``\n`` only: httpx's
    ``aiter_lines`` also splits at U+0085, U+2028 and U+2029, which JSON leaves unescaped in a token's text (a
    tiny model's random tokens stream them), cutting an event in two."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                return
            if data:
                yield json.loads(data)


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """When (``time.perf_counter``) each streamed chunk that carries tokens arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ValueError(f"served: HTTP {r.status_code} from the server: {(await r.aread())[:200]!r}")
        async for event in sse_events(r):
            if event.get("choices"):
                times.append(time.perf_counter())
    return times


async def _histogram_sum_count(client: httpx.AsyncClient, name: str = TPOT_HISTOGRAM) -> tuple[float, float]:
    """One of the server's histograms: its sum and count so far."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        raise ValueError(f"served: HTTP {r.status_code} from /metrics (the probes read its histograms)")
    values = {}
    for family in text_string_to_metric_families(r.text):
        if family.name == name:
            values.update({s.name: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))})
    if not values:
        raise ValueError(f"served: the server's /metrics has no {name}")
    return values[f"{name}_sum"], values[f"{name}_count"]


async def _histogram_mean(client: httpx.AsyncClient, name: str, run: Awaitable[object]) -> float:
    """The mean of what the server's histogram ``name`` observed while ``run`` ran."""
    before = await _histogram_sum_count(client, name)
    await run
    after = await _histogram_sum_count(client, name)
    return (after[0] - before[0]) / max(1.0, after[1] - before[1])


async def _probe(base_url: str, model: str, cost: CostModel, plan: ServedProbePlan, vocab_size: int,
                 seed: int) -> list[ServedProbe]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:  # random ids: no prefix-cache hit shortens a probe
        return [rng.randrange(5, vocab_size - 10) for _ in range(n)]

    probes: list[ServedProbe] = []
    # A fresh connection per request: a kept-alive one can meet the server closing it as it idles out.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        for repeat in range(plan.repeats + 1):
            measured: list[ServedProbe] = []
            for n in plan.prompt_lens:
                sent = time.perf_counter()
                times = await _stream(client, model, prompt(n), 2)
                engine_s = cost.predict(StepWork(n, 1, n * (n + 1) / 2, sampled_seqs=1))
                measured.append(ServedProbe(engine_s, 1, times[0] - sent, first_token=True))
            for b in plan.batches:
                n, out = plan.batch_prompt_len, plan.decode_tokens
                tpot = await _histogram_mean(client, TPOT_HISTOGRAM,
                                             asyncio.gather(*[_stream(client, model, prompt(n), out) for _ in range(b)]))
                engine_s = sum(cost.predict(StepWork(decode_seqs=b, decode_context_tokens=b * (n + j),
                                                     sampled_seqs=b)) for j in range(1, out)) / (out - 1)
                measured.append(ServedProbe(engine_s, b, tpot, first_token=False))
            if repeat:  # round 0 warms the front and records the engine's steps
                probes += measured
            logger.info("served calibration: round %d/%d done", repeat, plan.repeats)
    return probes


async def _saturate(base_url: str, model: str, cost: CostModel, plan: ServedProbePlan, vocab_size: int,
                    seed: int) -> list[SaturationProbe]:
    """The server kept saturated (module docstring) for ``plan.saturation_s``; measured after the first third (the
    batch fills and the engine meets the steps' shapes)."""
    rng = random.Random(seed)
    shape = ReplicaShape.of_engine(cost.engine)
    clients = plan.saturation_clients_per_seq * shape.scheduler.max_num_seqs

    def request() -> tuple[list[int], int]:
        return ([rng.randrange(5, vocab_size - 10) for _ in range(plan.saturation_prompt_len)],
                rng.randint(*plan.saturation_output))

    # The steady steps of such requests, queued at once: 8 per client give a long steady state to average.
    lengths = [(plan.saturation_prompt_len, rng.randint(*plan.saturation_output)) for _ in range(8 * clients)]
    steps = burst_steps(shape, lengths, seed)
    deadline = time.perf_counter() + plan.saturation_s
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) \
            as client:

        async def keep_sending() -> None:
            while time.perf_counter() < deadline:
                await _stream(client, model, *request())

        async def measure() -> float:
            await asyncio.sleep(plan.saturation_s / 3)
            return await _histogram_mean(client, TPOT_HISTOGRAM, asyncio.sleep(deadline - time.perf_counter()))

        tpot, *_ = await asyncio.gather(measure(), *[keep_sending() for _ in range(clients)])
    logger.info("served calibration: %d clients for %.0f s: %.2f ms per output token", clients, plan.saturation_s,
                tpot * 1e3)
    return [SaturationProbe.of_steady(steps, cost.predict, tpot)]


async def _load(base_url: str, model: str, plan: ServedProbePlan, cost: CostModel, rough: ServedCost,
                steps_path: Path, lone: list[ServedProbe], vocab_size: int, seed: int) -> ServedCost:
    """Poisson arrivals at each of ``plan.load_factors`` times the saturation rate, ``plan.load_s`` each, sent
    open-loop (each request at its arrival time, whatever the server is doing), and the served terms fitted to
    the steps the server ran since the first. Each rate is set by the fit so far (the ``rough`` terms at first),
    so the steps fitted come from below, at and above the saturation they themselves give, whatever the first
    guess. First a burst of ``max_num_seqs`` requests whose outputs end one a step, so the engine has recorded
    the decode step of every batch size before the steps count."""
    rng = random.Random(seed)
    mean_prompt, mean_output = sum(plan.load_prompt) // 2, sum(plan.load_output) // 2
    lengths = {"prompt": LengthDist.parse("uniform:{}:{}".format(*plan.load_prompt)),
               "output": LengthDist.parse("uniform:{}:{}".format(*plan.load_output))}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, vocab_size - 10) for _ in range(n)]

    served = rough
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await asyncio.gather(*[_stream(client, model, prompt(8), 2 + i) for i in range(cost.engine.max_num_seqs)])
        start = time.monotonic()
        for i, factor in enumerate(plan.load_factors):
            rate = min(factor * replace(cost, served=served).saturation_rate(mean_prompt, mean_output),
                       plan.max_load_requests / plan.load_s)
            trace = generate(TraceSpec("poisson", plan.load_s, rate, **lengths), seed + 1 + i)
            t0, tasks = time.perf_counter(), []
            for t in trace:
                delay = t0 + t.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_stream(client, model, prompt(t.prompt_tokens), t.output_tokens)))
            await asyncio.gather(*tasks)
            served = ServedCost.fit_steps(read_served_steps(steps_path, start, time.monotonic()), cost.predict,
                                          lone, _load_avg())
            logger.info("served calibration: %d Poisson arrivals at %.1f req/s (%.1fx the saturation fitted "
                        "before them)", len(trace), rate, factor)
    return served


def calibrate_served(base_url: str, cost: CostModel, vocab_size: int,
                     plan: ServedProbePlan = ServedProbePlan(), seed: int = 0,
                     steps_path: Optional[Path] = None) -> ServedCost:
    """Probe the server at ``base_url`` (serving the model ``cost`` was calibrated on, with its engine options)
    and fit the served terms; with ``steps_path`` (the server's ``--step-record``), fit the step terms to its
    own steps under Poisson arrivals around its saturation (``ServedCost.fit_steps``)."""
    base_url = base_url.rstrip("/")
    if cost.engine is not None:
        plan = plan.fitted_to(cost.engine.max_model_len, cost.engine.max_num_seqs, cost.engine.max_num_batched_tokens)
    try:
        models = httpx.get(f"{base_url}/v1/models", timeout=30)
        if models.status_code != 200:
            raise ValueError(f"served: HTTP {models.status_code} from {base_url}/v1/models")
        model = models.json()["data"][0]["id"]
        probes = asyncio.run(_probe(base_url, model, cost, plan, vocab_size, seed))
        if steps_path is not None:
            if cost.engine is None:
                raise ValueError("served_steps: the cost model names no engine limits to set the load by")
            return asyncio.run(_load(base_url, model, plan, cost, ServedCost.fit(probes), steps_path, probes,
                                     vocab_size, seed))
        # Without the engine's limits the scheduler cannot say what a saturated engine runs: the fit goes without.
        saturated = asyncio.run(_saturate(base_url, model, cost, plan, vocab_size, seed)) if cost.engine else []
    except httpx.HTTPError as exc:
        raise ValueError(f"served: cannot probe {base_url}: {exc}") from None
    return ServedCost.fit(probes, load_avg=_load_avg(), saturation=saturated)


def _load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def served_summary(served: ServedCost) -> str:
    if served.served_steps:
        fitted_to = (f"{served.served_steps} served steps, total error "
                     f"{100 * served.served_steps_total_rel_error:+.1f}%; {served.num_probes} lone requests, "
                     f"|error| mean {100 * served.mean_abs_rel_error:.1f}%")
    else:
        fitted_to = (f"{served.num_probes} probes; |error| mean {100 * served.mean_abs_rel_error:.1f}%; "
                     f"{served.saturation_probes} saturated, error {100 * served.saturation_rel_error:+.1f}%")
    return (f"served: engine steps x{served.engine_scale:.2f}, mixed steps x{served.mixed_scale:.2f}, "
            f"+{served.per_step_s * 1e3:.2f} ms per step, +{served.per_token_s * 1e3:.3f} ms per streamed token, "
            f"+{served.per_request_s * 1e3:.1f} ms per request, step spread {served.step_noise_sigma:.2f} "
            f"({fitted_to}; load {served.load_avg})")
