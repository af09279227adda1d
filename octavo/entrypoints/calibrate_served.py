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
from typing import Awaitable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.simulate.cost_model import CostModel, StepWork
from octavo.simulate.replica import ReplicaShape, burst_steps
from octavo.simulate.served import SaturationProbe, ServedCost, ServedProbe

logger = logging.getLogger(__name__)

TPOT_HISTOGRAM = "octavo:request_time_per_output_token_seconds"


@dataclass(frozen=True)
class ServedProbePlan:
    """The probe set: lone prompts of ``prompt_lens``; batches of ``batches`` decoding ``decode_tokens`` each
    after ``batch_prompt_len``-token prompts; all ``repeats`` times. Then the server kept saturated for
    ``saturation_s`` by ``saturation_clients_per_seq`` clients per sequence the engine batches, each sending
    ``saturation_prompt_len``-token prompts with outputs uniform in ``saturation_output``, one after another."""

    prompt_lens: tuple[int, ...] = (32, 128, 256, 384)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    batch_prompt_len: int = 32
    decode_tokens: int = 48
    repeats: int = 4
    saturation_s: float = 12.0
    saturation_clients_per_seq: int = 2
    saturation_prompt_len: int = 192
    saturation_output: tuple[int, int] = (32, 96)

    def fitted_to(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> ServedProbePlan:
        """Cut to the engine's context, sequence limit and token budget (a batch's prompts fit one step)."""
        room = max(2, max_model_len - self.decode_tokens - 8)
        batches = tuple(sorted({min(b, max_num_seqs) for b in self.batches}))
        batch_prompt = max(2, min(self.batch_prompt_len, room, max_num_batched_tokens // batches[-1]))
        longest = max(2, min(self.saturation_output[1], max_model_len // 2))
        saturation_output = (min(self.saturation_output[0], longest), longest)
        saturation_prompt = max(2, min(self.saturation_prompt_len, max_model_len - longest - 8))
        return replace(self, prompt_lens=tuple(sorted({min(n, room) for n in self.prompt_lens})), batches=batches,
                       batch_prompt_len=batch_prompt, saturation_prompt_len=saturation_prompt,
                       saturation_output=saturation_output)


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
        # Without the engine's limits the scheduler cannot say what a saturated engine runs: the fit goes without.
        saturated = asyncio.run(_saturate(base_url, model, cost, plan, vocab_size, seed)) if cost.engine else []
    except httpx.HTTPError as exc:
        raise ValueError(f"served: cannot probe {base_url}: {exc}") from None
    return ServedCost.fit(probes, load_avg="/".join(f"{x:.2f}" for x in os.getloadavg()), saturation=saturated)


def served_summary(served: ServedCost) -> str:
    return (f"served: engine steps x{served.engine_scale:.2f}, mixed steps x{served.mixed_scale:.2f}, "
            f"+{served.per_step_s * 1e3:.2f} ms per step, +{served.per_token_s * 1e3:.3f} ms per streamed token, "
            f"+{served.per_request_s * 1e3:.1f} ms per request, step spread {served.step_noise_sigma:.2f} "
            f"({served.num_probes} probes; |error| mean {100 * served.mean_abs_rel_error:.1f}%; "
            f"{served.saturation_probes} saturated, error {100 * served.saturation_rel_error:+.1f}%; "
            f"load {served.load_avg})")
