"""``octavo simulate calibrate --served URL``: probe a running `octavo serve` of
the calibrated model and fit what serving adds to the bare engine steps
(octavo/simulate/served.py).

Two kinds of probe, each a streaming /v1/completions request with the prompt
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

- bursts of more requests than the batch holds, sent at once, with outputs of
  mixed lengths (so prompts join the running batch as others finish, as under
  a load past saturation): their requests' mean time from first token to
  last, read from the server's histogram
  (``octavo:request_decode_time_seconds``) as the TPOT above: from each
  request's own first token, so it does not matter when the client got each
  request to the server. The scheduler, run on the same burst
  (``burst_steps``), says which steps each request decoded through; the fit
  makes the served terms give that mean (octavo/simulate/served.py).

Each batch size runs once unmeasured first (and a burst too): the engine
records a decode step the first time it meets a batch size, a one-off cost
served traffic does not pay again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.replica import ReplicaShape, burst_steps
from octavo.simulate.served import SaturationProbe, ServedCost, ServedProbe

logger = logging.getLogger(__name__)

TPOT_HISTOGRAM = "octavo:request_time_per_output_token_seconds"
E2E_HISTOGRAM = "octavo:e2e_request_latency_seconds"
DECODE_HISTOGRAM = "octavo:request_decode_time_seconds"


@dataclass(frozen=True)
class ServedProbePlan:
    """The probe set: lone prompts of ``prompt_lens``; batches of ``batches`` decoding ``decode_tokens`` each
    after ``batch_prompt_len``-token prompts; all ``repeats`` times. Then ``bursts`` bursts (after one unmeasured)
    of ``burst_per_seq`` requests per sequence the engine batches, ``burst_prompt_len``-token prompts and outputs
    uniform in ``burst_output``."""

    prompt_lens: tuple[int, ...] = (32, 128, 256, 384)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    batch_prompt_len: int = 32
    decode_tokens: int = 48
    repeats: int = 4
    bursts: int = 2
    burst_per_seq: int = 3
    burst_prompt_len: int = 192
    burst_output: tuple[int, int] = (32, 96)

    def fitted_to(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> ServedProbePlan:
        """Cut to the engine's context, sequence limit and token budget (a batch's prompts fit one step)."""
        room = max(2, max_model_len - self.decode_tokens - 8)
        batches = tuple(sorted({min(b, max_num_seqs) for b in self.batches}))
        batch_prompt = max(2, min(self.batch_prompt_len, room, max_num_batched_tokens // batches[-1]))
        longest = max(2, min(self.burst_output[1], max_model_len // 2))
        burst_output = (min(self.burst_output[0], longest), longest)
        burst_prompt = max(2, min(self.burst_prompt_len, max_model_len - longest - 8))
        return ServedProbePlan(tuple(sorted({min(n, room) for n in self.prompt_lens})), batches, batch_prompt,
                               self.decode_tokens, self.repeats, self.bursts, self.burst_per_seq, burst_prompt,
                               burst_output)


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """When (``time.perf_counter``) each streamed chunk that carries tokens arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ValueError(f"served: HTTP {r.status_code} from the server: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.perf_counter())
    return times


async def _histogram_sums_counts(client: httpx.AsyncClient, names: Sequence[str]) -> list[tuple[float, float]]:
    """The server's histograms ``names``: each one's sum and count so far, from one scrape."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        raise ValueError(f"served: HTTP {r.status_code} from /metrics (the probes read its histograms)")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name in names:
            values.update({s.name: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))})
    missing = [name for name in names if f"{name}_count" not in values]
    if missing:
        raise ValueError(f"served: the server's /metrics has no {', '.join(missing)}")
    return [(values[f"{name}_sum"], values[f"{name}_count"]) for name in names]


async def _histogram_means(client: httpx.AsyncClient, names: Sequence[str], run: Awaitable[object]) -> list[float]:
    """The mean of what each of the server's histograms ``names`` observed while ``run`` ran."""
    before = await _histogram_sums_counts(client, names)
    await run
    after = await _histogram_sums_counts(client, names)
    return [(a[0] - b[0]) / max(1.0, a[1] - b[1]) for a, b in zip(after, before)]


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
                (tpot,) = await _histogram_means(client, [TPOT_HISTOGRAM], asyncio.gather(
                    *[_stream(client, model, prompt(n), out) for _ in range(b)]))
                engine_s = sum(cost.predict(StepWork(decode_seqs=b, decode_context_tokens=b * (n + j),
                                                     sampled_seqs=b)) for j in range(1, out)) / (out - 1)
                measured.append(ServedProbe(engine_s, b, tpot, first_token=False))
            if repeat:  # round 0 warms the front and records the engine's steps
                probes += measured
            logger.info("served calibration: round %d/%d done", repeat, plan.repeats)
    return probes


async def _saturate(base_url: str, model: str, cost: CostModel, plan: ServedProbePlan, vocab_size: int,
                    seed: int) -> list[SaturationProbe]:
    """The bursts (module docstring): the first one unmeasured."""
    rng = random.Random(seed)
    shape = ReplicaShape.of_engine(cost.engine)
    lengths = [(plan.burst_prompt_len, rng.randint(*plan.burst_output))
               for _ in range(plan.burst_per_seq * shape.scheduler.max_num_seqs)]
    steps = burst_steps(shape, lengths, seed)
    probes = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) \
            as client:
        for burst in range(plan.bursts + 1):
            prompts = [[rng.randrange(5, vocab_size - 10) for _ in range(n)] for n, _ in lengths]
            streams = asyncio.gather(*[_stream(client, model, prompt, out) for prompt, (_, out) in zip(prompts, lengths)])
            decode, e2e = await _histogram_means(client, [DECODE_HISTOGRAM, E2E_HISTOGRAM], streams)
            if burst:
                probes.append(SaturationProbe.of_burst(steps, cost.predict, decode))
            logger.info("served calibration: burst of %d requests %d/%d: mean latency %.2f s, first to last token "
                        "%.2f s", len(lengths), burst, plan.bursts, e2e, decode)
    return probes


def calibrate_served(base_url: str, cost: CostModel, vocab_size: int,
                     plan: ServedProbePlan = ServedProbePlan(), seed: int = 0) -> ServedCost:
    """Probe the server at ``base_url`` (serving the model ``cost`` was calibrated on, with its engine options)
    and fit the served terms."""
    base_url = base_url.rstrip("/")
    if cost.engine is not None:
        plan = plan.fitted_to(cost.engine.max_model_len, cost.engine.max_num_seqs, cost.engine.max_num_batched_tokens)
    try:
        models = httpx.get(f"{base_url}/v1/models", timeout=30)
        if models.status_code != 200:
            raise ValueError(f"served: HTTP {models.status_code} from {base_url}/v1/models")
        model = models.json()["data"][0]["id"]
        probes = asyncio.run(_probe(base_url, model, cost, plan, vocab_size, seed))
        # Without the engine's limits the scheduler cannot replay a burst: the fit goes without one.
        bursts = asyncio.run(_saturate(base_url, model, cost, plan, vocab_size, seed)) if cost.engine else []
    except httpx.HTTPError as exc:
        raise ValueError(f"served: cannot probe {base_url}: {exc}") from None
    return ServedCost.fit(probes, load_avg="/".join(f"{x:.2f}" for x in os.getloadavg()), saturation=bursts)


def served_summary(served: ServedCost) -> str:
    return (f"served: engine steps x{served.engine_scale:.2f}, mixed steps x{served.mixed_scale:.2f}, "
            f"+{served.per_step_s * 1e3:.2f} ms per step, +{served.per_token_s * 1e3:.3f} ms per streamed token, "
            f"+{served.per_request_s * 1e3:.1f} ms per request, step spread {served.step_noise_sigma:.2f} "
            f"({served.num_probes} probes; |error| mean {100 * served.mean_abs_rel_error:.1f}%; "
            f"{served.saturation_probes} bursts, error {100 * served.saturation_rel_error:+.1f}%; "
            f"load {served.load_avg})")
